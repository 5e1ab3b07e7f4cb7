"""`run_rank`: one rank's run, from step 0 or the latest checkpoint to the end or a stop.

Around the steps of a `Trainer` (trainer/engine/trainer.py): resume, the `--switch` plans offered to
the coordinator's inbox at their steps, the log lines (rank 0), checkpoints every N steps and
at a stop that asks for one, and the final full model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from malleus.job import ResolvedJob
from malleus.notation import size, step_progress
from malleus.planner import Plan
from malleus.trainer.checkpoint.directory import latest
from malleus.trainer.engine.figures import CALIBRATE_STEP
from malleus.trainer.engine.services import Services
from malleus.trainer.engine.state import gather_full, resume, save_atomic, save_checkpoint
from malleus.trainer.engine.step import StepReport
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.model.hf import save_hf
from malleus.trainer.model.precision import Precision
from malleus.trainer.recovery.join import Admission, admit, joined, joiners
from malleus.trainer.recovery.ledger import Ledger
from malleus.trainer.recovery.protocol import PeerFailure, as_failure, recover
from malleus.trainer.recovery.restore import settled
from malleus.trainer.world.world import World, sized_hang_timeout

from .options import RunOptions
from .report import RunLog

__all__ = ["run_rank"]

log = log_ = logging.getLogger(__name__)
_T = TypeVar("_T")


def _say(text: str) -> None:
    print(text, flush=True)


def run_rank(
    job: ResolvedJob,
    plan: Plan,
    opts: RunOptions,
    *,
    rank: int,
    world: World,
    device: torch.device,
    services: Services | None = None,
    log: RunLog | None = None,
    trainer_hook: Callable[[Trainer], None] | None = None,
    admission: Admission | None = None,
    ledger: Ledger | None = None,
) -> list[StepReport]:
    """Train this rank from step 0 (or the latest checkpoint) to `opts.until` or the end;
    `log` (rank 0, `--report`) records every step and switch; `trainer_hook` sees the Trainer
    once built (tests); `admission`: this rank is a replacement the running job admitted (it
    starts at the job's step, holding nothing; trainer/run/start.py `join_job`); `ledger`: recovery's record to keep
    (tests read it; a new one by default). A failed peer (`PeerFailure`, fault-tolerant jobs) is
    recovered from (trainer/recovery/protocol.py) and the run goes on, from the failed step or a
    checkpoint; replacements are admitted at the step boundaries that announce them."""
    steps = opts.total_steps(job)
    precision = Precision.of(job.spec.training.precision, float64=opts.float64)
    ledger = ledger if ledger is not None else Ledger()
    trainer = Trainer(
        job,
        plan,
        rank=rank,
        world=world,
        device=device,
        steps=steps,
        services=services,
        precision=precision,
        joiners=lambda: joiners(ledger, world),
    )
    if trainer_hook is not None:
        trainer_hook(trainer)
    speak = _speaks(trainer, opts)
    if admission is not None:
        joined(trainer, ledger, admission)
    elif opts.resume and opts.checkpoint_dir:
        path = resume(trainer, opts.checkpoint_dir)  # refuses a bad checkpoint on every rank
        if speak and path is not None:
            _say(f"[malleus] resumed from {path} at step {trainer.step}")
        elif speak:
            _say(f"[malleus] no checkpoint in {opts.checkpoint_dir}; starting at step 0")
    if speak:
        _say(trainer.layout.rank_matrix())
    until = min(steps, opts.until if opts.until is not None else steps)
    pinned = _pinned_switches(opts.switches, trainer.step, speak)
    if trainer.services.stop is not None:
        trainer.services.stop.can_checkpoint = opts.checkpoint_dir is not None
    reports: list[StepReport] = []
    saved = [-1]  # the step last checkpointed
    sized = job.spec.failure_policy.hang_timeout_seconds is not None
    # Before training: a survivor writes again the checkpoint a failure interrupted, and a
    # replacement (admitted at a step boundary, right before the members write that step's
    # checkpoint when one is due) writes it with them, else its first step meets their save.
    recovered = admission is not None
    while True:
        try:
            if recovered:
                _checkpoint_due(trainer, opts, saved)
            _train(trainer, ledger, opts, until, steps, pinned, reports, log, saved, sized)
            _finish(trainer, job, opts, saved)
            return reports
        except PeerFailure as failure:  # a peer died or hung: recover, then go on from there
            recover(trainer, ledger, failure, opts.checkpoint_dir)
            recovered = True
            if saved[0] > trainer.step:  # rolled back behind it: save again when there
                saved[0] = -1


def _speaks(trainer: Trainer, opts: RunOptions) -> bool:
    """The coordinator (rank 0, or the lowest survivor after a recovery) prints the job's lines."""
    return not opts.quiet and trainer.rank == trainer.world.coordinator()


def _collective(trainer: Trainer, what: str, fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except RuntimeError as e:
        failure = as_failure(e, what, trainer.world)
        if failure is e:
            raise
        raise failure from e


def _train(
    trainer: Trainer,
    ledger: Ledger,
    opts: RunOptions,
    until: int,
    steps: int,
    pinned: dict[int, Plan],
    reports: list[StepReport],
    log: RunLog | None,
    saved: list[int],
    sized: bool,
) -> None:
    """Steps until `until` or a stop; `saved[0]`: the step last checkpointed (-1: none)."""
    while trainer.step < until and not trainer.boundary.stopping:
        due = pinned.pop(trainer.step + 1, None)  # in force from the next step on
        if due is not None and trainer.coordinator is not None:
            code, answer = trainer.coordinator.inbox.offer(due.model_dump())
            if code != 202:  # only a newer plan posted over HTTP can get in the way
                log_.warning("--switch plan generation %d not applied: %s", due.generation, answer)
        r = _step(trainer, ledger)
        if not sized and trainer.step == CALIBRATE_STEP + 1 and trainer.world.store is not None:
            seconds = sized_hang_timeout(r.seconds)  # 10 measured steps, clamped
            trainer.world.set_collective_timeout(seconds, trainer.groups.groups())
            log_.info("collectives bounded by %.0f s from now on", seconds)
        speak = _speaks(trainer, opts)
        reports.append(r)
        m = trainer.last_migration
        if log is not None:
            log.step(r.step, r.loss, seconds=r.seconds, rates=r.rates)
            if m is not None and m.step == trainer.step:
                log.switched(m)
        if speak and m is not None and m.step == trainer.step:
            _say(
                f"[malleus] switched to plan generation {m.generation} from step {m.step}: "
                f"moved {size(m.bytes)} (minimal {size(m.minimal_bytes)}) in {m.seconds:.3f} s"
            )
            _say(trainer.layout.rank_matrix())
        if speak and (trainer.step % opts.log_every == 0 or trainer.step == until):
            _say(  # the step just done by its index, as the report names it (malleus.notation)
                f"[malleus] {step_progress(r.step, steps)} loss {r.loss:.4f} "
                f"norm {r.grad_norm:.3f} lr {r.lr:.2e} {r.seconds:.3f}s "
                f"{r.tokens_per_second:,.0f} tok/s"
            )
        _checkpoint_due(trainer, opts, saved)
        if trainer.boundary.stopping and speak:
            _say(f"[malleus] stop requested: stopping after step {trainer.step}")


def _step(trainer: Trainer, ledger: Ledger) -> StepReport:
    """One step of the Trainer, then the replacements its boundary announced enter the job
    (collective with them, no step lost); a failed collective is a peer's failure when failures
    are survivable (`as_failure`)."""
    try:
        report = trainer.train_step()
        # The step committed: a recovery it was the first step of is complete, whatever
        # comes of an admission at its boundary (a member dying there starts another).
        settled(trainer, ledger)
        if trainer.boundary.joins:  # replacements enter now, under the plan in force
            admit(trainer, ledger)
        return report
    except RuntimeError as e:
        failure = as_failure(e, f"step {trainer.step}", trainer.world)
        if failure is e:
            raise
        raise failure from e


def _checkpoint_due(trainer: Trainer, opts: RunOptions, saved: list[int]) -> None:
    every, directory = opts.checkpoint_every, opts.checkpoint_dir
    due = bool(directory and every and trainer.step and trainer.step % every == 0)
    if due and saved[0] != trainer.step:
        assert directory is not None
        where = f"the checkpoint of step {trainer.step}"
        _collective(trainer, where, lambda: save_checkpoint(trainer, directory))
        saved[0] = trainer.step


def _finish(trainer: Trainer, job: ResolvedJob, opts: RunOptions, saved: list[int]) -> None:
    """The last checkpoint and the final model (collectives: a failure here is recovered)."""
    speak = _speaks(trainer, opts)
    stop = trainer.boundary
    if opts.checkpoint_dir and (not stop.stopping or stop.checkpoint):
        directory = opts.checkpoint_dir
        if saved[0] != trainer.step:
            where = f"the checkpoint of step {trainer.step}"
            path = _collective(trainer, where, lambda: save_checkpoint(trainer, directory))
            saved[0] = trainer.step
        else:  # the periodic checkpoint of this very step is the one the stop leaves
            path = latest(directory)
        if speak and stop.stopping:
            _say(f"[malleus] saved checkpoint {path}")
    if opts.save_model or opts.save_hf:
        lead = trainer.world.coordinator()
        full = _collective(trainer, "gathering the model", lambda: gather_full(trainer, lead))
        if full is not None and opts.save_model:
            save_atomic(full, opts.save_model)
            if speak:
                _say(f"[malleus] saved model ({len(full)} tensors) to {opts.save_model}")
        if full is not None and opts.save_hf:
            save_hf(job, full, opts.save_hf)
            if speak:
                _say(f"[malleus] saved Hugging Face model to {opts.save_hf}")


def _pinned_switches(
    switches: tuple[tuple[int, Plan], ...], start: int, speak: bool
) -> dict[int, Plan]:
    """--switch plans by the step they take force at; those due before `start` are skipped
    (a resumed job runs the plan it was given)."""
    out = {}
    for step, plan in switches:
        if step > start:
            out[step] = plan
        elif speak:
            _say(f"[malleus] --switch {step}: already past (resumed at step {start}); skipped")
    return out
