"""The 1F1B schedule's makespan (docs/architecture.md, "Cost model"): a pipeline's time from its stage costs.

Kept apart from the rest of the cost model because it is pure arithmetic on a tuple of stage
costs (no problem, no plan): the search calls `pipeline_time` and its cheap bounds
(`pipeline_time_lower`, `pipeline_time_upto`) in its inner loop, and tests/planner/sim1f1b.py
checks it against a discrete-event simulation. The dependency graph of S stages and m
micro-batches is built once per (S, m) and cached; makespans are cached per cost tuple.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache

__all__ = [
    "EXACT_MICRO_BATCHES",
    "INF",
    "pipeline_time",
    "pipeline_time_lower",
    "pipeline_time_upto",
]

INF = math.inf
EXACT_MICRO_BATCHES = 1024
"""Up to this many micro-batches per pipeline the 1F1B makespan is computed exactly; beyond, it
grows by the bottleneck stage's cost per micro-batch (an upper bound, exact once the schedule is
periodic, which it is long before)."""


def _stage_ops(S: int, j: int, m: int) -> list[tuple[bool, int]]:
    """Stage j's 1F1B operations in order: (is_backward, micro-batch)."""
    w = min(S - 1 - j, m)
    ops = [(False, i) for i in range(w)]
    for i in range(m - w):
        ops += [(False, w + i), (True, i)]
    return ops + [(True, i) for i in range(m - w, m)]


def _topology(S: int, m: int) -> list[tuple[int, int, int]]:
    """`_build_topology`, cached for the search's small pipelines."""
    return _topology_small(S, m) if S * m <= 4096 else _build_topology(S, m)


@lru_cache(maxsize=4096)
def _topology_small(S: int, m: int) -> list[tuple[int, int, int]]:
    return _build_topology(S, m)


def _build_topology(S: int, m: int) -> list[tuple[int, int, int]]:
    """The 1F1B dependency graph of S stages and m micro-batches in a topological order.

    For the x-th operation: 1 + the order of its predecessor on its stage, 1 + that of its
    input's operation (the previous stage's forward, the next stage's backward, or for the last
    stage its own forward), 0 for none; and its kind (2 * stage + is_backward). Operation p of
    stage j is node j * 2m + p; the order is Kahn's.
    """
    n2 = 2 * m
    n = S * n2
    kind = [0] * n
    data = [-1] * n
    f_at = [[0] * m for _ in range(S)]
    b_at = [[0] * m for _ in range(S)]
    for j in range(S):
        for p, (back, i) in enumerate(_stage_ops(S, j, m)):
            v = j * n2 + p
            kind[v] = 2 * j + int(back)
            (b_at if back else f_at)[j][i] = v
    for j in range(S):
        for i in range(m):
            if j > 0:
                data[f_at[j][i]] = f_at[j - 1][i]
            data[b_at[j][i]] = f_at[j][i] if j == S - 1 else b_at[j + 1][i]
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for v in range(n):
        if v % n2:
            succ[v - 1].append(v)
            indeg[v] += 1
        if data[v] >= 0 and data[v] != v - 1:
            succ[data[v]].append(v)
            indeg[v] += 1
    order = [v for v in range(n) if indeg[v] == 0]
    for v in order:  # grows while it is walked: Kahn's algorithm
        for w in succ[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                order.append(w)
    assert len(order) == n, "the 1F1B schedule deadlocks"
    index = [0] * n
    for x, v in enumerate(order):
        index[v] = x + 1
    return [
        (index[v - 1] if v % n2 else 0, index[data[v]] if data[v] >= 0 else 0, kind[v])
        for v in order
    ]


def _one_f_one_b(costs: tuple[float, ...], m: int) -> float:
    """Exact makespan of the 1F1B schedule (trainer/parallel/pipeline.py).

    Stage j of S runs w_j = min(S-1-j, m) warm-up forwards, then alternates one forward and one
    backward, then drains w_j backwards; a forward costs c_j/3 and a backward 2c_j/3. Forward i
    of stage j waits for forward i of stage j-1, backward i for backward i of stage j+1 (the
    last stage: its own forward i). Every operation starts when its stage is free and its input
    has arrived, so the makespan is the longest path through the dependency graph: one pass in
    topological order (`_topology`), O(S * m).
    """
    dur: list[float] = []
    for c in costs:
        dur += [c / 3.0, c - c / 3.0]
    end = [0.0]  # end[x]: when the (x-1)-th operation ends; end[0]: nothing before
    push = end.append
    for a, b, k in _topology(len(costs), m):
        x, y = end[a], end[b]
        push((x if x > y else y) + dur[k])
    return max(end)


@lru_cache(maxsize=1 << 16)
def _pipeline_time_cached(costs: tuple[float, ...], m: int) -> float:
    b = max(costs)
    if m <= 1 or len(costs) == 1 or costs[-1] >= b:
        # one micro-batch: no overlap; the bottleneck last: nothing downstream of it to wait for
        return (m - 1) * b + sum(costs)
    if m > EXACT_MICRO_BATCHES:
        return _pipeline_time_cached(costs, EXACT_MICRO_BATCHES) + (m - EXACT_MICRO_BATCHES) * b
    return _one_f_one_b(costs, m)


def pipeline_time_lower(micro_batches: int, costs: Sequence[float]) -> float:
    """A lower bound of the 1F1B makespan in O(S): for every stage k, the path that brings
    micro-batch 0 forward to k, runs all of k's work, and takes the last backward back to
    stage 0: sum_{j<k} c_j + m * c_k. (Exact when the bottleneck is the last stage.)"""
    best = prefix = 0.0
    for c in costs:
        best = max(best, prefix + micro_batches * c)
        prefix += c
    return best


def pipeline_time_upto(micro_batches: int, costs: tuple[float, ...], exact: int) -> float:
    """`pipeline_time`, exact up to `exact` micro-batches and beyond that growing by the
    bottleneck per micro-batch: an upper bound (the makespan never grows faster), for the
    search's inner loop, where the bubble's shape matters only when micro-batches are few."""
    if micro_batches <= exact:
        return pipeline_time(micro_batches, costs)
    return pipeline_time(exact, costs) + (micro_batches - exact) * max(costs)


def pipeline_time(micro_batches: int, stage_costs: Iterable[float]) -> float:
    """1F1B step time of one pipeline: its exact makespan (`_one_f_one_b`).

    It never exceeds (m - 1) * bottleneck + sum of stages, and equals it when the bottleneck is
    the last stage (or m = 1); when the bottleneck sits earlier, later stages overlap the
    bottleneck's backward passes and the fill/drain sum over-counts.
    """
    costs = stage_costs if type(stage_costs) is tuple else tuple(stage_costs)
    if not costs:
        return INF
    b = max(costs)
    if not math.isfinite(b):
        return INF  # costs are >= 0: an unusable group (inf) is the largest
    m = int(micro_batches)
    if m < 1:
        return 0.0
    if m == 1 or len(costs) == 1 or costs[-1] >= b:
        # one micro-batch: no overlap; the bottleneck last: nothing downstream of it to wait for
        return (m - 1) * b + sum(costs)
    return _pipeline_time_cached(costs, m)
