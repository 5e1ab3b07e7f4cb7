"""Straggling rates (DESIGN §4.4): a rank's compute time per unit of work over a healthy reference.

A unit is one logical layer-shard for one micro-batch in one pass: a forward of a stage with
`l` layers on a GPU holding `2^k` shards records `l * 2^k` units, and so does its backward. Only
compute is timed, never waits on communication, so a rank stalled by a slow peer still reports
its own speed; group size cancels out (2^k shards take 2^k times as long), so ranks are
comparable whatever plan they serve, and the rate feeds the planner directly (1.0 = healthy).

Calibration (`CostSample`, `reduce_calibration`): besides layer compute, every rank measures in
a few steps after the start and after each switch what the rest of a step costs it (TP
collectives per layer call, embedding and head per micro-batch, pipeline transfers, gradient sync
per byte inside and across nodes, the optimizer per byte held, and the rest of the step); after
one exchange every rank reduces the job's samples to the cost model's `calibration` terms, in
layer-time units, and to a link rate per node (its collectives over the healthy figure for the
same group size). Waiting on a slower peer is not counted: a group's TP figure is its layer
calls' wall time less its slowest member's compute, a transfer's the shortest call.

Torch-free. On real GPUs the caller must synchronise the device before reading the clock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

__all__ = [
    "MIB",
    "CostSample",
    "RateProfiler",
    "healthy_reference",
    "median_calibration",
    "reduce_calibration",
    "time_per_unit",
]

MIB = float(1 << 20)


def healthy_reference(per_rank_seconds_per_unit: Sequence[float | None]) -> float:
    """A healthy GPU's seconds per unit, from every rank's measurement (after an all_gather).

    The median of the fastest half: stragglers only ever make a GPU slower, and they are a
    minority, so the fastest half is healthy and its median ignores one lucky fast outlier as
    well as every slow one. A plain median would drift upwards as soon as stragglers approach
    half the ranks; the minimum would turn one noisy fast measurement into a false reference.
    Missing (None), non-finite and non-positive entries are ignored.
    """
    xs = sorted(
        float(x) for x in per_rank_seconds_per_unit if x is not None and math.isfinite(x) and x > 0
    )
    if not xs:
        raise ValueError("healthy_reference: no rank reported a positive, finite time per unit")
    return statistics.median(xs[: (len(xs) + 1) // 2])


def time_per_unit(fn: Callable[[], object], units: int, repeats: int = 3) -> float:
    """Seconds per unit of `fn` (which does `units` units of work), best of `repeats`.

    The self-benchmark of an excluded rank on a real GPU: `fn` must run a representative
    layer-shard and synchronise the device. The best run filters out one-off interference.
    """
    if units < 1 or repeats < 1:
        raise ValueError("time_per_unit: units and repeats must be >= 1")
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / units


class RateProfiler:
    """Accumulates one rank's timed computes per step and turns them into a straggling rate.

    `reference_s`: healthy seconds per unit. Known up front under emulation
    (`EmulatedClock.reference_s`); on real GPUs pass None and `calibrate()` once, after a few
    warm-up steps, with `healthy_reference()` of all ranks' `seconds_per_unit`. The reference
    then stays fixed: re-calibrating every step would follow a job that slows down as a whole,
    and a rate must compare against healthy hardware, not against today's average.
    `window`: steps averaged by `rate` and `seconds_per_unit` (smooths noise; 1 = last step).
    Rates are clamped to >= 1.0: a GPU faster than the reference is healthy, and the planner's
    contract takes rates >= 1.0.
    """

    def __init__(self, reference_s: float | None, window: int = 1) -> None:
        if window < 1:
            raise ValueError(f"window: {window}; need at least 1 step")
        self._reference: float | None = None
        if reference_s is not None:
            self.calibrate(reference_s)
        self._units = 0
        self._seconds = 0.0
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._last_seconds = 0.0
        self._last_rate: float | None = None

    @property
    def reference_s(self) -> float | None:
        return self._reference

    def calibrate(self, reference_s: float) -> None:
        """Fix the healthy reference (seconds per unit)."""
        if not (math.isfinite(reference_s) and reference_s > 0):
            raise ValueError(f"reference_s: {reference_s}; need a finite number > 0")
        self._reference = float(reference_s)

    def record(self, units: int, seconds: float) -> None:
        """One timed compute: `units` layer-shards x micro-batches, `seconds` of pure compute."""
        if units < 0 or not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"record({units}, {seconds}): need units >= 0 and seconds >= 0")
        self._units += units
        self._seconds += seconds

    def end_step(self) -> float | None:
        """Close the step; return its rate (None if nothing was recorded or not calibrated)."""
        self._last_seconds = self._seconds
        rate = None
        if self._units:
            self._steps.append((self._units, self._seconds))
            rate = self._rate(self._seconds / self._units)
        self._units, self._seconds = 0, 0.0
        self._last_rate = rate
        return rate

    def _rate(self, spu: float | None) -> float | None:
        if spu is None or self._reference is None:
            return None
        return max(1.0, spu / self._reference)

    @property
    def seconds_per_unit(self) -> float | None:
        """Mean seconds per unit over the window (None before any step with work)."""
        units = sum(u for u, _ in self._steps)
        return sum(s for _, s in self._steps) / units if units else None

    @property
    def rate(self) -> float | None:
        """Straggling rate over the window (None before calibration or any work)."""
        return self._rate(self.seconds_per_unit)

    @property
    def last_rate(self) -> float | None:
        """The rate `end_step()` returned last (this step alone, not the window)."""
        return self._last_rate

    @property
    def compute_seconds(self) -> float:
        """Compute seconds of the last ended step (what `malleus_gpu_compute_seconds` shows)."""
        return self._last_seconds


@dataclass
class CostSample:
    """One rank's figures over a calibration window (sums over its steps unless said).

    Seconds are wall seconds; `tp_best` and `p2p_best` are the shortest single call (0 when
    none). `group`: the rank's TP group size (0: excluded). `run_s`: its 1F1B schedule;
    `end_s`: when the schedule ended, from the step's start.
    """

    steps: int = 0
    step_s: float = 0.0
    units: int = 0
    compute_s: float = 0.0
    calls: int = 0
    tp_s: float = 0.0
    tp_best: float = 0.0
    group: int = 0
    emb_s: float = 0.0
    emb_mb: int = 0
    head_s: float = 0.0
    head_mb: int = 0
    p2p_best: float = 0.0
    p2p_calls: int = 0
    grad_intra_s: float = 0.0
    grad_intra_bytes: float = 0.0
    grad_inter_s: float = 0.0
    grad_inter_bytes: float = 0.0
    opt_s: float = 0.0
    opt_bytes: float = 0.0
    run_s: float = 0.0
    end_s: float = 0.0

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))

    def values(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def of(cls, values: Sequence[float]) -> CostSample:
        kinds = [f.type for f in fields(cls)]
        return cls(
            *(int(v) if k == "int" else float(v) for v, k in zip(values, kinds, strict=True))
        )

    def add(self, other: CostSample) -> None:
        """Fold another step in: sums add, shortest calls take the minimum."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("tp_best", "p2p_best"):
                v = min(x for x in (a, b) if x > 0) if a > 0 or b > 0 else 0.0
            elif f.name == "group":
                v = b
            else:
                v = a + b
            setattr(self, f.name, v)


