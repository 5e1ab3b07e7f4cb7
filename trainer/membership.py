"""Who is in the job now: GPU ids (the plan's ranks) against process-group ranks.

A job starts with every GPU `0..world-1` in one process group, GPU g being process-group rank
g. After a recovery (trainer/recovery.py) the survivors re-form the group among themselves, so
it has fewer ranks than the job has GPUs. The trainer keeps GPU ids everywhere (plans, layouts,
the step's world vector, checkpoints) and translates at the one place an id meets
torch.distributed: `pg(gpu)`. Members are kept sorted, so the translation is monotonic and a
group's process-group order is its GPU order. The coordinator is the lowest member.

One process is one rank, so the membership in force is process-wide (`current()`), set when the
process group is formed or re-formed (`install`). Without a re-form it is the identity.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = [
    "Membership",
    "bound",
    "coordinator",
    "current",
    "install",
    "pg",
    "step_deadline",
    "store",
]


@dataclass(frozen=True)
class Membership:
    """The job's process group at one epoch (0 = as started; +1 per re-form)."""

    epoch: int
    members: tuple[int, ...]  # sorted GPU ids in the process group
    lead: int | None = None  # the coordinator; None (or not a member): the lowest member
    _index: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if list(self.members) != sorted(set(self.members)):
            raise ValueError(f"members must be sorted and distinct: {self.members}")
        self._index.update({g: i for i, g in enumerate(self.members)})

    @classmethod
    def full(cls, world: int) -> Membership:
        return cls(0, tuple(range(world)))

    @property
    def coordinator(self) -> int:
        """The coordinator stays where it is while it lives (a replacement of GPU 0 joining
        does not take it back); when it fails, the lowest survivor takes over."""
        return self.lead if self.lead in self._index else self.members[0]

    @property
    def size(self) -> int:
        return len(self.members)

    def pg(self, gpu: int) -> int:
        """GPU id -> its rank in the process group; KeyError for a GPU out of the job."""
        try:
            return self._index[gpu]
        except KeyError:
            raise KeyError(f"GPU {gpu} is not in the job (members {list(self.members)})") from None

    def gpu(self, pg_rank: int) -> int:
        return self.members[pg_rank]

    def __contains__(self, gpu: object) -> bool:
        return gpu in self._index


DEFAULT_HANG_TIMEOUT_S = 600.0
"""The collectives' bound until the step time is measured (spec.failurePolicy unset)."""
HANG_STEPS, HANG_MIN_S, HANG_MAX_S = 10, 30.0, 600.0
"""Unset `hangTimeoutSeconds`: 10 measured steps, clamped to [30, 600] s."""

_current: Membership | None = None
_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
_store: Any = None  # the rendezvous store client (None: failures are fatal)
_step_start: float | None = None  # monotonic start of the step in progress (`step_deadline`)
_bounds: dict[int, tuple[Any, float]] = {}  # id(group) -> (group, its timeout), this step only
STEP_FLOOR = 0.5
"""Inside a step a collective's timeout is at least this share of the hang timeout."""


def install(membership: Membership, rendezvous: Any = None) -> None:
    """Record the process group just formed (and, the first time, the store to recover by)."""
    global _current, _store
    _current = membership
    if rendezvous is not None:
        _store = rendezvous


def collective_timeout_s() -> float:
    """The bound on every collective of a fault-tolerant job: the hang timeout."""
    return _timeout_s


def set_collective_timeout(seconds: float, groups: Any = ()) -> None:
    """Bound every later collective by `seconds`: the default group's and `groups`' timeouts
    change in place (no collective; `dist.new_group` is given it too, trainer/parallel/groups.py)."""
    global _timeout_s
    _timeout_s = float(seconds)
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if not dist.is_initialized():
        return
    limit = timedelta(seconds=_timeout_s)
    from torch.distributed.distributed_c10d import _rank_not_in_group

    for group in (None, *groups):
        if group is None or not _rank_not_in_group(group):
            _set_pg_timeout(limit, group)


@contextlib.contextmanager
def step_deadline() -> Iterator[None]:
    """Inside: every collective passed through `bound` times out at one deadline, the hang
    timeout after the step started, rather than the hang timeout after it was entered.

    Why: the ranks leave the previous step's world all-reduce within milliseconds of each
    other, so this deadline is common to the job, and when a rank hangs every survivor
    blocked on it fails at once. With a timeout counted from each collective's entry, the
    survivor that entered its collective with the hung rank last (the other replica's gradient
    sync, entered a backward pass after the hung rank's TP partner got stuck in its forward)
    would be waited for that much longer, and nobody else can wake it: the hung rank's end of
    that connection never closes. A collective entered late in a slow step keeps at least
    `STEP_FLOOR` of the timeout, so a slow step is not taken for a hang any sooner than
    before. On the way out the groups get the plain bound back (switches, checkpoints)."""
    global _step_start
    _step_start = time.monotonic()
    try:
        yield
        for group, seconds in list(_bounds.values()):
            if seconds != _timeout_s:
                _set(group, _timeout_s)
    finally:
        # Holds no group past the step: a failed step's groups must lose their last reference
        # for their sockets to close (trainer/recovery_groups.py `_release`).
        _step_start = None
        _bounds.clear()


def bound(group: Any = None) -> None:
    """Before a collective of the step on `group` (None: the job's group): its timeout ends at
    the step's deadline (`step_deadline`; outside one, nothing changes). Costs a clock read;
    the group's timeout is set (a call into the backend) only when it is 20 ms or more off."""
    if _step_start is None or _store is None:
        return
    left = max(_timeout_s - (time.monotonic() - _step_start), _timeout_s * STEP_FLOOR)
    known = _bounds.get(id(group))  # held while in here, so an id is never reused
    if known is None or abs(known[1] - left) >= 0.02:
        _set(group, left)


def _set(group: Any, seconds: float) -> None:
    from torch.distributed.distributed_c10d import _set_pg_timeout

    try:
        _set_pg_timeout(timedelta(seconds=seconds), group)
    except (RuntimeError, ValueError, AssertionError):  # a group already torn down
        return
    _bounds[id(group)] = (group, seconds)


def sized_hang_timeout(step_seconds: float) -> float:
    return min(HANG_MAX_S, max(HANG_MIN_S, HANG_STEPS * step_seconds))


def current() -> Membership | None:
    return _current


def store() -> Any:
    """The rendezvous store that outlives any rank, or None when failures are not survivable."""
    return _store


def pg(gpu: int) -> int:
    """GPU id -> process-group rank under the membership in force (the identity before any)."""
    return gpu if _current is None else _current.pg(gpu)


def coordinator() -> int:
    """The coordinator's GPU id: the lowest member (0 before any membership is installed)."""
    return 0 if _current is None else _current.coordinator


def reset() -> None:
    """Tests: forget the membership and the store."""
    global _current, _store
    _current, _store = None, None
