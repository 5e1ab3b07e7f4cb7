"""Live recovery: the survivors of a failed rank re-form the job among themselves and go on.

Detection. Every collective is bounded by the process group's timeout (the hang timeout,
counted from the step's start inside a step: trainer/world/world.py `step_deadline`, so that
the survivors blocked on a hung rank time out together); a rank that dies closes its sockets,
so its peers' collectives fail at once; a rank that stops (SIGSTOP, a frozen node) stops its
heartbeat, and the rank watching it declares it dead within seconds and leaves its wait
(`PeerSilent`, trainer/world/alarm.py); a rank stuck inside a step declares itself hung and
exits (trainer/world/progress.py), which closes its sockets; the timeout is the upper bound
behind both. Either way the collective raises on the survivors, which turn it into a
`PeerFailure` (only when
failures are survivable: a store no rank hosts, trainer/launch/distributed.py `fault_tolerant`); the first
survivor out destroys its process group, which breaks its peers' collectives in turn, so
every survivor is in recovery within moments.

Commit rule. A step's optimizer update is applied only after the step's world all-gather (the
vector of trainer/engine/trainer.py) completed, and a rank enters that all-gather only after its own
gradient sync: if any survivor holds the vector of step s, every rank finished the gradient sync
of s. So step s commits iff some survivor completed its vector: survivors still inside it apply
the update with the vector that survivor posts; if nobody completed it, every survivor discards
the step's gradients and redoes it after recovery, with the same samples (a function of the
step), so no sample is skipped or seen twice.

Rendezvous (no rank hosts it: keys of the job's store, under `rec/EPOCH/`). Each survivor
posts `alive/GPU` (its step, whether it holds the vector, its plan's generation, the newest
generation it knows, its `out` set: constant size whatever the world), the plan and the vector
unless another survivor posted them (`plan/GEN`, `vec/STEP`, `_post_once`), its place in the
order of arrivals (trainer/recovery/wait.py `announce`), `arrive` (which the peers' alarms
watch, trainer/world/alarm.py), lets
go of its process groups and posts `released/GPU`. The first to claim the lead (`compare_set`
of `leader`: atomic, and names it), the leader, waits until every previous member has arrived
or is known dead (`rec/dead/GPU`, written by a launcher that saw the process exit, or by
`malleus run` for a process it saw stopped for the hang timeout) or silent (its heartbeat
stopped for a few seconds, trainer/world/alarm.py: a pod deleted, a node lost, with no launcher left
to mark it), or, when some survivor's collective timed out, every arrival has released and a
short quiet passed (trainer/recovery/wait.py), or `JOIN_WINDOW_S` passed; it decides (members,
the step, the vector, the recovery plan, where the lost shards come from) and writes
`decision`. Everyone then forms the process group `rec/EPOCH/pg/` among the members. A leader
that dies before deciding sends the others to epoch + 1 as soon as a launcher marks it dead
(`rec/dead/GPU`) or its heartbeat stops, else after `DECISION_WAIT_S`; a replacement clears
its GPU's mark when it is admitted. A rank that arrives after the decision and is not a member
(a hung rank that woke up) prints why and exits with `LEFT_OUT_EXIT` (3).

Restoring. The recovery plan is the planner's for the survivors (the dead GPUs unusable), one
generation above the newest known. Each piece of the new layout comes from a surviving holder
(data-parallel replicas hold the same pieces) through the migration machinery; when some piece
has no surviving holder, every survivor rebuilds its state under the new plan from the latest
plan-independent checkpoint (or the seeded initial state) instead: steps lost = the steps since.

Joining. A replacement (`--join`) posts `join/GPU` and waits; the coordinator announces it at a
step boundary (a control word), every member and the joiner re-form at the next epoch (no step
lost) and the joiner receives the plan in force, the step and the `out` set; it holds nothing
(an excluded GPU) until a later plan re-admits it.

Sealed values. Every value of this rendezvous (arrivals, `arrive`, `released`, the leader's
claim, the decision, and the launchers' dead marks) is written sealed with the job's key and
read only when its seal checks (trainer/world/sealed.py, `World.sealer`): a value planted by
whoever else can reach the store is as if absent, so it can neither cause a recovery, nor
decide who goes on, nor send the survivors to another epoch; a planted leader claim is replaced.

Where it lives. This module is the protocol: the failure types, the survivors' rendezvous and
the leader's decision. Applying a decision (restoring every piece from replicas or a
checkpoint, the coordinator's office, the record of the recovery) is trainer/recovery/restore.py;
letting go of the process groups and forming the next one is trainer/recovery/groups.py;
replacements joining a running job is trainer/recovery/join.py; the leader's wait is
trainer/recovery/wait.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from malleus.errors import LEFT_OUT_EXIT, BadInput
from malleus.planner import Plan, check_plan
from malleus.trainer.world.alarm import Silence
from malleus.trainer.world.errors import (  # DEAD_KEY: a launcher saw a GPU's process end
    DEAD_KEY,
    first_line,
    say_ending,
)
from malleus.trainer.world.faults import at_lead
from malleus.trainer.world.membership import Membership
from malleus.trainer.world.sealed import Sealer
from malleus.trainer.world.world import DEFAULT_HANG_TIMEOUT_S, World

from .groups import form_group, release_groups
from .ledger import Ledger
from .restore import apply_decision, redo, survivor_holders
from .tally import Tally
from .wait import announce, gather, mark_released, poll_s

if TYPE_CHECKING:
    from malleus.trainer.engine.trainer import Trainer

__all__ = [
    "DECISION_WAIT_S",
    "NoValidPlan",
    "PeerFailure",
    "RecoveryError",
    "as_failure",
    "recover",
]

log = logging.getLogger(__name__)

DECISION_WAIT_S = 60.0
"""How long a survivor waits for the leader's decision before starting the next epoch."""
SPURIOUS_TRIES = 3
"""Recoveries in which every rank arrived (a collective timed out on a slow machine, say) that
one step may take before its error is taken for a real one and raised."""


