"""The switch protocol (docs/reference/trainer.md): plans and stop requests reach every rank at one boundary.

Rank 0, the coordinator, holds the plan inbox (`POST /plan`) and the stop request (`POST /stop`).
At the end of each step it takes whatever is pending and encodes it in control words that
ride in its row of the step's world all-gather (every rank reads them from the coordinator's row
only: trainer/engine/step.py `world_vector`), so an ordinary step costs no extra collective.
When a plan is pending, its JSON follows in one broadcast whose length every rank has just learnt
(`broadcast_bytes`, trainer/world/exchange.py: bytes, never a pickle). All ranks
therefore switch (or stop) between the same two steps; a plan posted mid-step waits in the inbox
for the next boundary, and since every rank takes part in the same collectives in the same order
whatever arrives when, nothing can deadlock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from malleus.trainer.world.world import World

from .plan_inbox import PlanInbox

__all__ = [
    "CONTROL_WORDS",
    "MIGRATION_TIMEOUT_S",
    "Boundary",
    "Coordinator",
    "Migration",
    "MigrationError",
    "StopControl",
    "settle",
]

log = logging.getLogger(__name__)

CONTROL_WORDS = 3  # [plan JSON length in bytes, stop code, replacements joining now]
STOP_NONE, STOP, STOP_CHECKPOINT = 0, 1, 2
MIGRATION_TIMEOUT_S = 300.0
"""Bound on any wait inside a switch: a rank that dies mid-migration fails the job this fast
even where no launcher watches the processes."""


@dataclass(frozen=True)
class Boundary:
    """What the coordinator announces at a step boundary."""

    plan_bytes: int = 0  # length of the plan JSON that follows; 0: no switch
    stop: int = STOP_NONE
    joins: int = 0  # replacement processes admitted at this boundary (trainer/recovery/protocol.py)

    @property
    def stopping(self) -> bool:
        return self.stop != STOP_NONE

    @property
    def checkpoint(self) -> bool:
        return self.stop == STOP_CHECKPOINT

    def words(self) -> list[float]:
        return [float(self.plan_bytes), float(self.stop), float(self.joins)]

    @classmethod
    def decode(cls, words: Sequence[float]) -> Boundary:
        """From the coordinator's words (read from its row of the world gather)."""
        return cls(int(words[0]), int(words[1]), int(words[2]) if len(words) > 2 else 0)


class StopControl:
    """The coordinator's stop request, set by `POST /stop`, read at every step boundary.

    `can_checkpoint` says whether the job has a checkpoint directory; a stop asks for a
    checkpoint by default when it does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._code = STOP_NONE
        self.can_checkpoint = False

    def request(
        self, body: bytes | str | dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Answer a POST /stop: (202, {stopping, checkpoint}) or (400, {error})."""
        try:
            req = body if isinstance(body, dict) else json.loads(body or b"{}")
            if not isinstance(req, dict) or set(req) - {"checkpoint"}:
                raise ValueError('expected {} or {"checkpoint": <bool>}')
            checkpoint = req.get("checkpoint", self.can_checkpoint)
            if not isinstance(checkpoint, bool):
                raise ValueError(f"checkpoint: {checkpoint!r}; need true or false")
        except ValueError as e:
            return 400, {"error": f"invalid stop request: {e}"}
        if checkpoint and not self.can_checkpoint:
            return 400, {"error": "no checkpoint directory configured; stop without a checkpoint"}
        with self._lock:
            self._code = max(self._code, STOP_CHECKPOINT if checkpoint else STOP)
            code = self._code
        log.info("stop requested (checkpoint: %s)", code == STOP_CHECKPOINT)
        return 202, {"stopping": True, "checkpoint": code == STOP_CHECKPOINT}

    @property
    def code(self) -> int:
        with self._lock:
            return self._code


class Coordinator:
    """Rank 0's side: what to announce at the boundary this step ends on."""

    def __init__(self, inbox: PlanInbox, stop: StopControl) -> None:
        self.inbox, self.stop = inbox, stop

    def take(self) -> tuple[Boundary, bytes]:
        """The boundary's control words and the plan JSON (empty: none). Takes the plan."""
        plan = self.inbox.take()
        payload = plan.model_dump_json().encode() if plan is not None else b""
        return Boundary(len(payload), self.stop.code), payload


def settle(timeout_s: float, world: World) -> None:
    """Collective: every rank has finished its transfers, within `timeout_s`. With the recovery
    alarm, a barrier waited for through the World (a peer known dead or stopped by its
    heartbeat ends the wait in seconds, named by the alarm); without it, with gloo, a monitored
    barrier, so a rank that never arrives is named instead of hanging the job."""
    if world.watched:
        world.wait(dist.barrier(async_op=True), timeout_s)
    elif dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


@dataclass(frozen=True)
class Migration:
    """What one switch did, as /status and the log show it."""

    generation: int
    step: int  # the switch happened before this step ran
    seconds: float  # the slowest rank's wall time, plan broadcast to new groups ready
    bytes: int  # moved over the wire, summed over ranks
    minimal_bytes: int  # what the layout change requires (malleus.planner.cost.holdings)
    transfers: int

    def as_status(self) -> dict[str, Any]:
        return asdict(self)


class MigrationError(RuntimeError):
    """A switch failed; the message names the rank, the plan generation and the step."""
