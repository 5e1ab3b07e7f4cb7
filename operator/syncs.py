"""Pod events of one job coalesced into few syncs, as controller-runtime's work queue coalesces
the events of one key: at most one sync of a job runs and one waits; an event that finds one
waiting joins it, its pod body or its deleted pod added to what that sync will read.

Why: every sync reads the job and lists all of its pods (`children.sync_pods`), and a job's
start brings three or four events per pod at once, so one sync per event read the job's pods
N times over (docs/benchmarks.md "Operator at scale": 873 lists of a 257-pod job while it
started). A sync that starts after an event always sees it: the waiting sync has not begun, so
the list it will make is newer than the event, and the event's own body (`fresh`, newer than a
list that lags) and deleted pods (a watch's DELETED bodies, which a list no longer holds) travel
with it. Everyone who joined gets that sync's result, or its error (kopf retries the handler).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["PodEvents", "SyncQueue"]

_T = TypeVar("_T")


@dataclass
class PodEvents:
    """What the events joined into one sync carry: the newest body of each pod seen (by name),
    and the pods deleted (bodies, or names)."""

    fresh: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    deleted: list[str | Mapping[str, Any]] = field(default_factory=list)

    def add(
        self, fresh: Mapping[str, Any] | None, deleted: list[str | Mapping[str, Any]] | None
    ) -> None:
        if fresh is not None:
            self.fresh[str((fresh.get("metadata") or {}).get("name"))] = fresh
        for d in deleted or []:
            name = d if isinstance(d, str) else (d.get("metadata") or {}).get("name")
            self.fresh.pop(str(name), None)  # gone after it was seen: the deletion wins
            self.deleted.append(d)


class _Waiting(Generic[_T]):
    def __init__(self) -> None:
        self.events = PodEvents()
        self.result: asyncio.Future[_T] = asyncio.get_running_loop().create_future()


class SyncQueue(Generic[_T]):
    """Per key (a job), one sync running and one waiting (see the module)."""

    def __init__(self) -> None:
        self._waiting: dict[Any, _Waiting[_T]] = {}
        self._locks: dict[Any, tuple[asyncio.Lock, int]] = {}
        self.runs = 0
        """Syncs run (for tests and the bench: events over runs is the coalescing)."""

    async def sync(
        self,
        key: Any,
        run: Callable[[PodEvents], Awaitable[_T]],
        *,
        fresh: Mapping[str, Any] | None = None,
        deleted: list[str | Mapping[str, Any]] | None = None,
    ) -> _T:
        """`run(events)` once for this event and whoever joins it before it starts; its result."""
        waiting = self._waiting.get(key)
        if waiting is not None:  # not begun yet: it will read what this event says
            waiting.events.add(fresh, deleted)
            return await asyncio.shield(waiting.result)
        waiting = self._waiting[key] = _Waiting()
        waiting.events.add(fresh, deleted)
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                if self._waiting.get(key) is waiting:
                    del self._waiting[key]  # begun: later events wait for the next one
                self.runs += 1
                result = await run(waiting.events)
            waiting.result.set_result(result)
            return result
        except BaseException as e:
            if self._waiting.get(key) is waiting:  # cancelled before it began
                del self._waiting[key]
            if isinstance(e, asyncio.CancelledError):
                waiting.result.cancel()  # the joiners' handlers end as this one does
            elif not waiting.result.done():
                waiting.result.set_exception(e)
                waiting.result.exception()  # retrieved: joiners re-raise it, or none did
            raise
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
