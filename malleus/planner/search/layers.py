"""One pipeline, solved: stage order under memory, and the layer split.

Stage j costs c_j = y_j * l_j + e_j per micro-batch: its pace times its layers, plus its
position's extras (calibrated: the embedding on the first stage, the head on the last, the
activation transfer to the next; `cost.position_extras`). The layer split minimises the 1F1B
bound (m-1) * max c + sum c, which is the exact time when the bottleneck is the last stage and
an upper bound otherwise: a greedy fill gives the least bottleneck b* (the min-bottleneck
solution), trimming the slowest stages gives the least fill/drain sum at b*, and a walk over the
next breakpoints b > b* trades a slightly larger bottleneck for a smaller sum when few
micro-batches make the bubble term matter. The solved pipeline is then timed exactly
(`cost.pipeline_time`, the 1F1B makespan). The order is chosen for memory room (stage j keeps
min(S-j, m) micro-batches of activations in flight and the ends hold the embedding and head)
and, when extras make positions differ, for the bound too.

The split itself (given an order and per-position caps) lives in layersplit.py, pure numbers;
this module holds the pipeline vocabulary (classes `Cls`, `PipeSolution`), the memory caps, the
stage order, and `solve_pipeline`, which ties them together.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..memory import stage_memory_mb
from ..pace import position_extras
from ..problem import PlanningProblem
from ..schedule import pipeline_time, pipeline_time_lower, pipeline_time_upto
from .layersplit import exact_micro_batches, fill_at, min_bottleneck, polish_split, split_layers

__all__ = [
    "CapsFn",
    "PipeSolution",
    "best_order",
    "layer_caps",
    "order_stages",
    "solve_pipeline",
]

Cls = tuple[float, ...]  # (y, k) or (y, k, link): pace, shard exponent, node link rate (if > 1)
CapsFn = Callable[[tuple[int, ...], "int | None"], list[int]]  # (ks, m) -> caps


def link_of(c: Cls) -> float:
    """Link rate of a class's node (1.0 unless the class says otherwise)."""
    return float(c[2]) if len(c) > 2 else 1.0


def order_extras(problem: PlanningProblem, order: Sequence[Cls]) -> list[float]:
    """Each position's extra cost per micro-batch (`cost.position_extras`) for a stage order."""
    if problem.calibration is None:
        return [0.0] * len(order)
    sizes = [problem.tp >> int(c[1]) for c in order]
    return position_extras(problem, [c[0] for c in order], [link_of(c) for c in order], sizes)


@dataclass(frozen=True)
class PipeSolution:
    """A solved pipeline: stage classes in order, layers per stage, bottleneck and fill sum
    (the 1F1B bound's line: (m-1) * bottleneck + fill >= time(m)), and the stage costs."""

    order: tuple[Cls, ...]
    layers: tuple[int, ...]
    bottleneck: float
    fill: float
    costs: tuple[float, ...] = ()

    def time(self, micro_batches: int) -> float:
        """1F1B time with this many micro-batches: exact up to `exact_micro_batches(S)`, then
        growing by the bottleneck (an upper bound; `cost.pipeline_time_upto`)."""
        if not self.costs:
            return (micro_batches - 1) * self.bottleneck + self.fill
        return pipeline_time_upto(micro_batches, self.costs, exact_micro_batches(len(self.costs)))


def layer_caps(problem: PlanningProblem, ks: Sequence[int], m: int | None) -> list[int]:
    """Most layers each position can hold under the memory bound (m None = at least S)."""
    L, S = problem.layers, len(ks)
    mem = problem.memory
    if mem is None:
        return [L] * S
    out = []
    for j, k in enumerate(ks):
        shards = 1 << k
        in_flight = S - j if m is None else min(S - j, m)
        ends = mem.embedding_mb * (int(j == 0) + int(j == S - 1))
        per_layer = mem.layer_mb + mem.activation_mb * in_flight
        room = (mem.capacity_mb - mem.fixed_mb) / shards - ends
        if per_layer <= 0:
            cap = L if room >= -1e-9 else 0
        else:
            cap = max(0, min(L, math.floor(room / per_layer + 1e-9)))
        mm = S if m is None else m
        while cap > 0 and stage_memory_mb(problem, shards, cap, S, j, mm) > mem.capacity_mb + 1e-9:
            cap -= 1
        out.append(cap)
    return out