class PeerFailure(RuntimeError):
    """A collective failed on this rank because some other rank died or hung."""

    def __init__(self, what: str, cause: BaseException) -> None:
        first = first_line(cause)
        self.timeout = "timed out" in str(cause).lower() or "timeout" in str(cause).lower()
        self.detected = time.time()
        super().__init__(f"a collective failed during {what}: {first}")


class RecoveryError(RuntimeError):
    """The survivors could not go on (no plan fits them, a real error on every rank, ...)."""


class NoValidPlan(RecoveryError):
    """No valid plan exists on the GPUs left (the planner refused the survivors' problem): the
    job cannot go on. Every survivor exits `NO_PLAN_EXIT`, which the operator (reason
    `NoValidPlan`) and `malleus run` read as the end of the job, not as one more failure."""


def hang_timeout_s(job: Any) -> float:
    """The collectives' bound to start with: spec.failurePolicy.hangTimeoutSeconds, else
    `DEFAULT_HANG_TIMEOUT_S` until the step time is measured (then 10 steps, trainer/run/loop.py)."""
    given = job.spec.failure_policy.hang_timeout_seconds
    return float(given) if given is not None else DEFAULT_HANG_TIMEOUT_S


def as_failure(e: BaseException, what: str, world: World) -> BaseException:
    """`e` as a PeerFailure when failures are survivable (`world` has a store), else `e`."""
    if isinstance(e, PeerFailure) or world.store is None:
        return e
    return PeerFailure(what, e)


