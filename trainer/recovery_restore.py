"""Live recovery, applying the decision: every member restores its state under the recovery plan.

The protocol that reaches the decision (trainer/recovery.py) only says who goes on, at which
step, under which plan and from where; what that takes on each member lives here, so that the
protocol reads apart from the state it moves. With surviving replicas of every piece, the new
layout is filled through the migration machinery (`_survivor_holders`: who holds what, each
under the plan it had in force); otherwise every member rolls back to the latest checkpoint (or
the seeded initial state) under the new plan. Then the lowest member takes the coordinator's
office, and the recovery stays `Pending` until its first committed step, when `settled`
completes its record. A decision in which nobody failed (`_redo`) only commits a late step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from malleus.job.control import RecoveryRecord
from malleus.planner import Plan, check_plan

from . import membership
from .faults import at_rollback
from .parallel import migrate
from .parallel.layout import Layout, PieceRoles

if TYPE_CHECKING:
    from .recovery import PeerFailure
    from .worker import Trainer

__all__ = ["Pending", "settled"]

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A recovery whose first committed step has not run yet (its record is completed then)."""

    epoch: int
    failed: dict[int, str]
    step: int
    steps_lost: int
    bytes_restored: int
    mode: str
    generation: int
    detected: float
    fault_at: dict[int, float] = field(default_factory=dict)
    at: int = 0  # the step the failure interrupted


def _redo(trainer: Trainer, decision: dict[str, Any]) -> None:
    """Nobody failed: the same members go on under the same plan (a late step commits)."""
    from .switch import Boundary

    vec = decision.get("vec")
    if vec is not None and trainer.step == decision["step"] - 1:
        trainer.commit(vec, time.perf_counter())
    trainer.optim.zero_grad()
    if vec is not None:
        trainer.boundary = Boundary(0, Boundary.decode(vec[2 + 2 * trainer.world :]).stop)
    trainer.groups.ensure(trainer.layout.member_sets())
    trainer.pipeline = trainer._pipeline(trainer.layout.place) if trainer.layout.place else None


def _survivor_holders(job: Any, plans: dict[int, Plan]) -> dict[str, tuple[int, ...]]:
    """Piece -> the survivors that hold it, each under the plan it has in force."""
    roles = {g: Layout.from_plan(p, job.model, g, job.world).roles for g, p in plans.items()}
    names = next(iter(roles.values())).keys()
    return {n: tuple(g for g in sorted(plans) if g in roles[g][n].holders) for n in names}


# ---- applying the decision (collective among the members) ---------------------------------------
def _apply(
    trainer: Trainer,
    decision: dict[str, Any],
    epoch: int,
    failure: PeerFailure,
    checkpoint_dir: str | None,
) -> None:
    from .switch import Boundary

    svc = trainer.services
    step, vec = decision["step"], decision["vec"]
    if vec is not None and trainer.step == step - 1:  # inside the vector when it failed
        trainer.commit(vec, time.perf_counter())
    trainer.optim.zero_grad()
    if vec is not None:  # a stop announced there still holds; a switch is superseded
        trainer.boundary = Boundary(0, Boundary.decode(vec[2 + 2 * trainer.world :]).stop)
    plan = Plan.from_json(decision["plan"])
    check_plan(trainer.job.problem({int(g): None for g in decision["out"]}), plan)
    new = Layout.from_plan(plan, trainer.model, trainer.rank, trainer.world)
    width = trainer.precision.master_bytes
    if decision["mode"] == "replicas":
        plans = {int(g): Plan.from_json(p) for g, p in decision["plans"].items()}
        have = _survivor_holders(trainer.job, plans)
        old = {n: PieceRoles(h, h) for n, h in have.items()}
        moves = migrate.plan_transfers(
            old, new.roles, trainer.model, trainer.job.tp, trainer.job.gpus_per_node, width
        )
        exchange = migrate.post(
            moves,
            trainer.rank,
            trainer.params,
            trainer.optim.state,
            trainer.device,
            trainer.precision.master,
        )
        received = exchange.wait(trainer.migration_timeout_s)
        trainer.groups.ensure(new.member_sets())
        trainer._adopt(plan, new, received)
        restored, lost = moves.nbytes, 0
    else:
        restored = _rollback(trainer, plan, new, checkpoint_dir, epoch)
        lost = step - trainer.step
    failed = {int(g): w for g, w in decision["failed"].items()}  # `out`: set by `recover`
    _take_office(trainer, plan.generation, checkpoint_dir)
    svc.state.update(generation=plan.generation, out=dict(trainer.out))
    if svc.metrics is not None:
        svc.metrics.observe_plan(plan.generation)
    _restart_calibration(trainer)
    trainer.recovering = Pending(
        epoch,
        failed,
        trainer.step,
        lost,
        restored,
        decision["mode"],
        plan.generation,
        decision["detected"],
        _fault_times(failed),
        step,
    )
    log.warning(
        "rank %d: recovery epoch %d: members %s, plan generation %d, step %d (%s)",
        trainer.rank,
        epoch,
        decision["members"],
        plan.generation,
        trainer.step,
        decision["mode"],
    )