def order_stages(
    problem: PlanningProblem, classes: Sequence[Cls], m: int | None, caps_fn: CapsFn | None = None
) -> list[Cls]:
    """Stage order for memory room: heavy per-GPU loads go where the most layers fit.

    Loads are estimated from the unconstrained balanced split (layers ~ 1/y, memory per GPU ~
    2^k * layers); each class, heaviest first, takes the free position where it fits most.
    Without a memory bound the order does not matter; keep the slow groups first.
    """
    S = len(classes)
    items = sorted(classes, key=lambda c: (-c[0], c[1]))
    if problem.memory is None or S == 1:
        return items
    b0 = problem.layers / sum(1.0 / c[0] for c in classes)
    loads = sorted(items, key=lambda c: -(1 << c[1]) * b0 / c[0])
    get_caps = caps_fn or (lambda ks, mm: layer_caps(problem, ks, mm))
    caps_by_k = {k: get_caps((k,) * S, m) for k in {c[1] for c in classes}}
    free = list(range(S))
    slots: list[Cls | None] = [None] * S
    for c in loads:
        caps = caps_by_k[c[1]]
        pos = max(free, key=lambda p: (caps[p], p))
        free.remove(pos)
        slots[pos] = c
    return [c for c in slots if c is not None]


def _distinct_orders(classes: Sequence[Cls], limit: int) -> list[tuple[Cls, ...]] | None:
    """Every distinct order of a multiset, or None when there are more than `limit`."""
    counts = Counter(classes)
    total = math.factorial(len(classes))
    for n in counts.values():
        total //= math.factorial(n)
    if total > limit:
        return None
    out: list[tuple[Cls, ...]] = []

    def rec(prefix: list[Cls]) -> None:
        if len(prefix) == len(classes):
            out.append(tuple(prefix))
            return
        for c in sorted(counts):
            if counts[c]:
                counts[c] -= 1
                prefix.append(c)
                rec(prefix)
                prefix.pop()
                counts[c] += 1

    rec([])
    return out


