"""Exact scoring of an abstract layout: pipelines as multisets of group classes, with counts.

A layout never names ranks: groups of equal (y, k) are interchangeable for the cost model, so a
pipeline is a sorted tuple of classes and identical pipelines are one entry with a count. Every
solved pipeline is cached for the whole plan() call, so the search pays for each distinct
pipeline once however many layouts contain it.

A calibrated problem adds the step's tail to every layout's time (`Evaluator.tail`): the fixed
part, the optimizer (the largest per-GPU master-parameter share) and the gradient sync (that
share again, at the inter-node figure when the cluster has several nodes, times the link rate of
the class's node), since classes do not name their GPUs' replicas. The exact figure of a plan
with ranks is `cost.step_time_terms`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ..memory import unit_mb
from ..problem import PlanningProblem
from .layers import Cls, PipeSolution, best_order, layer_caps, link_of, solve_pipeline
from .layersplit import LineFloor, exact_micro_batches, line_floor
from .microbatch import ClassSplit, greedy_split, split_linear

__all__ = ["Evaluator", "Layout", "PipeKey", "Scored", "merge"]

PipeKey = tuple[Cls, ...]
Layout = tuple[tuple[PipeKey, int], ...]  # (pipeline key, how many such pipelines)


def merge(pipes: Iterable[tuple[PipeKey, int]]) -> Layout:
    """Canonical layout: keys sorted, identical pipelines merged into one count."""
    c: Counter[PipeKey] = Counter()
    for key, n in pipes:
        if n > 0:
            c[tuple(sorted(key))] += n
    return tuple(sorted(c.items()))


@dataclass(frozen=True)
class Scored:
    """A layout with its step time and, per class, the micro-batch levels (m, n at m+1)."""

    time: float
    layout: Layout
    splits: tuple[ClassSplit, ...]
    refined: bool  # per-m pipeline solutions (else the any-m ones)
    tail: float = 0.0  # calibrated gradient sync + optimizer + fixed, included in `time`

    @property
    def dp(self) -> int:
        return sum(n for _, n in self.layout)


class Evaluator:
    """Caches solved pipelines; scores layouts exactly under the cost model."""

    def __init__(self, problem: PlanningProblem, quick_orders: bool = False) -> None:
        self.problem = problem
        # stage orders by the load heuristic alone where it fits (layers.best_order `quick`):
        # for searches over thousands of distinct pipelines; the winners are re-solved in full
        self.quick_orders = quick_orders
        self._cache: dict[tuple[PipeKey, int | None], PipeSolution | None] = {}
        self._caps: dict[tuple[int, int | None], list[list[int]]] = {}
        self._orders: dict[tuple[PipeKey, int | None], tuple[Cls, ...] | None] = {}
        self._floors: dict[PipeKey, LineFloor | None] = {}
        self.evaluations = 0

    def caps(self, ks: tuple[int, ...], m: int | None) -> list[int]:
        """Memory caps per position, cached (many orders share a shard pattern)."""
        S = len(ks)
        table = self._caps.get((S, m))
        if table is None:  # the cap of position j depends only on (k, j, S, m)
            kmax = self.problem.tp.bit_length()
            table = self._caps[(S, m)] = [layer_caps(self.problem, [k] * S, m) for k in range(kmax)]
        return [table[k][j] for j, k in enumerate(ks)]

    def pipe(self, key: PipeKey, m: int | None = None) -> PipeSolution | None:
        """Solved pipeline for m micro-batches (None: any m, conservative memory)."""
        if m is not None and m >= 4 * len(key) + 4:
            m = None  # the bubble trade and in-flight memory no longer change with m
        ck = (key, m)
        if ck not in self._cache:
            # memory sees m only through min(S - j, m): one order serves every m >= S, except
            # that with few micro-batches the exact 1F1B time depends on where the bottleneck
            # is (layers.best_order ranks by it up to exact_micro_batches)
            mc = m if m is not None and m <= exact_micro_batches(len(key)) else None
            ok = (key, mc)
            if ok not in self._orders:
                self._orders[ok] = best_order(self.problem, key, mc, self.caps, self.quick_orders)
            order = self._orders[ok]
            sol = None if order is None else solve_pipeline(self.problem, key, m, order, self.caps)
            if sol is None and order is not None and self.quick_orders:
                # the quick order does not hold the model: search for one that does
                order = self._orders[ok] = best_order(self.problem, key, mc, self.caps)
                sol = (
                    None
                    if order is None
                    else solve_pipeline(self.problem, key, m, order, self.caps)
                )
            self._cache[ck] = sol
        return self._cache[ck]

    def solved(self, key: PipeKey) -> bool:
        """Whether `pipe(key)` (any m) is already cached."""
        return (key, None) in self._cache

    def floor(self, key: PipeKey) -> LineFloor | None:
        """Lower bounds of `pipe(key)`'s (bottleneck, fill) without solving it
        (layersplit.line_floor; None when no split exists)."""
        if key not in self._floors:
            self._floors[key] = line_floor([c[0] for c in key], self.problem.layers)
        return self._floors[key]

    def floor_bound(self, layout: Layout) -> float:
        """A lower bound on `score(layout)`'s time, refined or not, from the pipelines' floors
        alone (no stage order searched, nothing solved; inf: the layout cannot run).

        A pipeline's 1F1B makespan at m micro-batches is at least m * c (its slowest stage
        runs every forward and backward) and at least the sum of its stages (one micro-batch
        passes through all of them); its floor (`LineFloor`) bounds c by the uncapped least
        bottleneck and the sum by the least sum. So the layout takes at least its pipelines'
        largest least sum, and at least the time by which lines m * c could take every
        micro-batch were micro-batches divisible: B / sum(n / c)."""
        inv = least = 0.0
        n_pipes = 0
        for key, n in layout:
            f = self.floor(key)
            if f is None:
                return float("inf")
            inv += n / f.bs[0]
            least = max(least, f.fmin)
            n_pipes += n
        B = self.problem.micro_batches
        return float("inf") if n_pipes > B else max(least, B / inv)

    def floor_estimate(self, layout: Layout) -> float:
        """The linear split (`split_linear`, whole micro-batches) of the pipelines' floor
        lines, (m - 1) * c + sum: what the layout would take if every pipeline met its floor
        and the 1F1B line (inf: it cannot run). Not a bound (the makespan is below the line
        when the bottleneck stage is not the last one), but close to the refined score where
        the lines are far from it (few micro-batches per pipeline, where the bubble decides):
        it orders which layouts are refined first (phases.py)."""
        lines = []
        for key, n in layout:
            f = self.floor(key)
            if f is None:
                return float("inf")
            lines.append((f.bs[0], f.fmin, n))
        res = split_linear(lines, self.problem.micro_batches)
        return float("inf") if res is None else res[0]

    def time_at(self, key: PipeKey, m: int) -> float:
        """Best time of this pipeline with m micro-batches (inf if it cannot hold the model)."""
        sols = [s for s in (self.pipe(key, None), self.pipe(key, m)) if s is not None]
        return min((s.time(m) for s in sols), default=float("inf"))

    def best_at(self, key: PipeKey, m: int) -> PipeSolution:
        sols = [s for s in (self.pipe(key, None), self.pipe(key, m)) if s is not None]
        return min(sols, key=lambda s: s.time(m))

    def tail(self, layout: Layout) -> float:
        """Calibrated step tail of a layout (module docstring); 0 without a calibration."""
        cal = self.problem.calibration
        if cal is None:
            return 0.0
        dp = sum(n for _, n in layout)
        sync = 0.0
        if dp >= 2:
            sync = cal.grad_sync_inter if self.problem.nodes > 1 else cal.grad_sync_intra
        if not (sync or cal.optimizer):
            return cal.fixed
        unit, emb = unit_mb(self.problem)
        held = synced = 0.0
        for key, _ in layout:
            sol = self.pipe(key) or self.pipe(key, 1)
            if sol is None:
                continue
            S = len(sol.order)
            for j, (c, n) in enumerate(zip(sol.order, sol.layers, strict=True)):
                mb = (1 << c[1]) * (n * unit + (int(j == 0) + int(j == S - 1)) * emb)
                held = max(held, mb)
                synced = max(synced, mb * link_of(c))
        return cal.fixed + cal.optimizer * held + sync * synced

    def score(self, layout: Layout, refine: bool = True) -> Scored | None:
        """Step time of a layout: linear micro-batch split, then exact per-m refinement."""
        sc = self._score(layout, refine)
        if sc is None or self.problem.calibration is None:
            return sc
        tail = self.tail(layout)
        return Scored(sc.time + tail, sc.layout, sc.splits, sc.refined, tail)

    def _score(self, layout: Layout, refine: bool) -> Scored | None:
        self.evaluations += 1
        B = self.problem.micro_batches
        keys = [k for k, _ in layout]
        counts = [n for _, n in layout]
        lines = []
        for key, n in layout:
            sol = self.pipe(key)
            if sol is None:
                break
            lines.append((sol.bottleneck, sol.fill, n))
        if len(lines) < len(layout):
            # some pipeline holds the model only with few micro-batches in flight: exact greedy
            # (worth it only when micro-batches are few per pipeline)
            if sum(counts) * 4 < B or any(self.pipe(k, 1) is None for k in keys):
                return None
            times = [lambda m, key=key: self.time_at(key, m) for key in keys]
            res = greedy_split(times, counts, B)
            if res is None or res[0] == float("inf"):
                return None
            return Scored(res[0], layout, tuple(res[1]), True)
        res = split_linear(lines, B)
        if res is None:
            return None
        T, splits = res
        if refine:
            T = max(
                self.time_at(key, m + (1 if up else 0))
                for key, (m, up) in zip(keys, splits, strict=True)
            )
            times = [lambda m, key=key: self.time_at(key, m) for key in keys]
            start = [max(1, m - 1) for m, _ in splits]
            res2 = greedy_split(times, counts, B, start)
            if res2 is not None and res2[0] < T - 1e-9:
                T, splits = res2
        return Scored(T, layout, tuple(splits), refine)

    def solutions(self, sc: Scored) -> list[tuple[PipeSolution, PipeSolution | None]]:
        """Per class, the solved pipeline at its level m and (if some run m+1) at m+1."""
        out = []
        for (key, _), (m, up) in zip(sc.layout, sc.splits, strict=True):
            if sc.refined:
                out.append((self.best_at(key, m), self.best_at(key, m + 1) if up else None))
            else:
                sol = self.pipe(key)
                assert sol is not None
                out.append((sol, sol if up else None))
        return out
