"""One pipeline, solved exactly: stage order under memory, and the layer split.

A pipeline's time does not depend on its stage order (T = (m-1) * max c + sum c); only the
memory bound does, because stage j keeps min(S-j, m) micro-batches of activations in flight and
the ends hold the embedding and head. So the order is chosen for memory room, then layers are
split by an exact in-process method: a greedy fill gives the least bottleneck b* (the
min-bottleneck solution), trimming the slowest stages gives the least fill/drain sum at b*, and
a walk over the next breakpoints b > b* trades a slightly larger bottleneck for a smaller sum
when few micro-batches make the bubble term matter.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cost import stage_memory_mb
from .problem import PlanningProblem

__all__ = [
    "CapsFn",
    "PipeSolution",
    "best_order",
    "layer_caps",
    "order_stages",
    "solve_pipeline",
    "split_layers",
]

Cls = tuple[float, int]  # (y, k): a group's pace and shard exponent
CapsFn = Callable[[tuple[int, ...], "int | None"], list[int]]  # (ks, m) -> caps


@dataclass(frozen=True)
class PipeSolution:
    """A solved pipeline: stage classes in order, layers per stage, bottleneck and fill sum."""

    order: tuple[Cls, ...]
    layers: tuple[int, ...]
    bottleneck: float
    fill: float

    def time(self, micro_batches: int) -> float:
        return (micro_batches - 1) * self.bottleneck + self.fill


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


def _min_bottleneck(ys: Sequence[float], caps: Sequence[int], L: int) -> list[int] | None:
    """Least max_j y_j*l_j with 1 <= l_j <= cap_j, sum l_j = L (greedy fill is exact)."""
    S = len(ys)
    if S > L or min(caps) < 1 or sum(caps) < L:
        return None
    b0 = L / sum(1.0 / y for y in ys)
    ls = [max(1, min(c, int(b0 / y))) for y, c in zip(ys, caps, strict=True)]
    if sum(ls) > L:
        ls = [1] * S
    heap = [(ys[j] * (ls[j] + 1), j) for j in range(S) if ls[j] < caps[j]]
    heapq.heapify(heap)
    left = L - sum(ls)
    while left > 0:
        _, j = heapq.heappop(heap)
        ls[j] += 1
        left -= 1
        if ls[j] < caps[j]:
            heapq.heappush(heap, (ys[j] * (ls[j] + 1), j))
    return ls


def _fill_at(ys: Sequence[float], caps: Sequence[int], L: int, b: float) -> list[int] | None:
    """Least-sum split with every stage cost <= b: fill to b, then trim the slowest stages."""
    ls = [min(c, int(b / y + 1e-9)) for y, c in zip(ys, caps, strict=True)]
    if min(ls) < 1 or sum(ls) < L:
        return None
    excess = sum(ls) - L
    for j in sorted(range(len(ys)), key=lambda j: -ys[j]):
        if excess == 0:
            break
        cut = min(excess, ls[j] - 1)
        ls[j] -= cut
        excess -= cut
    return ls


def split_layers(
    ys: Sequence[float], caps: Sequence[int], L: int, m: int | None
) -> tuple[list[int], float, float] | None:
    """Layers per stage minimising (m-1)*max c + sum c (m None: bottleneck, then sum)."""
    first = _min_bottleneck(ys, caps, L)
    if first is None:
        return None
    b_star = max(y * n for y, n in zip(ys, first, strict=True))
    ls = _fill_at(ys, caps, L, b_star) or first

    def cost(split: list[int]) -> tuple[float, float]:
        return max(y * n for y, n in zip(ys, split, strict=True)), sum(
            y * n for y, n in zip(ys, split, strict=True)
        )

    b, s = cost(ls)
    if m is None or len(set(ys)) == 1:
        return ls, b, s
    # Bubble trade: a larger bottleneck lets fast stages take layers from slow ones.
    floor_sum = _least_sum(ys, caps, L)
    best = ((m - 1) * b + s, ls, b, s)
    heap = [(y * (n + 1), j) for j, (y, n, c) in enumerate(zip(ys, ls, caps, strict=True)) if n < c]
    heapq.heapify(heap)
    seen = 0
    # few micro-batches: walk every breakpoint; many: the first few are all that can pay
    limit = 4 * L if m <= len(ys) else len(ys) + 2
    while heap and seen < limit:
        nb, j = heapq.heappop(heap)
        if (m - 1) * nb + floor_sum >= best[0] - 1e-12:
            break  # no larger bottleneck can pay for itself any more
        seen += 1
        split = _fill_at(ys, caps, L, nb)
        if split is not None:
            cb, cs = cost(split)
            if (m - 1) * cb + cs < best[0] - 1e-12:
                best = ((m - 1) * cb + cs, split, cb, cs)
        n_next = int(nb / ys[j] + 1e-9) + 1
        if n_next <= caps[j]:
            heapq.heappush(heap, (ys[j] * n_next, j))
    return best[1], best[2], best[3]


def _least_sum(ys: Sequence[float], caps: Sequence[int], L: int) -> float:
    """Lower bound on sum c: one layer everywhere, the rest on the fastest stages first."""
    total = sum(ys)
    left = L - len(ys)
    for j in sorted(range(len(ys)), key=lambda j: ys[j]):
        take = min(left, caps[j] - 1)
        total += take * ys[j]
        left -= take
        if left == 0:
            break
    return total


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
    b0 = problem.layers / sum(1.0 / y for y, _ in classes)
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
    problem: PlanningProblem, classes: Sequence[Cls], m: int | None, caps_fn: CapsFn | None = None
) -> tuple[Cls, ...] | None:
    """Stage order with the most memory room: least bottleneck, then least fill sum.

    Small pipelines try every distinct order; larger ones start from the load heuristic and
    its variants and improve by swapping two positions. None if no order holds the model.
    """
    L = problem.layers
    if len(classes) > L or not classes:
        return None
    if problem.memory is None or len(set(classes)) == 1:
        return tuple(order_stages(problem, classes, m, caps_fn))
    get_caps = caps_fn or (lambda ks, mm: layer_caps(problem, ks, mm))
    S = len(classes)
    room = {k: max(get_caps((k,) * S, m)) for k in {c[1] for c in classes}}
    if sum(room[c[1]] for c in classes) < L:
        return None  # even the roomiest position for every group cannot hold the model

    def score(order: Sequence[Cls]) -> tuple[int, float, float]:
        caps = get_caps(tuple(c[1] for c in order), m)
        ys = [c[0] for c in order]
        first = _min_bottleneck(ys, caps, L)
        if first is None:  # rank infeasible orders by how far they are from holding the model
            return (1, float(L - sum(caps) + L * sum(1 for c in caps if c < 1)), 0.0)
        b = max(y * n for y, n in zip(ys, first, strict=True))
        ls = _fill_at(ys, caps, L, b) or first
        return (0, b, sum(y * n for y, n in zip(ys, ls, strict=True)))

    starts = _distinct_orders(classes, 24)
    exhaustive = starts is not None
    if starts is None:
        base = order_stages(problem, classes, m, get_caps)
        light_first = sorted(classes, key=lambda c: ((1 << c[1]) / c[0], c[1]))
        starts = [tuple(base), tuple(light_first), tuple(reversed(light_first))]
    scored = [(score(o), o) for o in starts]
    best_score, best = min(scored, key=lambda t: t[0])
    order = list(best)
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
            if sc[0] < best_score[0] or (
                sc[0] == best_score[0]
                and (sc[1], sc[2]) < (best_score[1] - 1e-12, best_score[2] - 1e-12)
            ):
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
    res = split_layers([c[0] for c in order], caps, problem.layers, m)
    if res is None:
        return None
    ls, b, s = res
    return PipeSolution(tuple(order), tuple(ls), b, s)
