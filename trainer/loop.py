"""`run_rank`: one rank's run, from step 0 or the latest checkpoint to the end or a stop.

Around the steps of a `Trainer` (trainer/worker.py): resume, the `--switch` plans offered to
the coordinator's inbox at their steps, the log lines (rank 0), checkpoints every N steps and
at a stop that asks for one, and the final full model.
"""

from __future__ import annotations

import logging

import torch

from malleus.job import ResolvedJob
from malleus.planner import Plan

from .config import RunOptions
from .hf import save_hf
from .precision import Precision
from .report import RunLog
from .services import Services
from .state import gather_full, resume, save_atomic, save_checkpoint
from .worker import StepReport, Trainer

__all__ = ["run_rank"]

log = logging.getLogger(__name__)


def _say(text: str) -> None:
    print(text, flush=True)


def run_rank(
    job: ResolvedJob,
    plan: Plan,
    opts: RunOptions,
    *,
    rank: int,
    world: int,
    device: torch.device,
    services: Services | None = None,
    log: RunLog | None = None,
) -> list[StepReport]:
    """Train this rank from step 0 (or the latest checkpoint) to `opts.until` or the end;
    `log` (rank 0, `--report`) records every step and switch."""
    steps = opts.total_steps(job)
    precision = Precision.of(job.spec.training.precision, float64=opts.float64)
    trainer = Trainer(
        job,
        plan,
        rank=rank,
        world=world,
        device=device,
        steps=steps,
        services=services,
        precision=precision,
    )
    speak = rank == 0 and not opts.quiet
    if opts.resume and opts.checkpoint_dir:
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
    reports = []
    saved = -1
    while trainer.step < until:
        due = pinned.pop(trainer.step + 1, None)  # in force from the next step on
        if due is not None and trainer.coordinator is not None:
            code, answer = trainer.coordinator.inbox.offer(due.model_dump())
            if code != 202:  # only a newer plan posted over HTTP can get in the way
                log.warning("--switch plan generation %d not applied: %s", due.generation, answer)
        r = trainer.train_step()
        reports.append(r)
        m = trainer.last_migration
        if log is not None:
            log.step(r.step, r.loss, seconds=r.seconds, rates=r.rates)
            if m is not None and m.step == trainer.step:
                log.switched(m)
        if speak and m is not None and m.step == trainer.step:
            _say(
                f"[malleus] switched to plan generation {m.generation} at step {m.step}: "
                f"moved {m.bytes:,} bytes (minimal {m.minimal_bytes:,}) in {m.seconds:.3f}s"
            )
            _say(trainer.layout.rank_matrix())
        if speak and (trainer.step % opts.log_every == 0 or trainer.step == until):
            _say(
                f"[malleus] step {trainer.step}/{steps} loss {r.loss:.4f} "
                f"norm {r.grad_norm:.3f} lr {r.lr:.2e} {r.seconds:.3f}s "
                f"{r.tokens_per_second:,.0f} tok/s"
            )
        every = opts.checkpoint_every
        if opts.checkpoint_dir and every and trainer.step % every == 0:
            save_checkpoint(trainer, opts.checkpoint_dir)
            saved = trainer.step
        if trainer.boundary.stopping:
            if speak:
                _say(f"[malleus] stop requested: stopping after step {trainer.step}")
            break
    stop = trainer.boundary
    if opts.checkpoint_dir and saved != trainer.step and (not stop.stopping or stop.checkpoint):
        path = save_checkpoint(trainer, opts.checkpoint_dir)
        if speak and stop.stopping:
            _say(f"[malleus] saved checkpoint {path}")
    if opts.save_model or opts.save_hf:
        full = gather_full(trainer, 0)
        if full is not None and opts.save_model:
            save_atomic(full, opts.save_model)
            if speak:
                _say(f"[malleus] saved model ({len(full)} tensors) to {opts.save_model}")
        if full is not None and opts.save_hf:
            save_hf(job, full, opts.save_hf)
            if speak:
                _say(f"[malleus] saved Hugging Face model to {opts.save_hf}")
    return reports


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
