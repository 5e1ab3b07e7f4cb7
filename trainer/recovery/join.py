"""Live recovery, replacements joining: a `--join` process enters the running job.

A replacement posts `join/GPU` and waits (`await_admission`); the coordinator finds it before a
step's world vector (`joiners`) and announces it in a control word, and at that step boundary
every member and the joiner re-form the process group at the next epoch (`admit`), no step
lost; the joiner clears its predecessor's death mark (`rec/dead/GPU`) on the way in. Apart
from trainer/recovery/protocol.py because no rank failed here: nothing is decided or restored, the joiner
only learns the plan in force, the step, the `out` set and who was admitted so far (`joined`).

A request is told apart from the ones already admitted by a random nonce, not by its place in
the counter `join/GPU/n`: the store may be started again, empty, mid-run (trainer/world/store_client.py),
and a counter that starts again at 1 would make the next replacement of a GPU already replaced
once look admitted (it waited until its timeout). Every member keeps the nonces admitted so far
(`Ledger.admitted`), and a joiner gets them with its admission, so whichever member coordinates
next reads the requests alike.

The request, the coordinator's list of joiners and the admission are sealed with the job's key
(trainer/world/sealed.py): a request planted by a stranger is not one (no seat is offered to a
process without the job's key), nor is a planted list or admission (a replacement forms no
group with members a stranger names). The count `join/GPU/n` is not sealed: a forged bump can
only hide a real request until its timeout.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from malleus.trainer.world.errors import DEAD_KEY, LaunchError
from malleus.trainer.world.faults import fault_point
from malleus.trainer.world.membership import Membership
from malleus.trainer.world.sealed import Sealer
from malleus.trainer.world.world import World

from .groups import form_group, release_groups, wait_sealed
from .ledger import Ledger

if TYPE_CHECKING:
    from malleus.trainer.engine.trainer import Trainer

__all__ = ["AWAIT_JOIN_ENV", "Admission", "admit", "await_admission", "joined", "joiners"]

log = logging.getLogger(__name__)

JOIN_KEY = "join/"
AWAIT_JOIN_ENV = "MALLEUS_AWAIT_JOIN"
"""Test hook: `GPU`. The coordinator, at each step boundary while GPU is out of the job, waits
(at most `AWAIT_JOIN_S`) until a replacement of it has asked to join, so that a test of
re-admission does not depend on how fast the replacement's interpreter starts on a loaded
machine. A wait outside any compute charge (unlike stopping the process), so the emulated clock
has nothing to catch up afterwards. Where the coordinator is not the only member, only for
waits well within the hang timeout: the others wait for it in the world all-gather. Not before the first step after a recovery commits
(`malleus run` starts a replacement only then)."""
AWAIT_JOIN_S = 120.0


# ---- replacements joining ------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """What a replacement learns when the running job admits it."""

    epoch: int
    members: tuple[int, ...]
    step: int
    plan: str  # the plan in force (JSON)
    out: dict[int, str]
    admitted: dict[int, str]  # GPU -> the nonce of its replacement admitted last


def await_admission(world: World, store: Any, gpu: int, timeout_s: float) -> Admission:
    """A replacement for `gpu` (started with `--join`): ask to join, wait until the coordinator
    admits it at a step boundary, then form the process group with the members (installed
    into `world`, with `store` to recover by)."""
    seal = world.sealer
    deadline = time.monotonic() + timeout_s
    while True:
        # A fresh request (nonce) each time: the members take a request they announced for
        # answered, so a replacement that died after asking is not waited for again and again;
        # one that is alive asks again when its admission's group could not be formed.
        nonce = secrets.token_hex(8)
        n = store.add(f"{JOIN_KEY}{gpu}/n", 1)
        seal.put(store, f"{JOIN_KEY}{gpu}/{n}", json.dumps({"at": time.time(), "nonce": nonce}))
        left = max(0.0, deadline - time.monotonic())
        admit = wait_sealed(store, seal, _admit_key(gpu, nonce), left)
        if admit is None:
            raise LaunchError(f"rank {gpu}: the running job did not admit it within {timeout_s:g}s")
        # Its predecessor's death mark (`rec/dead/GPU`) must not outlive it: the recovery reads
        # it as "this GPU's process is gone" (the leader waits for no arrival of it, the others
        # stop waiting for a decision of it), which is no longer true of this process.
        store.delete_key(DEAD_KEY + str(gpu))
        world.set_collective_timeout(admit["timeout"])
        m = Membership(admit["epoch"], tuple(admit["members"]), admit["lead"])
        world.install(m, store)
        try:
            form_group(world, store, _group_prefix(m.epoch), m, gpu)
        except RuntimeError as e:  # a member died while the group formed: the members
            # recover without it and without this GPU, then admit its next request
            log.warning("rank %d: admission at epoch %d failed (%s); asking again", gpu, m.epoch, e)
            continue
        break
    return Admission(
        m.epoch,
        m.members,
        admit["step"],
        admit["plan"],
        {int(g): w for g, w in admit["out"].items()},
        {int(g): str(v) for g, v in admit["admitted"].items()},
    )


def joined(trainer: Trainer, ledger: Ledger, admission: Admission) -> None:
    """The replacement's Trainer (built under the plan in force, holding nothing) takes the step,
    its ledger the `out` set and the admitted nonces; collective with the members' `admit`."""
    trainer.enter_at(admission.step)
    ledger.out = dict(admission.out)
    ledger.admitted = dict(admission.admitted)
    trainer.services.state.update(step=admission.step, out=dict(ledger.out))
    print(f"[malleus] rank {trainer.rank} joined at step {trainer.step}", flush=True)


