"""The `malleus` command: `check` and `plan` need no torch; `train` and `run` start trainers.

Every subcommand judges a job the way the operator does (`ResolvedJob`) and reports bad input
the same way: `str(BadInput)` on stderr, every fault with its field path, exit 2, no traceback.
Subcommands import what they need when they run, so `malleus check` works in the operator's
image and the trainer (torch) loads only for `train`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from malleus.errors import BadInput

if TYPE_CHECKING:
    from malleus.job import ResolvedJob
    from malleus.planner import Plan, PlanningProblem

__all__ = ["describe_job", "main"]

_PLAN_INPUT = "MalleusJob or PlanningProblem"

_DESCRIPTION = """\
Train a model on many GPUs and keep it fast when some of them slow down or fail.

  malleus check JOB.yaml    is the job valid? its model, sizes and first plan
  malleus plan JOB.yaml     the parallel layout, also for what-if slowdowns (--rates)
  malleus run JOB.yaml      train on this machine, re-planning around slow GPUs
  malleus train JOB.yaml    train on this machine under one plan (or --plan FILE)
  malleus data prepare      tokenize text files once into a token file

A job that cannot run is refused before anything starts: every fault is printed with the
manifest field to change, and the command exits with status 2."""

_NO_FILE_CHECK = (
    "if these paths exist only on the cluster's volumes, `malleus check --no-file-check` judges "
    "the rest here (each trainer checks them when it starts)"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="malleus",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "check",
        help="judge a MalleusJob as the operator would, show its model and first plan",
        description="Judge a MalleusJob as the operator would, and read the files it names "
        "(spec.model.path, spec.training.data) as the trainers will: exit 0 with the resolved "
        "job and its first plan, or 2 with every fault and the field to change.",
    )
    c.add_argument("job", help="MalleusJob manifest (YAML)")
    c.add_argument("--json", action="store_true", help="print the verdict as JSON on stdout")
    c.add_argument(
        "--no-file-check",
        action="store_true",
        help="do not look for the model folder and data files here (a cluster job whose "
        "paths exist only on the pods' volumes; each trainer checks them when it starts)",
    )
    c.set_defaults(func=_cmd_check)

    p = sub.add_parser("plan", help="plan a layout for a MalleusJob or a PlanningProblem")
    p.add_argument("problem", help="MalleusJob manifest (YAML) or PlanningProblem (JSON)")
    p.add_argument(
        "--rates",
        metavar="RANK=RATE,...",
        help="what-if straggling rates laid over the input's, e.g. 3=2.5,17=failed "
        "(failed or null: unusable); a job is then re-planned from its initial plan",
    )
    p.add_argument("-o", "--output", help="write the Plan JSON here")
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="bound the search (default: the job's planningTimeoutSeconds for a MalleusJob, "
        "the planner's own budget for its size for a PlanningProblem); the best plan found "
        "by then is printed",
    )
    p.set_defaults(func=_cmd_plan)

    from malleus.trainer import cli as trainer_cli  # cheap: torch loads only when it runs

    t = sub.add_parser(
        "train",
        help="train a MalleusJob on this machine under one plan",
        description="Train a MalleusJob on this machine: one process per GPU of the job "
        "(nodes x gpusPerNode), under the job's first plan or --plan, without re-planning "
        "(`malleus run` re-plans around slow GPUs).",
    )
    trainer_cli.add_arguments(t)
    t.set_defaults(func=trainer_cli.main)

    from malleus.runner import cli as runner_cli  # torch-free: the trainers are subprocesses

    r = sub.add_parser(
        "run", help="run a MalleusJob on this machine, re-planning around stragglers"
    )
    runner_cli.add_arguments(r)
    r.set_defaults(func=runner_cli.main)

    d = sub.add_parser("data", help="prepare training data (docs/data.md)")
    data = d.add_subparsers(dest="data_command", required=True)
    prep = data.add_parser(
        "prepare", help="tokenize .txt / .jsonl files once into the tokens format"
    )
    from malleus.trainer.data import (
        prepare as prepare_data,  # cheap: numpy and tokenizers load when it runs
    )

    prepare_data.add_arguments(prep)
    prep.set_defaults(func=prepare_data.main)
    return parser


# ---- malleus check ----------------------------------------------------------------------------


def describe_job(job: ResolvedJob) -> dict[str, Any]:
    """The resolved job as `check` shows it: what the operator derives from the manifest
    (`parameters`: exactly the trainer's model's)."""
    from malleus.job.memory import decoder_parameters

    cfg, par = job.model, job.spec.parallelism
    seconds = job.layer_seconds()
    return {
        "name": job.name,
        "source": job.source,
        "nodes": job.nodes,
        "gpus_per_node": job.gpus_per_node,
        "world": job.world,
        "model": {
            "preset": job.spec.model.preset,
            "path": job.spec.model.path,
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "kv_heads": cfg.kv_heads,
            "ffn": cfg.ffn,
            "vocab": cfg.vocab,
            "sequence": cfg.sequence,
            "tied_embeddings": cfg.tied_embeddings,
        },
        "parameters": decoder_parameters(cfg),
        "tp": job.tp,
        "dp": par.dp,
        "pp": par.pp,
        "micro_batch_size": job.micro_batch_size,
        "micro_batches": job.micro_batches,
        "tokens_per_step": job.tokens_per_step,
        "steps": job.steps,
        "gpu_memory_mib": job.spec.resources.gpu_memory_mib,
        "emulation": None
        if seconds is None
        else {
            "layer_forward_seconds": seconds[0],
            "layer_backward_seconds": seconds[1],
            "gpu_profile": job.spec.emulation.gpu_profile,
            "schedule": [list(entry) for entry in job.schedule],
        },
        "straggler_policy": job.policy.model_dump(mode="json", by_alias=True),
    }


def _job_text(d: dict[str, Any]) -> str:
    m = d["model"]
    preset = f"preset {m['preset']}: " if m["preset"] else ""
    if m["path"]:
        preset = f"{m['path']}: "
    kv = f" ({m['kv_heads']} kv)" if m["kv_heads"] != m["heads"] else ""
    tied = ", tied embeddings" if m["tied_embeddings"] else ""
    pinned = ", ".join(f"{k} {d[k]}" for k in ("dp", "pp") if d[k] is not None) or "dp, pp free"
    emu = d["emulation"]
    if emu is None:
        clock = "emulation: off (real timings are the rates)"
    else:
        profile = f" ({emu['gpu_profile']})" if emu["gpu_profile"] else ""
        clock = (
            f"emulation: on{profile}, one layer-shard {emu['layer_forward_seconds'] * 1e3:g} ms "
            f"forward + {emu['layer_backward_seconds'] * 1e3:g} ms backward, "
            f"{len(emu['schedule'])} scheduled slowdown(s)"
        )
    policy = ", ".join(f"{k} {v}" for k, v in d["straggler_policy"].items())
    return "\n".join(
        [
            f"job {d['name']}: valid",
            f"world: {d['nodes']} nodes x {d['gpus_per_node']} GPUs = {d['world']} ranks",
            f"model: {preset}{m['layers']} layers, hidden {m['hidden']}, heads {m['heads']}{kv}, "
            f"ffn {m['ffn']}, vocab {m['vocab']}, sequence {m['sequence']}{tied}; "
            f"{d['parameters']:,} parameters",
            f"parallelism: tp {d['tp']}, {pinned}; {d['gpu_memory_mib']} MiB per GPU",
            f"training: {d['micro_batches']} micro-batches of {d['micro_batch_size']} per step, "
            f"{d['tokens_per_step']:,} tokens per step, {d['steps']} steps",
            clock,
            f"straggler policy: {policy}",
        ]
    )


def _step_seconds(job: ResolvedJob, plan: Plan) -> float | None:
    """The plan's predicted step time in emulated seconds; None with real timings."""
    unit = job.unit_seconds
    if unit is None or plan.estimate is None:
        return None
    return plan.estimate.step_time * unit


