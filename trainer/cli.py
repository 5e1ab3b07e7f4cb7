"""`malleus train JOB.yaml ...` (local processes) and `python -m malleus.trainer JOB.yaml ...`
(one rank under torchrun). Importing this module is cheap: torch loads only when a command runs.

A job is judged as `malleus check` and `malleus run` judge it (`ResolvedJob.load`, `.check()`,
then the plan: `--plan`, checked against the job's planning problem, or the job's initial plan,
generation 1), and bad input is printed as the same `BadInput` text. `malleus train` also checks
that this machine can carry the job's ranks, as `malleus run` does, before starting any.

Under torchrun (a pod), the checkpoint directory defaults to spec.checkpoint and an existing
checkpoint there is always resumed, so a recreated worker continues the job.

Exit codes: 0 done, 1 training failed, 2 bad input (manifest, plan, machine, the files the job
names, a checkpoint that fails its checks) refused before any process or collective starts, 130
interrupted (Ctrl-C or SIGTERM: every rank is stopped). A rank in a pod that refuses its input
also leaves the faults as the container's termination message, for the job's Failed condition.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from malleus.errors import BadInput
from malleus.notation import step_progress
from malleus.trainer.run.inputs import judge, load_inputs

if TYPE_CHECKING:
    from malleus.job import ResolvedJob
    from malleus.planner import Plan
    from malleus.trainer.run.options import RunOptions

__all__ = ["add_arguments", "main", "worker_main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="MalleusJob manifest (YAML)")
    parser.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="the plan to train under, as `malleus plan -o` writes it (default: the job's "
        "first plan, the one `malleus check` shows)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="total steps (overrides spec.training.steps, also the LR schedule)",
    )
    parser.add_argument(
        "--until", type=int, help="stop after this many steps; --resume continues later"
    )
    parser.add_argument(
        "--save-model", metavar="PATH", help="write the final model's full state dict (PyTorch)"
    )
    parser.add_argument(
        "--save-hf",
        metavar="DIR",
        help="write the final model as a Hugging Face folder (config.json + safetensors)",
    )
    parser.add_argument(
        "--report",
        metavar="FILE",
        help="write the run's JSON report here (per_step: step, loss, seconds, rates, ...), "
        "as malleus run does",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="train in one process without parallelism (what every plan must match)",
    )
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints in DIR")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="save a checkpoint every N steps (0: only at the end; needs --checkpoint-dir)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in DIR"
    )
    parser.add_argument(
        "--control-port",
        type=int,
        metavar="PORT",
        help="serve the job's control endpoint (health, status, metrics, injected slowdowns) "
        "on PORT; off by default here, spec.controlPort in a cluster; -1: off",
    )
    parser.add_argument(
        "--log-every", type=int, default=1, metavar="N", help="print every N-th step (default 1)"
    )
    parser.add_argument("--quiet", action="store_true", help="no per-step lines")
    parser.add_argument(
        "--init-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds the processes have to start and meet (default 60)",
    )
    parser.add_argument(
        "--switch",
        action="append",
        default=[],
        metavar="STEP:PLAN.json",
        help="switch to this plan, moving the model's state in place, so that it is in force "
        "from STEP on, as a re-plan of a running job would; repeatable",
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="in a cluster only: a replacement worker joins the running job at a step boundary",
    )
    parser.add_argument(
        "--no-resource-check",
        action="store_true",
        help="start even if this machine looks too small for the job",
    )


def _options(args: argparse.Namespace) -> RunOptions:
    from malleus.trainer.run.options import RunOptions

    return RunOptions(
        steps=args.steps,
        until=args.until,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        save_model=args.save_model,
        save_hf=args.save_hf,
        log_every=max(1, args.log_every),
        quiet=args.quiet,
        switches=args.switch_plans,
        report=args.report,
        command=shlex.join(sys.argv),
    )


def main(args: argparse.Namespace) -> int:
    """`malleus train`: all nodes x gpusPerNode ranks as local processes (or --reference)."""
    try:
        if args.reference:
            return _run_reference(judge(args), args)
        job, plan = load_inputs(args)
    except BadInput as e:
        print(e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any rank started
        print("malleus train: interrupted", file=sys.stderr)
        return 130
    from malleus.trainer.launch.spawn import Interrupted, spawn_local
    from malleus.trainer.world.errors import LaunchError

    port = None if args.control_port in (None, -1) else args.control_port
    opts = _options(args)
    if opts.report:
        Path(opts.report).unlink(missing_ok=True)  # rank 0 writes it; absent if rank 0 died
    tolerant = bool(job.failures)  # emulated failures are survived, not fatal
    try:
        spawn_local(
            job.world,
            _local_rank,
            (job, plan, opts, port, args.init_timeout),
            fault_tolerant=tolerant,
        )
    except Interrupted as e:
        print(f"malleus train: {e}", file=sys.stderr)
        _failure_report(job, opts, 130, str(e))
        return 130
    except LaunchError as e:  # a rank failed; its traceback was printed by that process
        print(f"malleus train: training failed: {e}", file=sys.stderr)
        _failure_report(job, opts, 1, f"training failed: {e}")
        return 1
    return 0


def _failure_report(job: ResolvedJob, opts: RunOptions, code: int, reason: str) -> None:
    """`--report` of a run whose rank 0 was stopped or died before writing its own."""
    if opts.report and not Path(opts.report).exists():
        from malleus.trainer.run.report import failure_report

        failure_report(job, opts.report, opts.total_steps(job), code, reason, opts.command)


def _run_reference(job: ResolvedJob, args: argparse.Namespace) -> int:
    from malleus.trainer.engine.state import save_atomic
    from malleus.trainer.run.reference import train_reference

    steps = args.steps if args.steps is not None else job.steps

    from malleus.trainer.run.report import RunLog

    record = RunLog(job, None, steps, mode="reference", command=shlex.join(sys.argv))

    def log(step: int, loss: float) -> None:
        record.step(step, loss)
        if not args.quiet and ((step + 1) % max(1, args.log_every) == 0):
            print(f"[malleus] reference {step_progress(step, steps)} loss {loss:.4f}", flush=True)

    result = train_reference(job, steps=steps, until=args.until, log=log)
    if args.report:
        record.write(args.report, 0)
    if args.save_model:
        save_atomic(result.full_state(), args.save_model)
        if not args.quiet:
            print(f"[malleus] saved model to {args.save_model}", flush=True)
    if args.save_hf:
        from malleus.trainer.model.hf import save_hf

        save_hf(job, result.full_state(), args.save_hf)
        if not args.quiet:
            print(f"[malleus] saved Hugging Face model to {args.save_hf}", flush=True)
    return 0


def _local_rank(
    job: ResolvedJob, plan: Plan, opts: RunOptions, port: int | None, init_timeout: float
) -> int:
    from malleus.trainer.checkpoint.directory import CheckpointError
    from malleus.trainer.launch.distributed import DistEnv, fault_tolerant

    env = DistEnv.from_env()
    # Fault tolerant: every rank may become the coordinator; it serves the job's one port
    # while it is (the failed coordinator's socket is gone with its process).
    mine = port if env.rank == 0 or fault_tolerant() else None
    try:
        return _run(job, plan, opts, env, mine, init_timeout)
    except CheckpointError as e:  # changed since the launcher checked it: every rank refuses
        if env.rank == 0:
            print(f"malleus train: {e}", file=sys.stderr, flush=True)
        return 2


def _run(
    job: ResolvedJob,
    plan: Plan,
    opts: RunOptions,
    env: Any,
    port: int | None,
    init_timeout: float,
    join: bool = False,
    pod: bool = False,
) -> int:
    import torch.distributed as dist

    from malleus.trainer.engine.services import Services
    from malleus.trainer.launch.distributed import fault_tolerant, note_writer
    from malleus.trainer.run.loop import run_rank
    from malleus.trainer.run.report import RunLog
    from malleus.trainer.run.start import enter_job

    # Every rank validated its own plan; all adopt the coordinator's (`enter_job`).
    entered = enter_job(env, job, plan, init_timeout_s=init_timeout, join=join)
    world, device, plan, admission = entered.world, entered.device, entered.plan, entered.admission
    steps = opts.total_steps(job)
    services = Services.create(
        job,
        env.rank,
        control_port=port,
        steps=steps,
        serve_when_coordinator=fault_tolerant(),
        coordinator=world.coordinator(),
        pod=pod,
    )
    if env.rank == world.coordinator():
        services.note = note_writer(env)
    report = opts.report if env.rank == 0 and not join else None
    log = RunLog(job, plan, steps, command=opts.command) if report else None
    try:
        run_rank(
            job,
            plan,
            opts,
            rank=env.rank,
            world=world,
            device=device,
            services=services,
            log=log,
            admission=admission,
        )
    except BaseException as e:  # the report says how far it got and why it ended
        if log is not None and report:
            log.write(report, 1, f"rank 0 failed: {type(e).__name__}: {e}")
        raise
    else:
        if log is not None and report:
            log.write(report, 0)
    finally:
        services.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


_IN_POD = (
    "in a pod, paths are read where spec.podTemplate mounts the volumes: is the volume that "
    "holds them mounted at that path?"
)


def _refuse(error: BadInput) -> int:
    """A rank in a pod refuses its input: the faults on stderr and, where the kubelet made the
    file, as the container's termination message headed `BAD_INPUT_REASON`, which the operator
    turns into the job's Failed condition (`malleus.operator.failures`): no replacement pod
    could train on input every trainer refuses."""
    from malleus.errors import BAD_INPUT_EXIT
    from malleus.trainer.world.errors import say_ending

    if error.hint is None and any(": no such " in f.message for f in error.faults):
        error = BadInput(error.faults, error.source, what=error.what, hint=_IN_POD)
    print(error, file=sys.stderr)
    say_ending(BAD_INPUT_EXIT, str(error))
    return BAD_INPUT_EXIT


def worker_main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: validate first (exit 2), then join the job and train."""
    from malleus.trainer.launch.distributed import DistEnv, quiet_signals
    from malleus.trainer.launch.output import whole_lines
    from malleus.trainer.world.errors import LaunchError

    quiet_signals()
    whole_lines()  # torchrun's local ranks share one stdout and stderr
    parser = argparse.ArgumentParser(prog="python -m malleus.trainer", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        # In a pod, a recreated worker continues from the job's latest checkpoint, if any.
        job, plan = load_inputs(args, pod=True)
        env = DistEnv.from_env()
        if env.world_size != job.world:
            raise BadInput.one(
                "WORLD_SIZE",
                f"{env.world_size} != nodes({job.nodes}) * gpusPerNode({job.gpus_per_node})",
                what="environment",
            )
    except BadInput as e:
        return _refuse(e)
    except LaunchError as e:
        print(f"malleus trainer: {e}", file=sys.stderr)
        return 2
    base = job.spec.control_port if args.control_port is None else args.control_port
    if base == -1:
        port = None
    elif os.environ.get("MALLEUS_STORE"):  # every rank may become the coordinator: its own port
        port = base + env.local_rank
    else:
        port = base if env.local_rank == 0 else None
    from malleus.trainer.launch.distributed import fault_tolerant

    if args.join and not fault_tolerant():
        print(
            "malleus trainer: --join needs $MALLEUS_STORE (a store no rank hosts)", file=sys.stderr
        )
        return 2
    from malleus.errors import NO_PLAN_EXIT
    from malleus.trainer.checkpoint.directory import CheckpointError
    from malleus.trainer.recovery.protocol import NoValidPlan
    from malleus.trainer.world.errors import say_ending

    try:
        return _run(job, plan, _options(args), env, port, args.init_timeout, args.join, pod=True)
    except CheckpointError as e:  # every rank refuses together (state.resume), naming the fault
        print(f"malleus trainer: {e}", file=sys.stderr)
        return 2
    except NoValidPlan as e:  # the end of the job, not one more failure: nothing fits the rest
        print(f"[malleus] rank {env.rank}: {e}", flush=True)
        print(f"malleus trainer: {e}", file=sys.stderr)
        say_ending(NO_PLAN_EXIT, f"rank {env.rank}: {e}")
        return NO_PLAN_EXIT
    except LaunchError as e:
        print(f"malleus trainer: {e}", file=sys.stderr)
        return 1