def _fault_times(failed: dict[int, str]) -> dict[int, float]:
    from .faults import FAULT_KEY

    store, out = membership.store(), {}
    for g in failed:
        key = f"{FAULT_KEY}{g}"
        if store is not None and store.check([key]):
            out[g] = float(json.loads(store.get(key))["at"])
    return out


def _rollback(trainer: Trainer, plan: Plan, new: Layout, directory: str | None, epoch: int) -> int:
    """Every survivor: the state of the latest checkpoint (or the initial one) under `plan`.
    Returns the bytes read back. A member lost during it (`resume` agrees on the checkpoint
    with a collective) makes it raise: `recover` goes to the next epoch."""
    from .hf import initial_pieces
    from .parallel.optim import PieceAdamW
    from .precision import ComputeCopies
    from .state import resume

    held = new.held()
    start = initial_pieces(trainer.job, held)
    master = trainer.precision.master
    trainer.params = {
        p.name: start[p.name].to(trainer.device, master).requires_grad_() for p in held
    }
    trainer.compute = ComputeCopies(trainer.params, trainer.precision)
    decay = {p.name: p.spec.decay for p in held}
    trainer.optim = PieceAdamW(trainer.params, decay, trainer.training.weight_decay)
    trainer.plan, trainer.layout = plan, new
    trainer.groups.ensure(new.member_sets())
    trainer.pipeline = trainer._pipeline(new.place) if new.place else None
    trainer.step = 0
    trainer.last_vec = None
    if directory:
        at_rollback(trainer.rank, epoch)  # fault injection (tests): it dies mid-rollback
        resume(trainer, directory)
    from .model import pieces

    width, tp = trainer.precision.master_bytes, trainer.job.tp
    size = {
        p.name: migrate.state_elements(math.prod(p.shape(tp))) for p in pieces(trainer.model, tp)
    }
    return sum(len(r.holders) * size[n] * width for n, r in new.roles.items())


def _take_office(trainer: Trainer, generation: int, checkpoint_dir: str | None) -> None:
    """The lowest member coordinates: plan inbox, stop request, control endpoint."""
    svc = trainer.services
    if membership.coordinator() == trainer.rank:
        if trainer.coordinator is None:
            from .switch import Coordinator

            svc.promote(generation)
            assert svc.inbox is not None and svc.stop is not None
            svc.stop.can_checkpoint = checkpoint_dir is not None
            trainer.coordinator = Coordinator(svc.inbox, svc.stop)
        inbox = svc.inbox
        assert inbox is not None
        lost = inbox._applying  # taken for this step's boundary, or failed with the failure
        if lost is None and inbox.last_failure is not None:
            lost = inbox.last_failure.generation
        before = inbox.current_generation
        inbox.replan(trainer.job.problem({g: None for g in trainer.out}))
        inbox.applied(generation)  # a pending plan for the old membership is dropped
        if lost is not None and before < lost < generation:
            inbox.failed(lost, "superseded by recovery")


def settled(trainer: Trainer) -> None:
    """After a committed step: complete the record of a recovery it was the first step of."""
    pending: Pending | None = getattr(trainer, "recovering", None)
    if pending is None:
        return
    trainer.recovering = None
    seconds = max(0.0, time.time() - pending.detected)
    record = RecoveryRecord(
        epoch=pending.epoch,
        failed=pending.failed,
        step=pending.step,
        steps_lost=pending.steps_lost,
        seconds=seconds,
        bytes_restored=pending.bytes_restored,
        mode=pending.mode,  # type: ignore[arg-type]
        generation=pending.generation,
    )
    detect = {g: pending.detected - at for g, at in pending.fault_at.items()}
    trainer.recoveries.append({**record.model_dump(), "detected_after_s": detect})
    trainer.services.state.update(recovery=record)
    if membership.coordinator() != trainer.rank:
        return
    source = "replicas" if pending.mode == "replicas" else "the checkpoint"
    print(
        f"[malleus] recovered from the failure of rank(s) {sorted(pending.failed)} at step "
        f"{pending.at}: epoch {pending.epoch}, plan generation {pending.generation}, "
        f"steps lost {pending.steps_lost}, {pending.bytes_restored:,} bytes restored from "
        f"{source} in {seconds:.2f} s",
        flush=True,
    )


def _restart_calibration(trainer: Trainer) -> None:
    """The cost-model calibration's window starts again on every member at the same step."""
    calibrator = getattr(trainer, "calibrator", None)
    if calibrator is not None and hasattr(calibrator, "_generation"):
        calibrator._generation = None
