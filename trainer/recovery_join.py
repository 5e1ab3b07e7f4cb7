"""Live recovery, replacements joining: a `--join` process enters the running job.

A replacement posts `join/GPU` and waits (`await_admission`); the coordinator finds it before a
step's world vector (`joiners`) and announces it in a control word, and at that step boundary
every member and the joiner re-form the process group at the next epoch (`admit`), no step
lost; the joiner clears its predecessor's death mark (`rec/dead/GPU`) on the way in. Apart
from trainer/recovery.py because no rank failed here: nothing is decided or restored, the joiner
only learns the plan in force, the step, the `out` set and who was admitted so far (`joined`).

A request is told apart from the ones already admitted by a random nonce, not by its place in
the counter `join/GPU/n`: the store may be started again, empty, mid-run (trainer/store_client.py),
and a counter that starts again at 1 would make the next replacement of a GPU already replaced
once look admitted (it waited until its timeout). Every member keeps the nonces admitted so far
(`Trainer.admitted`), and a joiner gets them with its admission, so whichever member coordinates
next reads the requests alike.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import membership
from .launch import DEAD_KEY
from .membership import Membership
from .recovery_groups import _form, _release, _wait_json
from .recovery_restore import _restart_calibration

if TYPE_CHECKING:
    from .worker import Trainer

__all__ = ["AWAIT_JOIN_ENV", "Admission", "admit", "await_admission", "joined", "joiners"]

log = logging.getLogger(__name__)

JOIN_KEY = "join/"
AWAIT_JOIN_ENV = "MALLEUS_AWAIT_JOIN"
"""Test hook: `GPU`. The coordinator, at each step boundary while GPU is out of the job, waits
(at most `AWAIT_JOIN_S`) until a replacement of it has asked to join, so that a test of
re-admission does not depend on how fast the replacement's interpreter starts on a loaded
machine. A wait outside any compute charge (unlike stopping the process), so the emulated clock
has nothing to catch up afterwards. Only where the coordinator is the only member: the others
would wait for it in the world all-reduce. Not before the first step after a recovery commits
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


def await_admission(store: Any, gpu: int, timeout_s: float) -> Admission:
    """A replacement for `gpu` (started with `--join`): ask to join, wait until the coordinator
    admits it at a step boundary, then form the process group with the members."""
    from .launch import LaunchError

    nonce = secrets.token_hex(8)
    n = store.add(f"{JOIN_KEY}{gpu}/n", 1)
    store.set(f"{JOIN_KEY}{gpu}/{n}", json.dumps({"at": time.time(), "nonce": nonce}))
    admit = _wait_json(store, _admit_key(gpu, nonce), timeout_s)
    if admit is None:
        raise LaunchError(f"rank {gpu}: the running job did not admit it within {timeout_s:g}s")
    # Its predecessor's death mark (`rec/dead/GPU`) must not outlive it: the recovery reads it
    # as "this GPU's process is gone" (the leader waits for no arrival of it, the others stop
    # waiting for a decision of it), which is no longer true of this process.
    store.delete_key(DEAD_KEY + str(gpu))
    membership.set_collective_timeout(admit["timeout"])
    m = Membership(admit["epoch"], tuple(admit["members"]), admit["lead"])
    membership.install(m, store)
    _form(store, f"rec/{m.epoch}/", m, gpu)
    return Admission(
        m.epoch,
        m.members,
        admit["step"],
        admit["plan"],
        {int(g): w for g, w in admit["out"].items()},
        {int(g): str(v) for g, v in admit["admitted"].items()},
    )


def joined(trainer: Trainer, admission: Admission) -> None:
    """The replacement's Trainer (built under the plan in force, holding nothing) takes the step
    and the `out` set; collective with the members' `admit`."""
    trainer.step = admission.step
    trainer.out = dict(admission.out)
    trainer.admitted = dict(admission.admitted)
    trainer.services.state.update(step=admission.step, out=dict(trainer.out))
    print(f"[malleus] rank {trainer.rank} joined at step {trainer.step}", flush=True)


