"""`malleus train JOB.yaml ...` (local processes) and `python -m malleus.trainer JOB.yaml ...`
(one rank under torchrun). Importing this module is cheap: torch loads only when a command runs.

Under torchrun (a pod), the checkpoint directory defaults to spec.checkpoint and an existing
checkpoint there is always resumed, so a recreated worker continues the job.

Exit codes: 0 done, 1 training failed, 2 bad input (manifest, plan) rejected before any
process or collective starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from malleus.planner import Plan

    from .config import TrainConfig
    from .worker import RunOptions

__all__ = ["BadInput", "add_arguments", "load_inputs", "main", "worker_main"]


class BadInput(Exception):
    """A manifest or plan that cannot run; the message lists every fault."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="MalleusJob manifest (YAML)")
    parser.add_argument("--plan", help="Plan JSON to train under (default: the planner's plan)")
    parser.add_argument(
        "--steps",
        type=int,
        help="total steps (overrides spec.training.steps, also the LR schedule)",
    )
    parser.add_argument(
        "--until", type=int, help="stop after this many steps; --resume continues later"
    )
    parser.add_argument("--save-model", metavar="PATH", help="write the final full state dict")
    parser.add_argument(
        "--reference", action="store_true", help="train in one process, no parallelism"
    )
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here")
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in DIR"
    )
    parser.add_argument(
        "--control-port",
        type=int,
        help="serve /healthz /status /metrics /inject here (rank 0 locally; "
        "under torchrun default spec.controlPort on each node's first rank; -1 = off)",
    )
    parser.add_argument("--log-every", type=int, default=1, metavar="N")
    parser.add_argument("--quiet", action="store_true", help="no per-step lines")
    parser.add_argument(
        "--init-timeout", type=float, default=60.0, metavar="S", help="bound on joining the job"
    )
    parser.add_argument(
        "--switch",
        action="append",
        default=[],
        metavar="STEP:PLAN.json",
        help="switch to this plan (migrating state in place) so that it is in force from STEP "
        "on; repeatable. Goes through the coordinator's plan inbox like POST /plan. A plan "
        "whose generation is not above the previous one's is renumbered previous + 1.",
    )


def load_inputs(args: argparse.Namespace) -> tuple[TrainConfig, Plan]:
    """The job and the plan, validated (BadInput lists every fault); --switch plans are checked
    too and left in `args.switch_plans`."""
    cfg, plan = _job_and_plan(args)
    args.switch_plans = _switch_plans(cfg, plan, getattr(args, "switch", None) or [])
    return cfg, plan


def _read_plan(path: str, what: str) -> Plan:
    from pydantic import ValidationError

    from malleus.planner import Plan
    from malleus.planner.problem import validation_faults

    try:
        return Plan.from_json(Path(path).read_text())
    except ValidationError as e:
        raise BadInput(_bullets(f"{what}: not a Plan", validation_faults(e))) from None
    except OSError as e:
        raise BadInput(f"{what}: {e}") from None


def _switch_plans(cfg: TrainConfig, first: Plan, specs: list[str]) -> tuple[tuple[int, Plan], ...]:
    """`STEP:PLAN.json` items, sorted by step, validated, generations made increasing."""
    from .plan_inbox import PlanInbox

    items: dict[int, str] = {}
    for spec in specs:
        step_text, sep, path = spec.partition(":")
        try:
            step = int(step_text)
        except ValueError:
            step = -1
        if not sep or not path or step < 1:
            raise BadInput(f"--switch {spec}: expected STEP:PLAN.json with STEP >= 1")
        if step in items:
            raise BadInput(f"--switch {spec}: a second plan for step {step}")
        items[step] = path
    out = []
    generation = first.generation
    for step, path in sorted(items.items()):
        what = f"--switch {step}:{path}"
        plan = _read_plan(path, what)
        generation = max(plan.generation, generation + 1)
        plan = plan.model_copy(update={"generation": generation})
        code, answer = PlanInbox(cfg.problem(), -1).offer(plan.model_dump())  # as POST /plan
        if code != 202:
            raise BadInput(_bullets(f"{what}: invalid plan", answer.get("reasons", [])))
        out.append((step, plan))
    return tuple(out)


def _job_and_plan(args: argparse.Namespace) -> tuple[TrainConfig, Plan]:
    from malleus.jobspec import JobSpecError
    from malleus.planner import PlanError, check_plan

    from .config import load_config

    try:
        cfg = load_config(args.job)
    except (JobSpecError, ValueError, OSError) as e:
        raise BadInput(f"{args.job}: {e}") from None
    if args.steps is not None:
        if args.steps < 1:
            raise BadInput(f"--steps {args.steps}: need at least 1")
        cfg = cfg.with_steps(args.steps)
    if args.plan:
        plan = _read_plan(args.plan, args.plan)
    else:
        from malleus.controller.planning import default_planner

        plan = default_planner(cfg.problem())
    try:
        check_plan(cfg.problem(), plan)
    except PlanError as e:
        raise BadInput(_bullets(f"{args.plan or 'plan'}: invalid plan", e.violations)) from None
    _check_resume(cfg, args)
    return cfg, plan


