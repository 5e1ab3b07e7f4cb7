"""Judging `malleus train`'s inputs before any rank starts: the job, the machine, the plans, a
checkpoint to resume. Each refusal is a `BadInput` naming the file or option, exit 2.

The job is judged as `malleus check` and `malleus run` judge it (`ResolvedJob.load`, `.check()`,
`.check_files()`, then the plan: `--plan`, checked against the job's planning problem, or the
job's initial plan, generation 1).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from malleus.errors import BadInput, Fault

if TYPE_CHECKING:
    from malleus.job import ResolvedJob
    from malleus.planner import Plan

__all__ = ["judge", "load_inputs"]


def load_inputs(args: argparse.Namespace, *, pod: bool = False) -> tuple[ResolvedJob, Plan]:
    """The job and the plan, judged (`BadInput` lists every fault); --switch plans are checked
    too and left in `args.switch_plans`.

    Locally (`malleus train`) the machine must carry the job's ranks. In a pod (`pod`, one rank
    of many machines) the checkpoint directory defaults to spec.checkpoint and is resumed.
    """
    job = judge(args)
    if pod:
        ckpt = job.spec.checkpoint
        if args.checkpoint_dir is None and ckpt.interval_steps > 0:
            args.checkpoint_dir, args.checkpoint_every = ckpt.path, ckpt.interval_steps
        if args.checkpoint_dir is not None:
            args.resume = True
    else:
        _check_machine(job, args)
    plan = _first_plan(job, args)
    args.switch_plans = _switch_plans(job, plan, args.switch)
    _check_resume(job, args, whole=not pod)
    return job, plan


def judge(args: argparse.Namespace) -> ResolvedJob:
    """The job as `malleus check` and `malleus run` judge it, its faults naming the file."""
    from malleus.job import ResolvedJob

    if args.steps is not None and args.steps < 1:
        raise BadInput.one("--steps", f"{args.steps}: need at least 1", what="arguments")
    try:
        # The data files too: they are where this command runs (in a pod, on its volume).
        return ResolvedJob.load(args.job).check().check_files()
    except BadInput as error:
        raise BadInput(error.faults, error.source or args.job, what=error.what) from None


def _first_plan(job: ResolvedJob, args: argparse.Namespace) -> Plan:
    """`--plan`, valid for the job's problem; without it the job's initial plan (generation 1,
    as the operator and `malleus run` start with)."""
    from malleus.planner import PlanError, check_plan

    if not args.plan:
        try:
            return job.initial_plan()
        except BadInput as error:
            raise BadInput(error.faults, error.source or args.job, what=error.what) from None
    plan = _read_plan(args.plan)
    try:
        check_plan(job.problem(), plan)
    except PlanError as error:
        raise BadInput(error.faults, args.plan, what="plan") from None
    return plan


def _read_plan(path: str, where: str | None = None) -> Plan:
    """A Plan JSON file; `BadInput` naming `where` (default: the file) when it is not one."""
    from pydantic import ValidationError

    from malleus.job import read_text
    from malleus.planner import Plan

    source = where or path
    try:
        return Plan.from_json(read_text(path, what="plan"))
    except BadInput as error:
        raise BadInput(error.faults, source, what="plan") from None
    except ValidationError as error:
        faults = [Fault(".".join(map(str, e["loc"])), e["msg"]) for e in error.errors()]
        raise BadInput(faults, source, what="plan") from None


def _switch_plans(job: ResolvedJob, first: Plan, specs: list[str]) -> tuple[tuple[int, Plan], ...]:
    """`STEP:PLAN.json` items, sorted by step, validated, numbered on from `first` (the inbox
    takes only the next generation, so a file's own generation is not kept)."""
    from malleus.trainer.switching.plan_inbox import PlanInbox

    items: dict[int, str] = {}
    for spec in specs:
        step_text, sep, path = spec.partition(":")
        try:
            step = int(step_text)
        except ValueError:
            step = -1
        if not sep or not path or step < 1:
            raise BadInput.one("--switch", f"{spec}: expected STEP:PLAN.json with STEP >= 1")
        if step in items:
            raise BadInput.one("--switch", f"{spec}: a second plan for step {step}")
        items[step] = path
    out = []
    generation = first.generation
    for step, path in sorted(items.items()):
        where = f"--switch {step}:{path}"
        plan = _read_plan(path, where)
        generation += 1
        plan = plan.model_copy(update={"generation": generation})
        inbox = PlanInbox(job.problem(), generation - 1)
        code, answer = inbox.offer(plan.model_dump())  # as POST /plan
        if code != 202:
            faults = [Fault(f["path"], f["message"]) for f in answer.get("faults", [])]
            raise BadInput(faults or [Fault("", str(answer))], where, what="plan")
        out.append((step, plan))
    return tuple(out)


def _check_resume(job: ResolvedJob, args: argparse.Namespace, *, whole: bool) -> None:
    """A checkpoint to resume must be intact and continue this very training (same model, data,
    seed); a broken `latest` is refused, never taken for "no checkpoint".

    `whole` (locally, before any rank starts): every file's sha256 and every piece. In a pod
    each rank checks the pointer and the manifest here, and its own files once it has joined
    (`state.resume`), rather than every rank reading the whole model.
    """
    if not (args.resume and args.checkpoint_dir):
        return
    from malleus.trainer.checkpoint.directory import CheckpointError, latest, read_manifest, verify

    try:
        path = latest(args.checkpoint_dir)
        if path is not None and whole:
            verify(path, job)
        elif path is not None:
            read_manifest(path, job)
    except CheckpointError as e:
        raise BadInput.one("--resume", str(e), what="arguments") from None


def _check_machine(job: ResolvedJob, args: argparse.Namespace) -> None:
    """`malleus run`'s resource check: refuse a job too large for this machine before any of
    its ranks starts (the same words as `malleus run`)."""
    if args.no_resource_check:
        return
    from malleus.job.resources import probe_machine, require_resources

    require_resources(job, probe_machine(), source=args.job)