def _check_files(job: ResolvedJob) -> None:
    """`job.check_files()`; a path that does not exist here gets the way out for a cluster
    job, whose paths exist only in its pods."""
    faults = job.file_faults()
    if faults:
        missing = any(": no such " in f.message for f in faults)
        raise BadInput(faults, job.source, hint=_NO_FILE_CHECK if missing else None)


def _policy_faults(job: ResolvedJob) -> None:
    """The pod template judged by the chart's default `PodTemplatePolicy`, as the API server and
    the operator of a default install judge it (each fault names the chart value that would
    allow it; an admin's values may allow more)."""
    from malleus.job.podpolicy import PodTemplatePolicy, policy_faults

    faults = policy_faults(
        job.spec.pod_template, PodTemplatePolicy(), operator_service_account=None
    )
    if faults:
        raise BadInput(faults, job.source)


def _cmd_check(args: argparse.Namespace) -> int:
    from malleus.job import ResolvedJob
    from malleus.planner.cli import summary

    try:
        job = ResolvedJob.load(args.job)
        _policy_faults(job)  # what the pods may hold, before any planning
        plan = job.initial_plan()
        if not args.no_file_check:
            _check_files(job)  # the model folder and data files, as the trainers will read them
    except BadInput as error:
        if args.json:
            faults = [{"path": f.path, "message": f.message} for f in error.faults]
            verdict = {"valid": False, "source": args.job, "faults": faults, "hint": error.hint}
            print(json.dumps(verdict))
        raise
    seconds = _step_seconds(job, plan)
    if args.json:
        verdict = {
            "valid": True,
            "job": describe_job(job),
            "files_checked": not args.no_file_check,
            "plan": json.loads(plan.to_json()),
            "predicted_step_seconds": seconds,
        }
        print(json.dumps(verdict, indent=1))
        return 0
    print(_job_text(describe_job(job)))
    if args.no_file_check:
        print("files: not looked for here (--no-file-check); each trainer checks them at start")
    print(f"\ninitial plan:\n{summary(job.problem(), plan)}")
    if seconds is not None:
        print(f"predicted step time: {seconds:.3f} s on the emulated clock")
    return 0