def _check_resume(cfg: TrainConfig, args: argparse.Namespace) -> None:
    """A checkpoint to resume must continue this very training (same model, data, seed)."""
    if not (args.resume and args.checkpoint_dir):
        return
    from .checkpoint import CheckpointError, latest, read_manifest

    path = latest(args.checkpoint_dir)
    try:
        if path is not None:
            read_manifest(path, cfg)
    except (CheckpointError, OSError, ValueError) as e:
        raise BadInput(f"--resume: {e}") from None


def _bullets(head: str, lines: list[str]) -> str:
    return head + "\n" + "\n".join(f"  - {line}" for line in lines)


def _options(args: argparse.Namespace) -> RunOptions:
    from .worker import RunOptions

    return RunOptions(
        until=args.until,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        save_model=args.save_model,
        log_every=max(1, args.log_every),
        quiet=args.quiet,
        switches=getattr(args, "switch_plans", ()),
    )


def main(args: argparse.Namespace) -> int:
    """`malleus train`: all nodes x gpusPerNode ranks as local processes (or --reference)."""
    try:
        if args.reference:
            return _run_reference(_load_reference(args), args)
        cfg, plan = load_inputs(args)
    except BadInput as e:
        print(f"malleus train: {e}", file=sys.stderr)
        return 2
    from .launch import spawn_local

    port = None if args.control_port in (None, -1) else args.control_port
    try:
        spawn_local(cfg.world, _local_rank, (cfg, plan, _options(args), port, args.init_timeout))
    except Exception as e:  # a rank failed; its traceback was printed by that process
        print(f"malleus train: training failed: {e}", file=sys.stderr)
        return 1
    return 0


def _load_reference(args: argparse.Namespace) -> TrainConfig:
    from malleus.jobspec import JobSpecError

    from .config import load_config

    try:
        cfg = load_config(args.job)
    except (JobSpecError, ValueError, OSError) as e:
        raise BadInput(f"{args.job}: {e}") from None
    return cfg.with_steps(args.steps) if args.steps is not None else cfg


def _run_reference(cfg: TrainConfig, args: argparse.Namespace) -> int:
    from .reference import train_reference
    from .worker import _save_atomic

    def log(step: int, loss: float) -> None:
        if not args.quiet and ((step + 1) % max(1, args.log_every) == 0):
            print(f"[malleus] reference step {step + 1}/{cfg.steps} loss {loss:.4f}", flush=True)

    result = train_reference(cfg, args.until, log)
    if args.save_model:
        _save_atomic(result.full_state(), args.save_model)
        if not args.quiet:
            print(f"[malleus] saved model to {args.save_model}", flush=True)
    return 0


def _local_rank(
    cfg: TrainConfig, plan: Plan, opts: RunOptions, port: int | None, init_timeout: float
) -> int:
    from .launch import DistEnv

    env = DistEnv.from_env()
    return _run(cfg, plan, opts, env, port if env.rank == 0 else None, init_timeout)


def _run(
    cfg: TrainConfig, plan: Plan, opts: RunOptions, env: Any, port: int | None, init_timeout: float
) -> int:
    import torch.distributed as dist

    from malleus.planner import Plan

    from .launch import init_distributed, note_writer
    from .services import Services
    from .worker import run_rank

    device = init_distributed(env, init_timeout_s=init_timeout)
    # Every rank validated its own plan; a planner need not be deterministic across
    # processes, so all adopt rank 0's.
    shared = [plan.to_json() if env.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    plan = Plan.from_json(shared[0])
    services = Services.create(cfg, env.rank, control_port=port)
    if env.rank == 0:
        services.note = note_writer(env)
    try:
        run_rank(
            cfg, plan, opts, rank=env.rank, world=env.world_size, device=device, services=services
        )
    finally:
        services.close()
        dist.destroy_process_group()
    return 0


def worker_main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: validate first (exit 2), then join the job and train."""
    parser = argparse.ArgumentParser(prog="python -m malleus.trainer", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg, plan = load_inputs(args)
    except BadInput as e:
        print(f"malleus trainer: {e}", file=sys.stderr)
        return 2
    from .launch import DistEnv, LaunchError

    try:
        # In a pod, a recreated worker continues from the job's latest checkpoint, if any.
        if args.checkpoint_dir is None and cfg.checkpoint_dir is not None:
            args.checkpoint_dir, args.checkpoint_every = cfg.checkpoint_dir, cfg.checkpoint_every
        if args.checkpoint_dir is not None:
            args.resume = True
            _check_resume(cfg, args)
        env = DistEnv.from_env()
        if env.world_size != cfg.world:
            raise BadInput(
                f"WORLD_SIZE({env.world_size}) != nodes({cfg.nodes}) * gpusPerNode({cfg.gpus_per_node})"
            )
    except (LaunchError, BadInput) as e:
        print(f"malleus trainer: {e}", file=sys.stderr)
        return 2
    if args.control_port == -1:
        port = None
    elif args.control_port is not None:
        port = args.control_port if env.local_rank == 0 else None
    else:
        port = cfg.control_port if env.local_rank == 0 else None
    try:
        return _run(cfg, plan, _options(args), env, port, args.init_timeout)
    except LaunchError as e:
        print(f"malleus trainer: {e}", file=sys.stderr)
        return 1
