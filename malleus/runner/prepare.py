"""Everything decided before a process starts: the manifest, the machine, the first plan.

A bad manifest, a machine too small for the job or a job no plan fits is refused here as
`BadInput`, with every fault at once and the words `malleus check` and the operator use, and
nothing has been started (exit 2).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from malleus.controller import ProblemBuilder
from malleus.job import BadInput, ResolvedJob, StragglerPolicy
from malleus.job.resources import Machine, Needs, probe_machine, require_resources
from malleus.planner.cost import ideal_step_time
from malleus.planner.plan import Plan
from malleus.planner.validate import validate_plan

from .processes import LaunchSpec
from .resume import checkpoint_generation, checkpoint_plan, previous_report, save_options

__all__ = [
    "MODES",
    "LocalRunOptions",
    "Mode",
    "Prepared",
    "ideal_step_seconds",
    "prepare",
    "true_rates",
]

Mode = Literal["live", "static", "restart"]
MODES: tuple[Mode, ...] = ("live", "static", "restart")


@dataclass(frozen=True)
class LocalRunOptions:
    """`malleus run`'s arguments (named apart from the trainer's per-process options)."""

    job: str
    mode: Mode = "live"
    steps: int | None = None
    report: str | None = None
    plot: str | None = None
    save_model: str | None = None
    save_hf: str | None = None
    workdir: str | None = None
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    progress_interval: float = 10.0
    scrape_interval: float = 0.2
    init_timeout: float = 120.0
    check_resources: bool = True
    resume: bool = False
    """Continue the run in `workdir` from its latest checkpoint (`malleus run --resume`)."""


@dataclass(frozen=True)
class Prepared:
    """A run ready to launch."""

    options: LocalRunOptions
    job: ResolvedJob
    plan: Plan
    workdir: Path
    token: str
    launch: LaunchSpec
    machine: Machine | None
    needs: Needs
    total_steps: int
    resume_step: int | None = None
    """The checkpoint's step when resuming (`--resume`); None for a fresh run."""

    @property
    def world(self) -> int:
        return self.job.world

    @property
    def policy(self) -> StragglerPolicy:
        return self.job.policy

    @property
    def tokens_per_step(self) -> int:
        return self.job.tokens_per_step

    @property
    def unit_seconds(self) -> float | None:
        """Emulated seconds of one cost-model unit; None with real timings."""
        return self.job.unit_seconds

    @property
    def schedule(self) -> tuple[tuple[int, int, float], ...]:
        return self.job.schedule

    def problem_builder(self) -> ProblemBuilder:
        """The controller's problem builder: the job's own `ResolvedJob.problem`."""
        return self.job.problem


def true_rates(schedule: tuple[tuple[int, int, float], ...], step: int) -> dict[int, float]:
    """Every rank's emulated slowdown at `step` (the latest scheduled factor at or before it)."""
    rates: dict[int, float] = {}
    for s, rank, factor in sorted(schedule, key=lambda e: e[0]):
        if s <= step:
            rates[rank] = factor
    return rates


def ideal_step_seconds(prepared: Prepared) -> list[float] | None:
    """The cost model's ideal step time of every step under the emulated rates, in seconds."""
    if prepared.unit_seconds is None:
        return None
    cache: dict[tuple[tuple[int, float], ...], float] = {}
    out = []
    for step in range(prepared.total_steps):
        rates = true_rates(prepared.schedule, step)
        key = tuple(sorted(rates.items()))
        if key not in cache:
            problem = prepared.job.problem(rates)
            cache[key] = ideal_step_time(problem) * prepared.unit_seconds
        out.append(cache[key])
    return out


def _judge(options: LocalRunOptions) -> ResolvedJob:
    """The job as `malleus check` judges it: schema, CEL and semantic faults, then its data
    files (the trainers run here), naming the file."""
    if options.steps is not None and options.steps < 1:
        raise BadInput.one("--steps", f"{options.steps}: need at least 1", what="arguments")
    return ResolvedJob.load(options.job).check().check_files()