# ---- malleus plan -----------------------------------------------------------------------------


def _documents(path: str) -> list[Any]:
    """JSON first (a PlanningProblem's floats such as 1e3 are not YAML 1.1 floats), else YAML;
    a ``.json`` file that is neither is told where its JSON breaks."""
    from malleus.job import read_documents, read_text

    text = read_text(path, what=_PLAN_INPUT)
    try:
        return [json.loads(text)]
    except RecursionError:
        raise BadInput.one("", "nested too deeply", path, what=_PLAN_INPUT) from None
    except json.JSONDecodeError as error:
        if not path.endswith(".json"):
            return read_documents(path, what=_PLAN_INPUT)
        raise BadInput.one(
            "",
            f"not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}",
            path,
            what=_PLAN_INPUT,
        ) from None


def _job_problem(
    path: str, rates: dict[int, float | None], time_limit: float | None
) -> tuple[PlanningProblem, Plan]:
    """The job's initial plan, or with `rates` its re-plan from there, as the controller would."""
    from malleus.job import ResolvedJob
    from malleus.planner.cli import check_ranks
    from malleus.planner.search import plan

    job = ResolvedJob.load(path)
    check_ranks(rates, job.world)
    budget = time_limit if time_limit is not None else float(job.policy.planning_timeout_seconds)
    initial = job.initial_plan(time_limit=budget)
    if not rates:
        return job.problem(), initial
    try:
        problem = job.problem(rates, previous_plan=initial)
        return problem, plan(problem, time_limit=budget)
    except BadInput as error:
        raise BadInput(error.faults, path, what=error.what) from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from malleus.job import KIND
    from malleus.planner.cli import load_problem, parse_rates, show_plan
    from malleus.planner.search import plan

    rates = parse_rates(args.rates) if args.rates else {}
    limit = args.time_limit
    if limit is not None and not (math.isfinite(limit) and 0 < limit <= 3600):
        raise BadInput.one(
            "--time-limit", f"{limit:g} is not allowed; need 0 < seconds <= 3600", what="arguments"
        )
    documents = _documents(args.problem)
    if any(isinstance(d, dict) and d.get("kind") == KIND for d in documents):
        problem, result = _job_problem(args.problem, rates, limit)
    elif len(documents) == 1 and isinstance(documents[0], dict):
        problem = load_problem(documents[0], args.problem, rates)
        try:
            result = plan(problem, time_limit=limit)
        except BadInput as error:
            raise BadInput(error.faults, args.problem, what=error.what) from None
    else:
        raise BadInput.one(
            "",
            f"expected a {KIND} manifest or a PlanningProblem JSON object",
            args.problem,
            what=_PLAN_INPUT,
        )
    show_plan(problem, result, args.output, sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; bad input of any of them is printed and exits 2."""
    args = _build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BadInput as error:
        print(error, file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `malleus check --json | head`: the reader left; say nothing more (Python's advice:
        # point stdout at devnull so the interpreter's final flush does not raise again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
