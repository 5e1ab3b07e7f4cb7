"""No finalizer on a MalleusJob: deleting a job never waits for the operator.

Nothing has to happen before a job's objects go: every child (pods, Services, ConfigMap,
Secret, PodDisruptionBudget, NetworkPolicy, PodGroup) has the job as its controller owner, so
the garbage collector removes them once the job is gone, operator or not. kopf, though, puts its
finalizer on every object that a daemon or a timer matches (to stop them before the object
goes) and on every object with a non-optional ``on.delete`` handler; with no operator running,
``kubectl delete mj`` then hangs until one comes back (seen on the real control plane:
``kubectl delete`` timing out with the job Terminating and ``malleus.io/finalizer`` set).

`release_finalizers` turns that off for the job's daemon and timers (``on.delete`` is
optional); kopf removes its finalizer from a job that still has one (made by an older operator).
kopf stops an object's daemons and timers only when it sees the object's deletionTimestamp,
which an object without finalizers never shows (the API server removes it at once, its DELETED
event carries none), so `on_job_event` stops them on the job's DELETED event.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from malleus.job import API_GROUP, PLURAL, VERSION

from .context import MEMO_KEY, Context

__all__ = ["on_job_event", "release_finalizers", "stop_spawned"]

log = logging.getLogger(__name__)

_SETTERS: dict[str, dict[int, Any]] = {}
"""By job uid: the stop flags (kopf's setters, by id) of its running daemon and timers."""


def _tracked(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``fn`` (a daemon or timer) that first notes its job's stop flag for `stop_spawned`."""

    @functools.wraps(fn)
    async def run(**kwargs: Any) -> Any:
        body, stopped = kwargs.get("body"), kwargs.get("stopped")
        setter = getattr(stopped, "_setter", None)  # kopf's FlagWaiter -> its FlagSetter
        uid = ((body or {}).get("metadata") or {}).get("uid")
        if uid and setter is not None:
            _SETTERS.setdefault(uid, {})[id(setter)] = setter
        return await fn(**kwargs)

    return run


def release_finalizers(registry: kopf.OperatorRegistry | None = None) -> int:
    """Make the MalleusJob daemons and timers of ``registry`` (kopf's default) need no
    finalizer, and track their stop flags; returns how many were changed."""
    from kopf._cogs.structs.references import Resource

    jobs = Resource(group=API_GROUP, version=VERSION, plural=PLURAL, kind="MalleusJob")
    registry = registry or kopf.get_default_registry()
    handlers = registry._spawning._handlers  # kopf has no public way to replace a handler
    changed = 0
    for i, handler in enumerate(handlers):
        if not handler.requires_finalizer:
            continue
        if handler.selector is None or not handler.selector.check(jobs):
            continue
        handlers[i] = dataclasses.replace(
            handler, requires_finalizer=False, fn=_tracked(handler.fn)
        )
        changed += 1
    return changed


def stop_spawned(uid: str) -> int:
    """Stop the daemon and timers of the job ``uid`` (gone); returns how many were told."""
    from kopf._core.intents.stoppers import DaemonStoppingReason

    setters = _SETTERS.pop(uid, {})
    for setter in setters.values():
        setter.set(reason=DaemonStoppingReason.RESOURCE_DELETED)
    return len(setters)


def _deleted(type: str, **_: Any) -> bool:  # noqa: A002  (kopf's name for the event type)
    return type == "DELETED"


@kopf.on.event(API_GROUP, VERSION, PLURAL, when=_deleted)
async def on_job_event(type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:  # noqa: A002
    """A job gone (its DELETED event): stop its daemon and timers, forget its phase."""
    meta = body.get("metadata") or {}
    stopped = stop_spawned(str(meta.get("uid") or ""))
    ctx = memo.get(MEMO_KEY)
    if isinstance(ctx, Context):
        ctx.metrics.phases.forget(str(meta.get("namespace")), str(meta.get("name")))
    log.info("%s/%s: deleted; stopped %d daemon(s) and timer(s)", meta.get("namespace"),
             meta.get("name"), stopped)  # fmt: skip