def prepare(options: LocalRunOptions, machine: Machine | None = None) -> Prepared:
    """Validate everything; create the work directory, first plan and control token."""
    job = _judge(options)
    if machine is None and options.check_resources:
        machine = probe_machine()
    needs = require_resources(job, machine, source=options.job, check=options.check_resources)
    plan = job.initial_plan()  # generation 1, as in the cluster
    workdir = (
        Path(options.workdir)
        if options.workdir
        else Path(tempfile.mkdtemp(prefix=f"malleus-run-{job.name}-"))
    )
    stale = workdir / "checkpoints"
    resume_step = None
    total_steps = options.steps or job.steps
    if options.resume:
        resume_step, plan = _resumed(workdir, job, plan, total_steps)
    elif stale.is_dir() and any(stale.iterdir()):
        # The trainers resume from whatever checkpoint they find: this run would continue that one.
        raise BadInput.one(
            "--workdir",
            f"{workdir} holds checkpoints of an earlier run; use a new one, or continue "
            f"that run with `malleus run --resume {workdir}`",
            what="arguments",
        )
    (workdir / "plans").mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "plans" / f"gen-{plan.generation}.json"
    if not plan_path.exists() or not options.resume:
        plan_path.write_text(plan.to_json())
    if not options.resume:
        save_options(workdir, options)
    token = secrets.token_urlsafe(32)
    token_file = workdir / "control-token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    # Every local run keeps checkpoints in its work directory, whatever spec.checkpoint says:
    # with intervalSteps 0 the trainers save one only when stopped (Ctrl-C, SIGTERM) and at
    # the end, so any run stopped by hand can be continued with `--resume`.
    checkpoint_dir = str((workdir / "checkpoints").resolve())
    every = job.spec.checkpoint.interval_steps
    cpus = machine.cpus if machine is not None else (os.cpu_count() or 1)
    launch = LaunchSpec(
        job=str(Path(options.job).resolve()),
        world=job.world,
        workdir=workdir,
        token_file=token_file.resolve(),
        steps=options.steps,
        save_model=str(Path(options.save_model).resolve()) if options.save_model else None,
        save_hf=str(Path(options.save_hf).resolve()) if options.save_hf else None,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=every,
        init_timeout=options.init_timeout,
        threads_per_rank=max(1, cpus // job.world),
        fault_tolerant=options.mode != "restart",
    )
    return Prepared(
        options=options,
        job=job,
        plan=plan,
        workdir=workdir,
        token=token,
        launch=launch,
        machine=machine,
        needs=needs,
        total_steps=total_steps,
        resume_step=resume_step,
    )


def _resumed(workdir: Path, job: ResolvedJob, initial: Plan, total_steps: int) -> tuple[int, Plan]:
    """The checkpoint's step and the plan it was taken under (kept in its manifest; else
    `plans/gen-N.json`), checked against the job; BadInput when there is nothing to continue:
    no checkpoint, or the run already trained its steps."""
    found = checkpoint_generation(workdir / "checkpoints")
    previous = previous_report(workdir) or {}
    ended = previous.get("exit") or {}
    done = found is not None and found[0] >= total_steps
    if done or (ended.get("code") == 0 and previous.get("steps", 0) >= total_steps):
        raise BadInput.one(
            "--resume",
            f"the run in {workdir} finished: it trained all {total_steps} steps; nothing to "
            "continue (its report and logs are there as it left them)",
            what="arguments",
        )
    if found is None:
        raise BadInput.one(
            "--resume",
            f"{workdir / 'checkpoints'} holds no checkpoint to continue from: the run was "
            "stopped before it saved one (a run saves one when stopped by Ctrl-C or SIGTERM, "
            "and every spec.checkpoint.intervalSteps steps); start it again instead",
            what="arguments",
        )
    step, generation = found
    if not generation or generation == initial.generation:
        return step, initial
    path = workdir / "plans" / f"gen-{generation}.json"
    text = checkpoint_plan(workdir / "checkpoints")
    if text is None and path.exists():
        text = path.read_text()
    if text is None:
        raise BadInput.one(
            "--resume",
            f"the checkpoint of step {step} was taken under plan generation {generation}, "
            f"which neither its manifest nor {path} holds: the run cannot go on under it",
            what="arguments",
        )
    try:
        plan = Plan.from_json(text)
        faults = validate_plan(job.problem(), plan)
    except (ValueError, TypeError, KeyError) as e:
        faults = [f"not a plan: {e}"]
    if faults or plan.generation != generation:
        why = "; ".join(faults) or f"it is generation {plan.generation}"
        raise BadInput.one(
            "--resume",
            f"the plan of the checkpoint of step {step} (generation {generation}) does not fit "
            f"the job: {why}",
            what="arguments",
        )
    return step, plan
