"""Live recovery, applying the decision: every member restores its state under the recovery plan.

The protocol that reaches the decision (trainer/recovery/protocol.py) only says who goes on, at which
step, under which plan and from where; what that takes on each member lives here, so that the
protocol reads apart from the state it moves. With surviving replicas of every piece, the new
layout is filled through the migration machinery (`survivor_holders`: who holds what, each
under the plan it had in force); otherwise every member rolls back to the latest checkpoint (or
the seeded initial state) under the new plan. Then the lowest member takes the coordinator's
office, and the recovery stays `Pending` until its first committed step, when `settled`
completes its record. A decision in which nobody failed (`redo`) only commits a late step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from malleus.control import RecoveryRecord
from malleus.notation import size
from malleus.planner import Plan, check_plan
from malleus.trainer.engine.state import resume
from malleus.trainer.model.decoder import pieces
from malleus.trainer.parallel import migrate
from malleus.trainer.parallel.layout import Layout, PieceRoles
from malleus.trainer.world.faults import FAULT_KEY, at_rollback

from .ledger import Ledger, Pending

if TYPE_CHECKING:
    from malleus.trainer.engine.trainer import Trainer

__all__ = ["apply_decision", "redo", "settled", "survivor_holders"]

log = logging.getLogger(__name__)


def redo(trainer: Trainer, decision: dict[str, Any]) -> None:
    """Nobody failed: the same members go on under the same plan (a late step commits)."""
    trainer.close_interrupted_step(decision["step"], decision.get("vec"))
    trainer.rebuild_pipeline()


def survivor_holders(job: Any, plans: dict[int, Plan]) -> dict[str, tuple[int, ...]]:
    """Piece -> the survivors that hold it, each under the plan it has in force. The roles of
    a plan are the same for every GPU, so each distinct plan is laid out once (one or two
    among thousands of survivors): O(N) work, not a layout per survivor (O(N^2))."""
    roles: dict[int, dict[str, frozenset[int]]] = {}  # id(plan) -> piece -> its holders
    for g, p in plans.items():
        if id(p) not in roles:
            laid = Layout.from_plan(p, job.model, g, job.world).roles
            roles[id(p)] = {n: frozenset(r.holders) for n, r in laid.items()}
    names = next(iter(roles.values())).keys()
    return {n: tuple(g for g in sorted(plans) if g in roles[id(plans[g])][n]) for n in names}


# ---- applying the decision (collective among the members) ---------------------------------------
def apply_decision(
    trainer: Trainer,
    ledger: Ledger,
    decision: dict[str, Any],
    epoch: int,
    checkpoint_dir: str | None,
) -> None:
    """This member's part of the decision: its state under the recovery plan, from the
    survivors' replicas or a rollback; the coordinator's office; the pending record."""
    svc = trainer.services
    step = decision["step"]
    trainer.close_interrupted_step(step, decision["vec"])  # inside the vector when it failed
    plan = Plan.from_json(decision["plan"])
    check_plan(trainer.job.problem({int(g): None for g in decision["out"]}), plan)
    new = Layout.from_plan(plan, trainer.model, trainer.rank, trainer.world.size)
    width = trainer.precision.master_bytes
    if decision["mode"] == "replicas":
        by_generation = {int(k): Plan.from_json(t) for k, t in decision["plans"].items()}
        plans = {int(g): by_generation[int(k)] for g, k in decision["plan_of"].items()}
        have = survivor_holders(trainer.job, plans)
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
            world=trainer.world,
        )
        received = exchange.wait(trainer.migration_timeout_s)
        trainer.groups.ensure(new.member_sets())
        trainer.adopt(plan, new, received)
        restored, lost = moves.nbytes, 0
    else:
        restored = _rollback(trainer, plan, new, checkpoint_dir, epoch)
        lost = step - trainer.step
    failed = {int(g): w for g, w in decision["failed"].items()}  # `out`: set by `recover`
    _take_office(trainer, ledger, plan.generation, checkpoint_dir)
    svc.state.update(generation=plan.generation, out=dict(ledger.out))
    if svc.metrics is not None:
        svc.metrics.observe_plan(plan.generation)
    trainer.calibrator.restart()
    ledger.recovering = Pending(
        epoch,
        failed,
        trainer.step,
        lost,
        restored,
        decision["mode"],
        plan.generation,
        decision["detected"],
        _fault_times(trainer.world.store, failed),
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


def _fault_times(store: Any, failed: dict[int, str]) -> dict[int, float]:
    """When each failed GPU's injected fault fired (`rec/fault/GPU`, tests and demos): a figure
    of the record, not sealed (trainer/world/sealed.py), so what does not parse is dropped."""
    out: dict[int, float] = {}
    for g in failed:
        key = f"{FAULT_KEY}{g}"
        if store is not None and store.check([key]):
            try:
                out[g] = float(json.loads(store.get(key))["at"])
            except (ValueError, KeyError, TypeError):
                continue
    return out


def _rollback(trainer: Trainer, plan: Plan, new: Layout, directory: str | None, epoch: int) -> int:
    """Every survivor: the state of the latest checkpoint (or the initial one) under `plan`.
    Returns the bytes read back. A member lost during it (`resume` agrees on the checkpoint
    with a collective) makes it raise: `recover` goes to the next epoch."""
    trainer.start_over(plan, new)
    if directory:
        at_rollback(trainer.rank, epoch, store=trainer.world.store)  # fault injection (tests)
        resume(trainer, directory)
    width, tp = trainer.precision.master_bytes, trainer.job.tp
    size = {
        p.name: migrate.state_elements(math.prod(p.shape(tp))) for p in pieces(trainer.model, tp)
    }
    return sum(len(r.holders) * size[n] * width for n, r in new.roles.items())


def _take_office(
    trainer: Trainer, ledger: Ledger, generation: int, checkpoint_dir: str | None
) -> None:
    """The lowest member coordinates: plan inbox, stop request, control endpoint."""
    svc = trainer.services
    if trainer.world.coordinator() == trainer.rank:
        if trainer.coordinator is None:
            trainer.become_coordinator(generation, can_checkpoint=checkpoint_dir is not None)
        inbox = svc.inbox
        assert inbox is not None
        lost = inbox.applying  # taken for this step's boundary, or failed with the failure
        if lost is None and inbox.last_failure is not None:
            lost = inbox.last_failure.generation
        before = inbox.current_generation
        inbox.replan(trainer.job.problem({g: None for g in ledger.out}))
        inbox.applied(generation)  # a pending plan for the old membership is dropped
        if lost is not None and before < lost < generation:
            inbox.failed(lost, "superseded by recovery")


def settled(trainer: Trainer, ledger: Ledger) -> None:
    """After a committed step: complete the record of a recovery it was the first step of."""
    pending = ledger.recovering
    if pending is None:
        return
    ledger.recovering = None
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
    ledger.recoveries.append(
        {**record.model_dump(), "detected_after_s": detect, "store": pending.store}
    )
    trainer.services.state.update(recovery=record)
    if trainer.world.coordinator() != trainer.rank:
        return
    source = "replicas" if pending.mode == "replicas" else "the checkpoint"
    print(
        f"[malleus] recovered from the failure of rank(s) {sorted(pending.failed)} at step "
        f"{pending.at}: epoch {pending.epoch}, plan generation {pending.generation}, "
        f"steps lost {pending.steps_lost}, {size(pending.bytes_restored)} restored from "
        f"{source} in {seconds:.2f} s",
        flush=True,
    )