# ---- the survivors' side ------------------------------------------------------------------------
def recover(
    trainer: Trainer, ledger: Ledger, failure: PeerFailure, checkpoint_dir: str | None
) -> None:
    """Collective among the survivors: re-form the job without the failed ranks and restore
    every piece; on return the trainer is at the step to run next (the failed one redone, or
    the one after it)."""
    old = trainer.world.current
    assert trainer.world.store is not None and old is not None
    # Every store call of this recovery is counted (its record's `store`, bench/recovery_cost.py);
    # the World holds the tally: the process group formed over it keeps only its C++ half.
    store = tally = Tally(trainer.world.store)
    trainer.world.hold(tally)
    cost: dict[str, Any] = {"led": [], "epochs": 0}
    seal = trainer.world.sealer  # every value below is written sealed and read only if it opens
    log.warning("rank %d: %s; recovering", trainer.rank, failure)
    _dbg(trainer.rank, f"enter recovery: {failure}")
    epoch = old.epoch + 1
    previous = old.members
    while True:
        prefix = f"rec/{epoch}/"
        cost["epochs"] += 1
        # Counted in before letting go of the groups (which takes a collection: tenths of a
        # second on a busy host), so that the leader and the peers still computing (whose
        # alarm watches `arrive`, trainer/world/alarm.py) hear of this survivor at once.
        arrival = _arrival(trainer, ledger, failure)
        _post_once(store, seal, prefix + f"plan/{trainer.plan.generation}", trainer.plan.to_json())
        if arrival["vec"]:
            vec = trainer.last_vec[1] if trainer.last_vec is not None else None
            _post_once(store, seal, prefix + f"vec/{trainer.step - 1}", json.dumps(vec))
        announce(store, seal, prefix, trainer.rank, json.dumps(arrival))
        seal.put(store, prefix + "arrive", "1")
        _dbg(trainer.rank, "arrived")
        release_groups(trainer, failure)
        mark_released(store, seal, prefix, trainer.rank)  # the leader of a hang waits for this
        _dbg(trainer.rank, "released")
        # The lead goes to whoever claims it first, atomically and by name, so that the others
        # can tell when the leader is known dead before it decided (`_await_decision`).
        # A claim planted by a stranger is replaced (`Sealer.claim`); one overwritten again and
        # again leaves this epoch leaderless: the next one is tried, as for a dead leader.
        claim = seal.claim(store, prefix + "leader", str(trainer.rank))
        if claim is None or not claim.isdigit():
            log.warning("rank %d: no leader at recovery epoch %d; next epoch", trainer.rank, epoch)
            epoch += 1
            continue
        leader = int(claim)
        if leader == trainer.rank:
            at_lead(trainer.rank, epoch, store=store)  # fault injection (tests): dies here
            cost["led"].append(_lead(store, prefix, previous, trainer))
        quiet = trainer.world.silence(store)
        every = poll_s(len(previous))
        decision = _await_decision(store, seal, prefix, leader, quiet, every)
        _dbg(trainer.rank, "decided")
        if decision is None:  # the leader died before deciding
            log.warning(
                "rank %d: no decision at recovery epoch %d (leader rank %d); next epoch",
                trainer.rank,
                epoch,
                leader,
            )
            epoch += 1
            continue
        members = tuple(decision["members"])
        if trainer.rank not in members:
            _left_out(trainer.rank, epoch, "the others went on without it (it did not arrive)")
        if decision.get("no_plan"):
            lost = ", ".join(str(g) for g in decision.get("lost", [])) or "?"
            raise NoValidPlan(
                f"no valid plan on the GPUs left: {len(members)} of {trainer.world.size} "
                f"after losing GPU(s) {lost} at recovery epoch {epoch}: {decision['error']}"
            ) from failure
        if decision.get("error"):
            raise RecoveryError(f"recovery epoch {epoch}: {decision['error']}") from failure
        if "out" in decision:  # set now: if this epoch fails on the way (a member lost while
            # forming or restoring), the next one must plan without these GPUs too
            ledger.out = {int(g): w for g, w in decision["out"].items()}
        lead = old.coordinator if old.coordinator in members else None
        try:
            form_group(trainer.world, store, prefix, Membership(epoch, members, lead), trainer.rank)
        except RuntimeError as e:  # a member died while the group formed
            log.warning("rank %d: re-forming epoch %d failed: %s", trainer.rank, epoch, e)
            previous, epoch = members, epoch + 1
            continue
        _dbg(trainer.rank, "formed")
        if decision.get("spurious"):  # every rank alive: slow, not failed; or a real error
            tries = ledger.spurious.get(trainer.step, 0) + 1
            ledger.spurious[trainer.step] = tries
            if tries > SPURIOUS_TRIES:
                raise failure.__cause__ or failure
            log.warning("rank %d: every rank is alive; redoing step %d", trainer.rank, trainer.step)
            redo(trainer, decision)
            return
        cost["decision_bytes"] = len(json.dumps(decision))
        try:
            apply_decision(trainer, ledger, decision, epoch, checkpoint_dir)
        except RuntimeError as e:  # another failure while restoring: recover again
            failure = PeerFailure(f"recovery epoch {epoch}", e)
            previous, epoch = members, epoch + 1
            continue
        _dbg(trainer.rank, "applied")
        if ledger.recovering is not None:
            ledger.recovering.store = {**tally.summary(), **cost}
        return