def _healthy(xs: Iterable[float]) -> float | None:
    values = [x for x in xs if math.isfinite(x) and x > 0]
    return healthy_reference(values) if values else None


def reduce_calibration(
    samples: Sequence[CostSample],
    pipelines: Sequence[Sequence[Sequence[int]]],
    gpus_per_node: int,
    unit_s: float | None = None,
) -> tuple[dict[str, Any] | None, dict[int, float]]:
    """The job's `calibration` terms (layer-time units) and per-node link rates.

    `samples[r]`: rank r's window. `pipelines`: the plan in force, each pipeline's stages' TP
    groups in order. `unit_s`: seconds of one layer-time unit (one layer, forward + backward,
    one micro-batch, a healthy full group: twice the profiler's reference); None: from the
    samples' layer compute. None for the calibration when nothing ran.

    The terms are a healthy link's: a figure measured across a slow link is divided by that
    link's rate (the cost model multiplies it back where a group touches the node).
    """
    if unit_s is None:
        per_unit = [s.compute_s / s.units for s in samples if s.units]
        if not per_unit:
            return None, {}
        unit_s = 2 * healthy_reference(per_unit)
    L, gpn = unit_s, gpus_per_node
    stages = [(tuple(g), j == 0, j == len(p) - 1) for p in pipelines for j, g in enumerate(p)]

    def fastest(ranks: Sequence[int], value: Callable[[CostSample], float | None]) -> float | None:
        xs = [v for r in ranks if (v := value(samples[r])) is not None and v > 0]
        return min(xs) if xs else None

    best: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for ranks, _, _ in stages:
        if len(ranks) > 1 and (b := fastest(ranks, lambda s: s.tp_best)) is not None:
            best.setdefault(len(ranks), []).append((ranks, b))
    links = link_rates(samples, best, gpn)

    def link(ranks: Iterable[int]) -> float:
        return max((links.get(r // gpn, 1.0) for r in ranks), default=1.0)

    def group_tp(ranks: Sequence[int]) -> float | None:
        """The group's layer calls' wall time (its slowest member's) less its slowest member's
        compute, per layer and micro-batch: the TP collectives' cost to the group's pace. A
        member faster than its peers waits in them, which is not counted; equal members' wake-up
        jitter, which the group does pay, is."""
        xs = [samples[r] for r in ranks if samples[r].calls]
        if not xs:
            return None
        calls = max(s.calls for s in xs)
        wall = max(s.compute_s + s.tp_s for s in xs)
        return 2 * max(0.0, wall - max(s.compute_s for s in xs)) / calls

    tp_comm: dict[int, float] = {1: 0.0}
    by_size: dict[int, list[float]] = {}
    for ranks, _, _ in stages:
        if len(ranks) > 1 and (v := group_tp(ranks)) is not None and v > 0:
            by_size.setdefault(len(ranks), []).append(v / link(ranks))
    for g, vs in sorted(by_size.items()):
        if (h := _healthy(vs)) is not None:
            tp_comm[g] = h / L

    def end(first: bool, seconds: str, count: str) -> float:
        def per_mb(s: CostSample) -> float | None:
            n = getattr(s, count)
            return getattr(s, seconds) / n if n else None

        vs = [
            v
            for ranks, f, la in stages
            if (f if first else la) and (v := fastest(ranks, per_mb)) is not None
        ]
        h = _healthy(vs)
        return h / L if h is not None else 0.0

    neighbours: dict[int, set[int]] = {}  # rank -> ranks of its stage and the adjacent ones
    for p in pipelines:
        for j, g in enumerate(p):
            near = {r for k in (j - 1, j, j + 1) if 0 <= k < len(p) for r in p[k]}
            for r in g:
                neighbours[r] = near
    p2p = _healthy(
        2 * s.p2p_best / link(neighbours.get(r, ())) for r, s in enumerate(samples) if s.p2p_calls
    )
    ran = [r for r, s in enumerate(samples) if s.steps and s.run_s > 0]
    critical = max(ran, key=lambda r: samples[r].end_s) if ran else None
    serving = [r for p in pipelines for g in p for r in g]

    def per_mib(seconds: str, nbytes: str, slow: float) -> float:
        if critical is not None and getattr(samples[critical], nbytes) > 0:
            c = samples[critical]
            return getattr(c, seconds) / (getattr(c, nbytes) / MIB) / slow / L
        vs = [
            getattr(s, seconds) / (getattr(s, nbytes) / MIB)
            for s in samples
            if getattr(s, nbytes) > 0
        ]
        return min(vs) / slow / L if vs else 0.0

    optimizer = _healthy(s.opt_s / (s.opt_bytes / MIB) for s in samples if s.opt_bytes > 0)
    fixed = 0.0
    if critical is not None:
        c = samples[critical]
        rest = c.step_s - c.run_s - c.grad_intra_s - c.grad_inter_s - c.opt_s
        fixed = max(0.0, rest / c.steps) / L
    calibration: dict[str, Any] = {
        "layer_seconds": L,
        "embedding": end(True, "emb_s", "emb_mb"),
        "head": end(False, "head_s", "head_mb"),
        "tp_comm": tp_comm,
        "p2p": p2p / L if p2p is not None else 0.0,
        "grad_sync_intra": per_mib(
            "grad_intra_s", "grad_intra_bytes", link([critical] if critical is not None else [])
        ),
        "grad_sync_inter": per_mib("grad_inter_s", "grad_inter_bytes", link(serving)),
        "optimizer": optimizer / L if optimizer is not None else 0.0,
        "fixed": fixed,
    }
    return calibration, links


def link_rates(
    samples: Sequence[CostSample],
    tp_best: Mapping[int, Sequence[tuple[tuple[int, ...], float]]],
    gpus_per_node: int,
) -> dict[int, float]:
    """Per node, its collectives' time over the healthy figure of the same kind (>= 1.0).

    A node's TP groups (their shortest call, over the healthy groups' of that size) speak for
    its links; a node without one is judged by its ranks' shortest pipeline transfers. A node
    with no evidence is healthy.
    """
    nodes = (len(samples) + gpus_per_node - 1) // gpus_per_node
    ratios: dict[int, list[float]] = {}
    for vs in tp_best.values():
        h = _healthy(v for _, v in vs)
        if h is None:
            continue
        for ranks, v in vs:
            ratios.setdefault(ranks[0] // gpus_per_node, []).append(v / h)
    p2p = _healthy(s.p2p_best for s in samples if s.p2p_calls)
    out: dict[int, float] = {}
    for n in range(nodes):
        rs = ratios.get(n)
        if not rs and p2p is not None:
            mine = samples[n * gpus_per_node : (n + 1) * gpus_per_node]
            rs = [s.p2p_best / p2p for s in mine if s.p2p_calls and s.p2p_best > 0]
        out[n] = max(1.0, statistics.median(rs)) if rs else 1.0
    return out


def median_calibration(
    per_step: Sequence[tuple[dict[str, Any] | None, dict[int, float]]],
) -> tuple[dict[str, Any] | None, dict[int, float]]:
    """Each term's (and each node's link rate's) median over the steps' reductions."""
    cals = [c for c, _ in per_step if c is not None]
    nodes = sorted({n for _, links in per_step for n in links})
    links = {n: statistics.median(lk[n] for _, lk in per_step if n in lk) for n in nodes}
    if not cals:
        return None, links
    out: dict[str, Any] = {}
    for term, value in cals[0].items():
        if isinstance(value, dict):
            sizes = sorted({g for c in cals for g in c[term]})
            out[term] = {
                g: statistics.median(c[term][g] for c in cals if g in c[term]) for g in sizes
            }
        else:
            out[term] = statistics.median(c[term] for c in cals)
    return out, links
