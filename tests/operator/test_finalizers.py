"""`finalizers`: no MalleusJob gets a finalizer from the operator's handlers (deleting a job
never waits for an operator), and a job's DELETED event stops its daemon and timers.
tests/e2e/test_operator_e2e.py proves it on the real control plane (kubectl delete with no
operator running)."""

from __future__ import annotations

import asyncio

import kopf
from kopf._cogs.aiokits.aioenums import FlagSetter

from malleus.operator import finalizers, handlers


def test_no_handler_of_a_job_requires_a_finalizer() -> None:
    registry = kopf.get_default_registry()
    assert handlers.FINALIZER  # the name kopf uses to remove an older operator's finalizer
    spawning = registry._spawning.get_all_handlers()
    assert {h.id for h in spawning} >= {"job_daemon", "store_timer", "pending_timer"}
    assert not [h.id for h in spawning if h.requires_finalizer]
    changing = registry._changing.get_all_handlers()
    assert not [h.id for h in changing if h.requires_finalizer]
    assert finalizers.release_finalizers() == 0  # idempotent


def test_a_deleted_jobs_daemon_and_timers_are_stopped() -> None:
    async def story() -> None:
        setter: FlagSetter = FlagSetter()
        seen = []

        async def timer(**kwargs: object) -> None:
            seen.append(kwargs["body"])

        tracked = finalizers._tracked(timer)
        body = {"metadata": {"uid": "u1", "namespace": "ml", "name": "demo"}}
        await tracked(body=body, stopped=setter.async_waiter)
        assert seen == [body] and not setter.is_set()
        assert finalizers.stop_spawned("u1") == 1  # in kopf's loop, as on the DELETED event
        assert setter.is_set()
        assert finalizers.stop_spawned("u1") == 0  # forgotten once stopped

    asyncio.run(story())