def _await_decision(
    store: Any, seal: Sealer, prefix: str, leader: int, quiet: Silence, every: float
) -> dict[str, Any] | None:
    """The leader's decision; None when it did not come within `DECISION_WAIT_S`, or as soon
    as the leader is known dead (a launcher wrote `rec/dead/LEADER`) or silent (its heartbeat
    stopped, trainer/world/alarm.py) without having written it: a leader killed mid-recovery costs
    the others one epoch, not the whole wait. Only sealed values count (`seal`): a decision or
    a dead mark planted by a stranger is as if absent."""
    key, dead = prefix + "decision", DEAD_KEY + str(leader)
    deadline = time.monotonic() + DECISION_WAIT_S
    while time.monotonic() < deadline:
        if (got := seal.get(store, key)) is not None:
            return json.loads(got)
        # Known dead, or gone without a launcher to say so (its heartbeat stopped): its
        # decision may have landed just before it died.
        if seal.get(store, dead) is not None or quiet.silent(leader):
            got = seal.get(store, key)
            return json.loads(got) if got is not None else None
        time.sleep(every)  # `poll_s`: the survivors together stay within the store's budget
    return None


def _dbg(rank: int, what: str) -> None:
    if os.environ.get("MALLEUS_DEBUG_RECOVERY"):
        print(
            f"[recovery] {time.time() % 1000:.2f} rank {rank}: {what}", file=sys.stderr, flush=True
        )