def joiners(trainer: Trainer) -> int:
    """The coordinator, before a step's world vector: replacements waiting to join (posted
    under `rec/NEXT_EPOCH/joiners` for the members to read after the vector); their count."""
    store, m = membership.store(), membership.current()
    if store is None or m is None:
        return 0
    _await_join(store, m, trainer)
    found = []
    for g in range(trainer.world):
        if g in m:
            continue
        nonce = _pending(store, g, trainer.admitted)
        if nonce is not None:
            found.append([g, nonce])
    if found:
        store.set(f"rec/{m.epoch + 1}/joiners", json.dumps(found))
    return len(found)


def _await_join(store: Any, m: Membership, trainer: Trainer) -> None:
    """`AWAIT_JOIN_ENV` (tests): wait for the named GPU's replacement to ask to join."""
    want = os.environ.get(AWAIT_JOIN_ENV, "")
    if not want.isdigit() or int(want) in m or int(want) >= trainer.world:
        return
    if getattr(trainer, "recovering", None) is not None:
        return  # the recovery's first step must commit first: `malleus run` starts it then
    deadline = time.monotonic() + AWAIT_JOIN_S
    while _pending(store, int(want), trainer.admitted) is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _admit_key(gpu: int, nonce: str) -> str:
    return f"{JOIN_KEY}{gpu}/admit/{nonce}"


def _pending(store: Any, gpu: int, admitted: dict[int, str]) -> str | None:
    """The nonce of `gpu`'s latest request to join when it is not admitted yet, else None.

    Only the latest request counts (the runner starts one replacement of a GPU at a time; an
    earlier one that is still waiting has given up by then). A request counted but not yet
    posted, or not of the shape `await_admission` writes, is not one (yet)."""
    n = store.add(f"{JOIN_KEY}{gpu}/n", 0)
    key = f"{JOIN_KEY}{gpu}/{n}"
    if n <= 0 or not store.check([key]):
        return None
    try:
        nonce = json.loads(store.get(key))["nonce"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(nonce, str) or nonce == admitted.get(gpu):
        return None
    return nonce


def admit(trainer: Trainer) -> None:
    """Collective at a step boundary that announced replacements: every member and the
    joiners re-form the process group at the next epoch (no step is lost)."""
    store, m = membership.store(), membership.current()
    assert store is not None and m is not None
    epoch = m.epoch + 1
    found = json.loads(store.get(f"rec/{epoch}/joiners"))
    new = Membership(epoch, tuple(sorted({*m.members, *(g for g, _ in found)})), m.coordinator)
    for g, nonce in found:
        trainer.admitted[g] = nonce
        trainer.out.pop(g, None)
    if trainer.rank == m.coordinator:
        admission = {
            "epoch": epoch,
            "members": list(new.members),
            "lead": new.lead,
            "step": trainer.step,
            "plan": trainer.plan.to_json(),
            "out": {str(g): w for g, w in trainer.out.items()},
            "timeout": membership.collective_timeout_s(),
            "admitted": {str(g): v for g, v in trainer.admitted.items()},
        }
        for g, nonce in found:
            store.set(_admit_key(g, nonce), json.dumps(admission))
        inbox = trainer.services.inbox
        if inbox is not None:
            inbox.replan(trainer.job.problem({g: None for g in trainer.out}))
    _release(trainer, None)
    _form(store, f"rec/{epoch}/", new, trainer.rank)
    trainer.groups.ensure(trainer.layout.member_sets())  # as the joiner's Trainer does
    trainer.pipeline = trainer._pipeline(trainer.layout.place) if trainer.layout.place else None
    _restart_calibration(trainer)
    trainer.services.state.update(out=dict(trainer.out))
    log.info("rank %d: admitted %s at step %d", trainer.rank, [g for g, _ in found], trainer.step)