def best_order(
    problem: PlanningProblem,
    classes: Sequence[Cls],
    m: int | None,
    caps_fn: CapsFn | None = None,
    quick: bool = False,
) -> tuple[Cls, ...] | None:
    """Stage order with the most memory room: the order whose layer split (under its memory
    caps) has the least bottleneck, then the least exact 1F1B time at m micro-batches (beyond
    2S+2 or None: at 2S+2), then the least fill sum.

    Small pipelines try every distinct order; larger ones start from the load heuristic and
    its variants and improve by swapping two positions. None if no order holds the model.
    `quick`: a pipeline of more than 4 stages takes the load heuristic's order as it is (a
    tenth of the cost, a few hundredths of a per cent slower on the median pipeline, up to a
    few per cent on some); a caller whose split then fails asks again without `quick`.
    """
    L = problem.layers
    if len(classes) > L or not classes:
        return None
    if len(set(classes)) == 1 or (
        problem.memory is None
        and problem.calibration is None
        and _distinct_orders(classes, 24) is None
    ):
        return tuple(order_stages(problem, classes, m, caps_fn))
    get_caps = caps_fn or (lambda ks, mm: layer_caps(problem, ks, mm))
    S = len(classes)
    room = {k: max(get_caps((k,) * S, m)) for k in {c[1] for c in classes}}
    if sum(room[c[1]] for c in classes) < L:
        return None  # even the roomiest position for every group cannot hold the model

    # Few micro-batches: the exact 1F1B time at m, of each order's own best split, decides
    # (a bottleneck early hides the later stages, and at m = 2 that outweighs a slightly
    # larger bottleneck: GPU 0 alone before its 2x partner beats the reverse by 13%).
    few = m is not None and m <= exact_micro_batches(S)
    mm = m if few and m is not None else exact_micro_batches(S)

    Scored = tuple[int, float, float, tuple[float, ...]]

    def score(order: Sequence[Cls]) -> Scored:
        """(infeasible, bottleneck, fill sum, stage costs) of the order's bound split (with
        few micro-batches, of its best split at m)."""
        caps = get_caps(tuple(c[1] for c in order), m)
        ys = [c[0] for c in order]
        es = order_extras(problem, order)
        first = min_bottleneck(ys, caps, L, es)
        if first is None:  # rank infeasible orders by how far they are from holding the model
            return (1, float(L - sum(caps) + L * sum(1 for c in caps if c < 1)), 0.0, ())
        b = max(y * n + e for y, n, e in zip(ys, first, es, strict=True))
        ls = fill_at(ys, caps, L, b, es) or first
        if few:
            res = split_layers(ys, caps, L, m, es)
            ls = polish_split(ys, es, caps, res[0], m) if res is not None else ls
        costs = tuple(y * n + e for y, n, e in zip(ys, ls, es, strict=True))
        return (0, max(costs), sum(costs), costs)

    def better(x: Scored, y: Scored) -> bool:
        """x before y: feasible, then less bottleneck; at an equal bottleneck, less exact
        1F1B time at mm (an early bottleneck hides the later stages), then less fill. With
        few micro-batches, less exact 1F1B time at m first."""
        if x[0] != y[0]:
            return x[0] < y[0]
        if few and not x[0]:
            tx, ty = pipeline_time(mm, x[3]), pipeline_time(mm, y[3])
            if abs(tx - ty) > 1e-12 * max(1.0, ty):
                return tx < ty
        if abs(x[1] - y[1]) > 1e-12 * max(1.0, y[1]):
            return x[1] < y[1]
        if x[0]:
            return False
        ty = pipeline_time(mm, y[3])
        if pipeline_time_lower(mm, x[3]) > ty * (1 + 1e-12):
            return False
        tx = pipeline_time(mm, x[3])
        if abs(tx - ty) > 1e-12 * max(1.0, ty):
            return tx < ty
        return x[2] < y[2] - 1e-12

    if quick and S > 4:  # the caller solves it, and asks again without `quick` if it fails
        return tuple(order_stages(problem, classes, m, get_caps))
    starts = _distinct_orders(classes, 24)
    exhaustive = starts is not None
    if starts is None:
        base = order_stages(problem, classes, m, get_caps)
        light_first = sorted(classes, key=lambda c: ((1 << c[1]) / c[0], c[1]))
        starts = [tuple(base), tuple(light_first), tuple(reversed(light_first))]
    best_score, order = score(starts[0]), list(starts[0])
    for o in starts[1:]:
        sc = score(o)
        if better(sc, best_score):
            best_score, order = sc, list(o)
    # Positions rank alike for every shard count, so the load heuristic is nearly right: a pass
    # of neighbour swaps polishes it (two when no order fits yet).
    passes = 0 if exhaustive else (2 if best_score[0] else 1)
    while passes > 0:
        passes -= 1
        improved = False
        for i in range(len(order) - 1):
            if order[i] == order[i + 1]:
                continue
            cand = list(order)
            cand[i], cand[i + 1] = cand[i + 1], cand[i]
            sc = score(cand)
            if better(sc, best_score):
                best_score, order, improved = sc, cand, True
        if not improved:
            break
    return tuple(order) if best_score[0] == 0 else None


def solve_pipeline(
    problem: PlanningProblem,
    classes: Sequence[Cls],
    m: int | None,
    order: Sequence[Cls] | None = None,
    caps_fn: CapsFn | None = None,
) -> PipeSolution | None:
    """Best layer split of one pipeline for m micro-batches (None = many) in a given order."""
    if order is None:
        order = best_order(problem, classes, m, caps_fn)
        if order is None:
            return None
    ks = tuple(c[1] for c in order)
    caps = caps_fn(ks, m) if caps_fn else layer_caps(problem, ks, m)
    es = order_extras(problem, order)
    ys = [c[0] for c in order]
    res = split_layers(ys, caps, problem.layers, m, es)
    if res is None:
        return None
    ls = polish_split(ys, es, caps, res[0], m)
    costs = tuple(y * n + e for y, n, e in zip(ys, ls, es, strict=True))
    return PipeSolution(tuple(order), tuple(ls), max(costs), sum(costs), costs)
