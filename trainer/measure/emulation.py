"""The emulated GPU clock: charge each layer-shard a configured time x a slowdown.

Many ranks share a 2-core machine in tests, demos and benchmarks, so real compute times say
nothing about the layout. With emulation on, every forward/backward of a layer is charged
`shards * base * factor` seconds: the real (tiny) math runs, and the process waits out the rest.
A GPU holding 2^k of a layer's `tp` shards is charged 2^k times as long, so a group of tp/2^k
GPUs is alpha[k] = 2^k slower than a full group, exactly the cost model's default (§4.3), and the
measured step time reflects the plan. Slowdowns come from a schedule (step -> rank -> factor) or
from `POST /inject`.

Slow links (`links`: step -> node -> factor, the job's `{step, node, link}` entries): a collective
whose members touch a slowed node (a TP all-reduce inside it, a pipeline transfer or a gradient
sync leaving it) is charged `factor` times its transfer time (`link_wait`), which the trainer's
`CommMeter` counts as communication, so the calibration measures the slow link.

Torch-free: the trainer core calls `compute()` after running the real math of a layer.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from malleus.job.presets import GPU_PROFILES

__all__ = [
    "Charge",
    "EmulatedClock",
    "InjectionQueue",
    "SlowdownEvent",
    "clock_from_profile",
    "parse_schedule",
    "precise_wait",
]

Kind = Literal["forward", "backward"]

# The last stretch of a wait is spun, without yielding: a sleep wakes ~0.1 ms late even on an
# idle host (timer slack), and `sleep(0)` on a loaded one queues behind every busy process for a
# whole time slice (measured: 4 ms late at the 90th percentile with 8 busy processes on 2 cores,
# against 0.4 ms for sleep-then-spin). 0.1 ms of spinning per wait costs ~1% of a 10 ms charge.
_SPIN_S = 0.0001
LINK_WINDOW = 16
"""Calls of one collective (same kind, members and bytes) whose shortest is its transfer time:
a call that waited for a late peer is longer, and a slow link charges only the transfer."""


@dataclass(frozen=True)
class SlowdownEvent:
    """From `step` on, `rank` computes `factor` times slower (1.0 = healthy again)."""

    step: int
    rank: int
    factor: float

    def __post_init__(self) -> None:
        _check_factor(self.factor)
        if self.step < 0 or self.rank < 0:
            raise ValueError(f"slowdown event {self}: step and rank must be >= 0")


def _check_factor(factor: float) -> float:
    f = float(factor)
    if not (math.isfinite(f) and f >= 1.0):
        raise ValueError(f"slowdown factor {factor!r}: need a finite number >= 1.0 (1.0 = healthy)")
    return f


def parse_schedule(spec: Mapping[Any, Mapping[Any, float]] | Sequence[Any]) -> list[SlowdownEvent]:
    """Read a schedule as `{step: {rank: factor}}` (JSON keys may be strings) or as a list of
    `{"step", "rank", "factor"}` objects / SlowdownEvents; sorted by step."""
    events: list[SlowdownEvent] = []
    if isinstance(spec, Mapping):
        for step, by_rank in spec.items():
            for rank, factor in by_rank.items():
                events.append(SlowdownEvent(int(step), int(rank), float(factor)))
    else:
        for e in spec:
            if isinstance(e, SlowdownEvent):
                events.append(e)
            else:
                events.append(SlowdownEvent(int(e["step"]), int(e["rank"]), float(e["factor"])))
    return sorted(events, key=lambda e: e.step)  # stable: same-step events keep their order


def precise_wait(deadline: float, spin_s: float = _SPIN_S) -> None:
    """Wait until `time.perf_counter() >= deadline`: sleep all but `spin_s`, spin the rest."""
    while (remaining := deadline - time.perf_counter()) > spin_s:
        time.sleep(remaining - spin_s)
    while time.perf_counter() < deadline:
        pass


@dataclass
class Charge:
    """Filled by `EmulatedClock.charge()` when its block ends: the charged seconds."""

    seconds: float = 0.0


@dataclass
class _Stats:
    calls: int = 0
    overruns: int = 0  # the real math alone took longer than the emulated budget
    overrun_seconds: float = 0.0  # by how much, summed
    late_seconds: float = 0.0  # wake-up lateness of the waits, summed (scheduler jitter)
    charged_seconds: float = 0.0


@dataclass(eq=False)
class EmulatedClock:
    """One rank's emulated GPU: per-layer-shard base times, a slowdown factor, a schedule.

    forward_s / backward_s: time of ONE logical layer-shard for one micro-batch on a healthy GPU.
    The factor is the latest scheduled event for this rank with `event.step <= step`, unless an
    `inject()` came later; an inject holds until this rank's next scheduled event or inject.
    `inject()` may come from any thread; `set_step()`/`compute()` belong to the training loop.
    """

    rank: int
    forward_s: float
    backward_s: float
    schedule: Sequence[SlowdownEvent] = ()
    tp: int = 1
    links: Sequence[tuple[int, int, float]] = ()
    """Slow links as (step, node, factor): from `step` on, `node`'s links are `factor` times
    slower (1.0 heals them); `ResolvedJob.link_schedule`."""
    _link_factors: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _link_calls: dict[Hashable, deque[float]] = field(default_factory=dict, init=False, repr=False)
    _link_seconds: float = field(default=0.0, init=False, repr=False)
    catch_up: bool = False
    """Make up a wait's wake-up lateness in the next charges (the trainer's clocks do): on a
    loaded host the emulated timeline then keeps the budgets' sum; a wait may end early."""
    _debt: float = field(default=0.0, init=False, repr=False)  # wake-up lateness to make up
    _factor: float = field(default=1.0, init=False, repr=False)
    _step: int | None = field(default=None, init=False, repr=False)
    _event_step: int = field(default=-1, init=False, repr=False)  # step of the event applied
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _stats: _Stats = field(default_factory=_Stats, init=False, repr=False)
    _mine: list[SlowdownEvent] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.forward_s >= 0 and self.backward_s >= 0):
            raise ValueError(
                f"forward_s/backward_s must be >= 0, got {self.forward_s}/{self.backward_s}"
            )
        if self.tp < 1 or self.tp & (self.tp - 1):
            raise ValueError(f"tp: {self.tp} is not a power of two")
        self._mine = sorted((e for e in self.schedule if e.rank == self.rank), key=lambda e: e.step)
        for step, node, factor in self.links:
            _check_factor(factor)
            if step < 0 or node < 0:
                raise ValueError(f"link event {(step, node, factor)}: step and node must be >= 0")
        self.links = sorted(
            ((int(s), int(n), float(f)) for s, n, f in self.links), key=lambda e: e[0]
        )

    # ---- the slowdown ----------------------------------------------------------------------
    @property
    def factor(self) -> float:
        return self._factor

    @property
    def reference_s(self) -> float:
        """Healthy seconds per profiler unit (one layer-shard, one micro-batch, one pass):
        forward and backward each count a unit, so a step's mean is (forward_s + backward_s)/2.
        Pass it to `RateProfiler(reference_s=...)`."""
        return (self.forward_s + self.backward_s) / 2

    def set_step(self, step: int) -> float:
        """Apply the schedule at the start of `step`; returns the factor in force.

        An event fires once, when a step first reaches it; a step going backwards (a restart
        from a checkpoint) re-reads the schedule from scratch and drops any inject.
        """
        with self._lock:
            if self._step is not None and step < self._step:
                self._factor, self._event_step = 1.0, -1
            self._step = step
            latest = None
            for e in self._mine:
                if e.step > step:
                    break
                latest = e
            if latest is not None and latest.step > self._event_step:
                self._factor, self._event_step = latest.factor, latest.step
            self._link_factors = {n: f for s, n, f in self.links if s <= step}  # latest wins
            return self._factor

    # ---- slow links ------------------------------------------------------------------------
    def link_factor(self, nodes: frozenset[int] | Sequence[int]) -> float:
        """The slowdown of a collective among `nodes`: its slowest node's links."""
        return max((self._link_factors.get(n, 1.0) for n in nodes), default=1.0)

    def link_wait(self, key: Hashable, nodes: frozenset[int], seconds: float) -> float:
        """A collective `key` among `nodes` just took `seconds`: wait `(factor - 1)` times its
        transfer time (the shortest of its last `LINK_WINDOW` calls, so that waiting for a late
        peer is not multiplied); returns the seconds waited."""
        calls = self._link_calls.get(key)
        if calls is None:
            calls = self._link_calls[key] = deque(maxlen=LINK_WINDOW)
        calls.append(seconds)
        factor = self.link_factor(nodes)
        if factor <= 1.0:
            return 0.0
        extra = (factor - 1.0) * min(calls)
        precise_wait(time.perf_counter() + extra)
        self._link_seconds += extra
        return extra

    def inject(self, factor: float) -> None:
        """Override the factor now (POST /inject); holds until the next scheduled event."""
        f = _check_factor(factor)
        with self._lock:
            self._factor = f

    # ---- charging --------------------------------------------------------------------------
    def shards(self, layers: int, group_size: int) -> int:
        """Layer-shards one GPU computes for `layers` layers in a TP group of `group_size`."""
        if group_size < 1 or self.tp % group_size:
            raise ValueError(f"group_size: {group_size} does not divide tp ({self.tp})")
        return layers * (self.tp // group_size)

    def budget(self, kind: Kind, shards: int = 1) -> float:
        """Seconds that `shards` layer-shards of `kind` cost at the current factor."""
        if kind == "forward":
            base = self.forward_s
        elif kind == "backward":
            base = self.backward_s
        else:
            raise ValueError(f"kind: {kind!r}; expected 'forward' or 'backward'")
        if shards < 1:
            raise ValueError(f"shards: {shards}; need at least 1")
        return shards * base * self._factor

    def compute(self, kind: Kind, shards: int, started: float) -> float:
        """Wait until `started + budget`; return the charged seconds.

        `started` is `time.perf_counter()` taken before the real math. If the math already
        overran the budget nothing is waited, the real duration is charged, and the overrun is
        counted (see `stats()`): emulation is then inaccurate and the base times are too small.
        With `catch_up`, a wait that woke late (a loaded host's scheduler) is made up in the
        next charges, so the emulated timeline keeps the budgets' sum, not every lateness.
        """
        budget = self.budget(kind, shards)
        target = started + budget  # where the emulated GPU's work ends
        deadline = target - self._debt  # earlier wake-up lateness is made up here (catch_up)
        now = time.perf_counter()
        st = self._stats
        st.calls += 1
        if now >= target:
            charged = now - started
            st.overruns += 1
            st.overrun_seconds += now - target
        elif now >= deadline:  # partly made up
            self._debt = now - deadline
            charged = budget
        else:
            precise_wait(deadline)
            late = time.perf_counter() - deadline
            self._debt = late if self.catch_up else 0.0
            st.late_seconds += late
            charged = budget
        st.charged_seconds += charged
        return charged

    def stretch(self, started: float) -> float:
        """Work that is not a layer (the embedding, the head) and began at `started` takes
        `factor` times its real duration, as on a slowed GPU: wait out the rest; returns the
        seconds waited."""
        if self._factor <= 1.0:
            return 0.0
        now = time.perf_counter()
        extra = (self._factor - 1.0) * max(0.0, now - started)
        precise_wait(now + extra)
        return extra

    @contextmanager
    def charge(self, kind: Kind, shards: int = 1) -> Iterator[Charge]:
        """`with clock.charge("forward", shards) as c: y = layer(x)`; then `c.seconds`."""
        c = Charge()
        started = time.perf_counter()
        yield c
        c.seconds = self.compute(kind, shards, started)

    def benchmark(self) -> float:
        """Seconds per profiler unit for a rank outside every stage, so it keeps a rate.

        Runs a tiny matmul as its real work, charged as one forward and one backward
        layer-shard; returns the mean per pass, comparable with `reference_s`.
        """
        total = 0.0
        kinds: tuple[Kind, ...] = ("forward", "backward")
        for kind in kinds:
            started = time.perf_counter()
            _tiny_matmul()
            total += self.compute(kind, 1, started)
        return total / 2

    def stats(self) -> dict[str, float]:
        """Emulation accuracy so far: calls, overruns, their seconds, wait lateness."""
        st = self._stats
        return {
            "calls": st.calls,
            "overruns": st.overruns,
            "overrun_seconds": st.overrun_seconds,
            "late_seconds": st.late_seconds,
            "charged_seconds": st.charged_seconds,
            "factor": self._factor,
            "link_seconds": self._link_seconds,
        }


def _tiny_matmul(n: int = 12) -> float:
    """A few thousand multiply-adds in pure Python: real work without importing torch."""
    a = [[(i * n + j) % 7 / 7.0 for j in range(n)] for i in range(n)]
    s = 0.0
    for row in a:
        for j in range(n):
            s += sum(row[k] * a[k][j] for k in range(n))
    return s


class InjectionQueue:
    """Injections received by the coordinator's HTTP thread, held for the next step boundary.

    `POST /inject` reaches one process, but the target rank's clock lives in another: the
    coordinator `put()`s here (pass `queue.put` as ControlServer's `inject`), `drain()`s at the
    step boundary and broadcasts the result with the plan; each rank then calls
    `clock.inject(f)` for its own entry. A later inject for a rank replaces an earlier one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, float] = {}

    def put(self, rank: int, factor: float) -> None:
        f = _check_factor(factor)
        with self._lock:
            self._pending[int(rank)] = f

    def drain(self) -> dict[int, float]:
        with self._lock:
            out, self._pending = self._pending, {}
        return out


def clock_from_profile(
    name: str,
    rank: int,
    schedule: Sequence[SlowdownEvent] = (),
    tp: int = 1,
    *,
    scale: float = 1.0,
    links: Sequence[tuple[int, int, float]] = (),
) -> EmulatedClock:
    """An EmulatedClock with a named profile's base times, multiplied by `scale` (stretch the
    times when the real math of a CPU run would otherwise overrun them)."""
    try:
        fwd, bwd = GPU_PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown emulation profile {name!r}; known: {', '.join(sorted(GPU_PROFILES))}"
        ) from None
    return EmulatedClock(rank, fwd * scale, bwd * scale, schedule, tp, links)
