"""Everything decided before a process starts: the manifest, the machine, the first plan.

A bad manifest, a machine too small for the job or a job no plan fits is refused here, with
every reason at once, and nothing has been started (exit 2).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from malleus.controller import StragglerPolicy, build_problem, default_planner
from malleus.jobspec import JobSpecError, MalleusJob, load_job, resolve_model
from malleus.planner.cost import ideal_step_time
from malleus.planner.plan import Plan
from malleus.planner.validate import validate_plan

from .processes import LaunchSpec
from .resources import Machine, Needs, check_resources, job_needs, probe_machine

__all__ = [
    "BadRunInput",
    "Mode",
    "Prepared",
    "RunOptions",
    "ideal_step_seconds",
    "model_parameters",
    "prepare",
    "true_rates",
]

Mode = Literal["live", "static", "restart"]
MODES: tuple[Mode, ...] = ("live", "static", "restart")


class BadRunInput(Exception):
    """The run cannot start; the message says every reason (exit 2)."""


@dataclass(frozen=True)
class RunOptions:
    """`malleus run`'s arguments."""

    job: str
    mode: Mode = "live"
    steps: int | None = None
    report: str | None = None
    plot: str | None = None
    save_model: str | None = None
    workdir: str | None = None
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    progress_interval: float = 10.0
    scrape_interval: float = 0.2
    init_timeout: float = 120.0
    check_resources: bool = True


@dataclass(frozen=True)
class Prepared:
    """A run ready to launch."""

    options: RunOptions
    job: MalleusJob
    policy: StragglerPolicy
    plan: Plan
    workdir: Path
    token: str
    launch: LaunchSpec
    machine: Machine | None
    needs: Needs
    total_steps: int
    tokens_per_step: int
    unit_seconds: float | None
    """Emulated seconds of one cost-model unit; None with real timings."""
    schedule: tuple[tuple[int, int, float], ...]

    @property
    def world(self) -> int:
        return self.job.spec.nodes * self.job.spec.gpus_per_node

    def problem_builder(self) -> Any:
        return partial(build_problem, self.job)


def model_parameters(job: MalleusJob) -> int:
    """Parameters of the whole model (blocks, embedding and head)."""
    from malleus.controller.problem import layer_parameters

    cfg = resolve_model(job.spec.model)
    head = 0 if cfg.tied_embeddings else cfg.vocab * cfg.hidden
    return cfg.layers * layer_parameters(cfg) + cfg.vocab * cfg.hidden + head


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
            problem = build_problem(prepared.job, dict(rates))
            cache[key] = ideal_step_time(problem) * prepared.unit_seconds
        out.append(cache[key])
    return out


def _load(options: RunOptions) -> MalleusJob:
    try:
        job = load_job(options.job)
        resolve_model(job.spec.model)
    except JobSpecError as e:
        raise BadRunInput(str(e)) from None
    except OSError as e:
        raise BadRunInput(f"{options.job}: {e.strerror or e}") from None
    if options.steps is not None and options.steps < 1:
        raise BadRunInput(f"--steps {options.steps}: need at least 1")
    return job


def _initial_plan(job: MalleusJob) -> Plan:
    problem = build_problem(job, {})
    try:
        plan = default_planner(problem)
    except Exception as e:
        raise BadRunInput(f"no plan fits this job: {e}") from None
    faults = validate_plan(problem, plan)
    if faults:
        raise BadRunInput(
            "the planner's first plan is invalid:\n" + "\n".join(f"  - {f}" for f in faults)
        )
    return plan


def prepare(options: RunOptions, machine: Machine | None = None) -> Prepared:
    """Validate everything; create the work directory, first plan and control token."""
    job = _load(options)
    spec = job.spec
    world = spec.nodes * spec.gpus_per_node
    if machine is None and options.check_resources:
        machine = probe_machine()
    emu = spec.emulation
    gpus = machine is not None and machine.gpus > 0
    needs = job_needs(
        world,
        emulated=emu.enabled,
        gpus=gpus,
        parameters=model_parameters(job),
        tp=spec.parallelism.tp,
    )
    if options.check_resources and machine is not None:
        problems = check_resources(needs, machine, gpu_memory_mib=spec.resources.gpu_memory_mib)
        if problems:
            raise BadRunInput(
                f"this machine cannot run {job.metadata.name} ({world} ranks):\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
    plan = _initial_plan(job)
    workdir = (
        Path(options.workdir)
        if options.workdir
        else Path(tempfile.mkdtemp(prefix=f"malleus-run-{job.metadata.name}-"))
    )
    stale = workdir / "checkpoints"
    if stale.is_dir() and any(stale.iterdir()):
        # The trainers resume from whatever checkpoint they find: this run would continue that one.
        raise BadRunInput(f"--workdir {workdir} holds checkpoints of an earlier run; use a new one")
    (workdir / "plans").mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "plans" / f"gen-{plan.generation}.json"
    plan_path.write_text(plan.to_json())
    token = secrets.token_urlsafe(32)
    token_file = workdir / "control-token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    checkpoint_dir, every = None, 0
    if options.mode == "restart":
        checkpoint_dir = str((workdir / "checkpoints").resolve())
    if spec.checkpoint.interval_steps > 0:
        checkpoint_dir = str((workdir / "checkpoints").resolve())
        every = spec.checkpoint.interval_steps
    cpus = machine.cpus if machine is not None else (os.cpu_count() or 1)
    launch = LaunchSpec(
        job=str(Path(options.job).resolve()),
        world=world,
        workdir=workdir,
        token_file=token_file.resolve(),
        steps=options.steps,
        save_model=str(Path(options.save_model).resolve()) if options.save_model else None,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=every,
        init_timeout=options.init_timeout,
        threads_per_rank=max(1, cpus // world),
    )
    cfg = resolve_model(spec.model)
    return Prepared(
        options=options,
        job=job,
        policy=StragglerPolicy.from_job(job),
        plan=plan,
        workdir=workdir,
        token=token,
        launch=launch,
        machine=machine,
        needs=needs,
        total_steps=options.steps or spec.training.steps,
        tokens_per_step=spec.training.global_batch_size * cfg.sequence,
        unit_seconds=sum(emu.layer_seconds()) if emu.enabled else None,
        schedule=tuple((e.step, e.rank, e.factor) for e in emu.schedule) if emu.enabled else (),
    )
