"""operator/syncs.py: a job's pod events coalesced into few syncs, none of them lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from malleus.operator.syncs import PodEvents, SyncQueue


def pod(name: str, phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": phase}}


def test_events_during_a_sync_join_one_next_sync_and_none_is_lost() -> None:
    async def scenario() -> tuple[list[PodEvents], list[int], int]:
        queue: SyncQueue[int] = SyncQueue()
        release = asyncio.Event()
        seen: list[PodEvents] = []

        async def run(events: PodEvents) -> int:
            seen.append(events)
            if len(seen) == 1:
                await release.wait()  # the first sync is slow: every other event arrives now
            return len(seen)

        first = asyncio.ensure_future(queue.sync("job", run, fresh=pod("w-0")))
        await asyncio.sleep(0)
        later = [
            asyncio.ensure_future(queue.sync("job", run, fresh=pod(f"w-{i}"))) for i in range(1, 30)
        ]
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(first, *later)
        return seen, results, queue.runs

    seen, results, runs = asyncio.run(scenario())
    assert runs == 2  # 30 events, two syncs: the one running and the one they all joined
    assert set(seen[0].fresh) == {"w-0"}
    assert set(seen[1].fresh) == {f"w-{i}" for i in range(1, 30)}  # every later event's body
    assert results == [1] + [2] * 29  # each event gets the sync that read it


def test_a_sync_that_fails_fails_every_event_it_took_in() -> None:
    async def scenario() -> list[Any]:
        queue: SyncQueue[int] = SyncQueue()
        gate = asyncio.Event()

        async def slow(events: PodEvents) -> int:
            await gate.wait()
            return 1

        async def broken(events: PodEvents) -> int:
            raise RuntimeError("the API server said no")

        running = asyncio.ensure_future(queue.sync("job", slow))
        await asyncio.sleep(0)
        waiting = [asyncio.ensure_future(queue.sync("job", broken)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(running, *waiting, return_exceptions=True)

    got = asyncio.run(scenario())
    assert got[0] == 1
    assert all(isinstance(e, RuntimeError) and "said no" in str(e) for e in got[1:])


def test_jobs_sync_side_by_side() -> None:
    async def scenario() -> int:
        queue: SyncQueue[str] = SyncQueue()
        both = asyncio.Barrier(2)

        async def run(events: PodEvents) -> str:
            await asyncio.wait_for(both.wait(), 5)  # only returns if the other job runs too
            return "ok"

        await asyncio.gather(queue.sync("a", run), queue.sync("b", run))
        return queue.runs

    assert asyncio.run(scenario()) == 2


def test_a_pod_deleted_after_it_was_seen_counts_as_deleted() -> None:
    events = PodEvents()
    events.add(pod("w-1"), None)
    events.add(None, [pod("w-1", "Failed")])
    events.add(pod("w-2"), None)
    assert set(events.fresh) == {"w-2"}
    assert [d["metadata"]["name"] for d in events.deleted if not isinstance(d, str)] == ["w-1"]


def test_a_cancelled_sync_does_not_strand_the_events_that_joined_it() -> None:
    async def scenario() -> tuple[bool, int]:
        queue: SyncQueue[int] = SyncQueue()
        gate = asyncio.Event()

        async def slow(events: PodEvents) -> int:
            await gate.wait()
            return 1

        running = asyncio.ensure_future(queue.sync("job", slow))
        await asyncio.sleep(0)
        owner = asyncio.ensure_future(queue.sync("job", slow))
        await asyncio.sleep(0)
        joiner = asyncio.ensure_future(queue.sync("job", slow))
        await asyncio.sleep(0)
        owner.cancel()  # kopf cancels a handler at shutdown
        with pytest.raises(asyncio.CancelledError):
            await joiner
        gate.set()
        await running
        return joiner.cancelled(), await queue.sync("job", slow)  # the next event syncs anew

    cancelled, after = asyncio.run(scenario())
    assert cancelled and after == 1