def _left_out(gpu: int, epoch: int, why: str) -> None:
    said = f"rank {gpu} was left out of the job at recovery epoch {epoch}: {why}"
    print(f"[malleus] {said}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    say_ending(LEFT_OUT_EXIT, said)
    os._exit(LEFT_OUT_EXIT)  # no cleanup: its process group is gone, the job goes on


def _post_once(store: Any, seal: Sealer, key: str, value: str) -> None:
    """`value` at `key`, sealed, unless a survivor posted it already: what every survivor
    holds alike (the plan of a generation, the world vector of a step) is posted once per
    recovery, not once per survivor, so the leader reads it once (bytes O(N), not O(N^2)).
    A value there that does not open (a stranger's) is overwritten."""
    if seal.get(store, key) is None:
        seal.put(store, key, value)


def _arrival(trainer: Trainer, ledger: Ledger, failure: PeerFailure) -> dict[str, Any]:
    """This survivor's `alive/GPU` post: a few numbers and its `out` set, of constant size
    whatever the world (its plan and vector are posted once per recovery, `_post_once`; the
    leader reads its own rates, not the survivors')."""
    svc = trainer.services
    inbox = svc.inbox
    newest = trainer.plan.generation
    if inbox is not None:  # a switch that failed with this failure counts: it is superseded
        newest = max(newest, inbox.newest())
        if inbox.last_failure is not None:
            newest = max(newest, inbox.last_failure.generation)
    return {
        "gpu": trainer.rank,
        "step": trainer.step,
        "vec": trainer.last_vec is not None and trainer.last_vec[0] == trainer.step - 1,
        "generation": trainer.plan.generation,
        "newest": newest,
        "timeout": failure.timeout,
        "detected": failure.detected,
        "out": {str(g): w for g, w in ledger.out.items()},
    }


def _lead(store: Any, prefix: str, previous: tuple[int, ...], trainer: Trainer) -> dict[str, float]:
    """The first survivor to arrive decides who goes on, at which step, under which plan.
    Returns how long it waited for the others and how long it took to decide (seconds)."""
    seal = trainer.world.sealer
    t0 = time.monotonic()
    seen = gather(store, seal, prefix, previous, trainer.world.silence(store))
    t1 = time.monotonic()
    arrivals, dead, silent = seen.arrivals, seen.dead, seen.silent
    _dbg(trainer.rank, f"lead: waited, arrived {list(arrivals)} dead {dead} silent {silent}")
    try:
        decision = _decide(trainer, arrivals, previous, store, seal, prefix)
    except BadInput as e:  # the planner refused the survivors' problem: nothing fits them
        # One line (the planner's faults joined): what the trainer prints, its termination
        # message in a pod and the runner's reason quote it whole.
        why = "; ".join(" ".join(str(f).split()) for f in e.faults) or first_line(e)
        lost = [g for g in previous if g not in arrivals]
        log.error("no valid plan on the GPUs left: %s", why)
        decision = {"members": sorted(arrivals), "error": why, "no_plan": True, "lost": lost}
    except Exception as e:
        log.exception("recovery decision failed")
        decision = {"members": sorted(arrivals), "error": f"{type(e).__name__}: {e}"}
    _dbg(trainer.rank, "lead: decided")
    seal.put(store, prefix + "decision", json.dumps(decision))
    return {"wait_s": t1 - t0, "decide_s": time.monotonic() - t1}


def _read_posted(store: Any, seal: Sealer, key: str) -> str:
    """What a survivor posted at `key` before its arrival (`_post_once`): there, unless a
    stranger overwrote it since (then the recovery cannot decide: RuntimeError)."""
    got = seal.get(store, key)
    if got is None:
        raise RuntimeError(f"{key} is missing from the job's store, or not sealed by this job")
    return got


def _decide(
    trainer: Trainer,
    arrivals: dict[int, dict[str, Any]],
    previous: tuple[int, ...],
    store: Any,
    seal: Sealer,
    prefix: str,
) -> dict[str, Any]:
    from malleus.planner.search import plan as planner

    members = sorted(arrivals)
    gone = [g for g in previous if g not in arrivals]
    step = max(a["step"] for a in arrivals.values())
    vec = None
    if any(a["step"] == step and a["vec"] for a in arrivals.values()):
        vec = json.loads(_read_posted(store, seal, prefix + f"vec/{step - 1}"))
    if not gone:
        return {"members": members, "spurious": True, "step": step, "vec": vec}
    hung = any(a["timeout"] for a in arrivals.values())
    failed: dict[int, str] = {}
    for g in gone:
        known = seal.get(store, DEAD_KEY + str(g))
        failed[g] = known if known in ("killed", "left", "hung") else ("hung" if hung else "killed")
    out = {int(g): w for a in arrivals.values() for g, w in a["out"].items()}
    out.update(failed)
    for g in members:
        out.pop(g, None)
    # One plan per generation in force among the survivors (one, but for a switch that
    # failed half-way), read once each.
    texts = {
        gen: _read_posted(store, seal, prefix + f"plan/{gen}")
        for gen in sorted({a["generation"] for a in arrivals.values()})
    }
    by_generation = {gen: Plan.from_json(t) for gen, t in texts.items()}
    plans = {g: by_generation[a["generation"]] for g, a in arrivals.items()}
    in_force = by_generation[max(by_generation)]
    job = trainer.job
    own = trainer.services.state.snapshot().rates  # the leader's own view of the rates
    rates: dict[int, float | None] = {g: None for g in out}
    for g in members:
        r = own.get(g)
        rates[g] = r if r is not None else 1.0
    problem = job.problem(rates, previous_plan=in_force)
    budget = min(5.0, float(job.policy.planning_timeout_seconds))
    new = planner(problem, time_limit=budget)
    generation = max(a["newest"] for a in arrivals.values()) + 1
    new = new.model_copy(update={"generation": generation})
    check_plan(problem, new)
    have = survivor_holders(job, plans)
    mode = "replicas" if all(have.values()) else "checkpoint"
    return {
        "members": members,
        "failed": {str(g): w for g, w in failed.items()},
        "out": {str(g): w for g, w in out.items()},
        "step": step,
        "vec": vec,
        "plan": new.to_json(),
        "plans": texts,  # generation -> the plan (JSON), each once
        "plan_of": {str(g): a["generation"] for g, a in arrivals.items()},
        "mode": mode,
        "detected": min(a["detected"] for a in arrivals.values()),
    }