def joiners(ledger: Ledger, world: World) -> int:
    """The coordinator, before a step's world vector: replacements waiting to join (posted
    under `rec/NEXT_EPOCH/joiners` for the members to read after the vector); their count.
    The Trainer calls it through the hook the loop passes in."""
    store, m = world.store, world.current
    if store is None or m is None:
        return 0
    seal = world.sealer
    _await_join(store, seal, m, ledger, world.size)
    found = []
    for g in range(world.size):
        if g in m:
            continue
        nonce = _pending(store, seal, g, ledger.admitted)
        if nonce is not None:
            found.append([g, nonce])
    if found:
        seal.put(store, f"rec/{m.epoch + 1}/joiners", json.dumps(found))
    return len(found)


def _await_join(store: Any, seal: Sealer, m: Membership, ledger: Ledger, world: int) -> None:
    """`AWAIT_JOIN_ENV` (tests): wait for the named GPU's replacement to ask to join."""
    want = os.environ.get(AWAIT_JOIN_ENV, "")
    if not want.isdigit() or int(want) in m or int(want) >= world:
        return
    if ledger.recovering is not None:
        return  # the recovery's first step must commit first: `malleus run` starts it then
    deadline = time.monotonic() + AWAIT_JOIN_S
    while _pending(store, seal, int(want), ledger.admitted) is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _admit_key(gpu: int, nonce: str) -> str:
    return f"{JOIN_KEY}{gpu}/admit/{nonce}"


def _group_prefix(epoch: int) -> str:
    """Where an admission's process group meets: apart from the keys of a recovery at the same
    epoch (`rec/E/pg/`), which follows an admission whose group could not be formed (a member
    died meanwhile): the membership in force is still the one before it."""
    return f"rec/{epoch}/join/"


def _pending(store: Any, seal: Sealer, gpu: int, admitted: dict[int, str]) -> str | None:
    """The nonce of `gpu`'s latest request to join when it is not admitted yet, else None.

    Only the latest request counts (the runner starts one replacement of a GPU at a time; an
    earlier one that is still waiting has given up by then). A request counted but not yet
    posted, not sealed by this job, or not of the shape `await_admission` writes, is not one
    (yet)."""
    n = store.add(f"{JOIN_KEY}{gpu}/n", 0)
    if n <= 0:
        return None
    body = seal.get(store, f"{JOIN_KEY}{gpu}/{n}")
    if body is None:
        return None
    try:
        nonce = json.loads(body)["nonce"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(nonce, str) or nonce == admitted.get(gpu):
        return None
    return nonce


def admit(trainer: Trainer, ledger: Ledger) -> None:
    """Collective at a step boundary that announced replacements: every member and the
    joiners re-form the process group at the next epoch (no step is lost)."""
    store, m = trainer.world.store, trainer.world.current
    assert store is not None and m is not None
    epoch = m.epoch + 1
    seal = trainer.world.sealer
    # Announced by the coordinator's control word, posted before it: a list that does not
    # open (a stranger's, over the real one) admits nobody, and the members re-form as they are.
    name = f"rec/{epoch}/joiners"
    listed = seal.open(name, store.get(name))  # waits for it, as before the seal
    found = json.loads(listed) if listed is not None else []
    new = Membership(epoch, tuple(sorted({*m.members, *(g for g, _ in found)})), m.coordinator)
    # A request announced is answered (its nonce taken for admitted) whatever comes of it;
    # the joiners leave `out` only once their group is formed: a member may die while it
    # forms, and the recovery that follows must plan without them (a live joiner asks again).
    entering = {int(g): str(nonce) for g, nonce in found}
    ledger.admitted.update(entering)
    admitted = dict(ledger.admitted)
    out = {g: w for g, w in ledger.out.items() if g not in entering}
    if trainer.rank == m.coordinator:
        admission = {
            "epoch": epoch,
            "members": list(new.members),
            "lead": new.lead,
            "step": trainer.step,
            "plan": trainer.plan.to_json(),
            "out": {str(g): w for g, w in out.items()},
            "timeout": trainer.world.collective_timeout_s,
            "admitted": {str(g): v for g, v in admitted.items()},
        }
        for g, nonce in found:
            seal.put(store, _admit_key(g, nonce), json.dumps(admission))
    release_groups(trainer, None)
    fault_point("admit", trainer.rank, store=store)  # fault injection (tests): dies here
    form_group(trainer.world, store, _group_prefix(epoch), new, trainer.rank)
    ledger.out = out
    inbox = trainer.services.inbox
    if trainer.rank == m.coordinator and inbox is not None:
        inbox.replan(trainer.job.problem({g: None for g in ledger.out}))
    trainer.rebuild_pipeline()  # the groups in the same order as the joiner's Trainer makes them
    trainer.calibrator.restart()
    trainer.services.state.update(out=dict(ledger.out))
    log.info("rank %d: admitted %s at step %d", trainer.rank, [g for g, _ in found], trainer.step)
