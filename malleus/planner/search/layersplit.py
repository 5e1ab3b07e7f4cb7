"""The layer split of one pipeline in a fixed stage order: pure arithmetic on paces and caps.

Stage j costs c_j = y_j * l_j + e_j per micro-batch (layers.py says where y and e come from).
`split_layers` minimises the 1F1B bound (m-1) * max c + sum c under per-stage caps: a greedy
fill gives the least bottleneck b* (`min_bottleneck`), trimming the slowest stages gives the
least fill/drain sum at b* (`fill_at`), and a walk over the next breakpoints b > b* trades a
slightly larger bottleneck for a smaller sum when few micro-batches make the bubble term
matter. `polish_split` then moves single layers while the exact makespan
(`schedule.pipeline_time`) falls. Apart from layers.py because none of it needs the problem:
the stage order search scores thousands of orders through these functions, and the tests call
`split_layers` against an ILP oracle.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from ..schedule import pipeline_time, pipeline_time_lower

__all__ = [
    "LineFloor",
    "exact_micro_batches",
    "fill_at",
    "line_floor",
    "min_bottleneck",
    "polish_split",
    "split_layers",
]


def exact_micro_batches(S: int) -> int:
    """Micro-batches up to which the search times an S-stage pipeline exactly (the bubble's
    shape matters when micro-batches are few; beyond, the bound grows by the bottleneck)."""
    return 2 * S + 2


def min_bottleneck(
    ys: Sequence[float], caps: Sequence[int], L: int, es: Sequence[float] | None = None
) -> list[int] | None:
    """Least max_j y_j*l_j + e_j with 1 <= l_j <= cap_j, sum l_j = L (greedy fill is exact)."""
    S = len(ys)
    if S > L or min(caps) < 1 or sum(caps) < L:
        return None
    es = es or [0.0] * S
    b0 = (L + sum(e / y for y, e in zip(ys, es, strict=True))) / sum(1.0 / y for y in ys)
    ls = [max(1, min(c, int((b0 - e) / y))) for y, c, e in zip(ys, caps, es, strict=True)]
    if sum(ls) > L:
        ls = [1] * S
    heap = [(ys[j] * (ls[j] + 1) + es[j], j) for j in range(S) if ls[j] < caps[j]]
    heapq.heapify(heap)
    left = L - sum(ls)
    while left > 0:
        _, j = heapq.heappop(heap)
        ls[j] += 1
        left -= 1
        if ls[j] < caps[j]:
            heapq.heappush(heap, (ys[j] * (ls[j] + 1) + es[j], j))
    return ls


def fill_at(
    ys: Sequence[float],
    caps: Sequence[int],
    L: int,
    b: float,
    es: Sequence[float] | None = None,
) -> list[int] | None:
    """Least-sum split with every stage cost <= b: fill to b, then trim the slowest stages."""
    es = es or [0.0] * len(ys)
    ls = [min(c, int((b - e) / y + 1e-9)) for y, c, e in zip(ys, caps, es, strict=True)]
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
    ys: Sequence[float],
    caps: Sequence[int],
    L: int,
    m: int | None,
    es: Sequence[float] | None = None,
) -> tuple[list[int], float, float] | None:
    """Layers per stage minimising (m-1)*max c + sum c, c_j = y_j*l_j + e_j (m None:
    bottleneck, then sum)."""
    es = list(es) if es else [0.0] * len(ys)
    first = min_bottleneck(ys, caps, L, es)
    if first is None:
        return None
    b_star = max(y * n + e for y, n, e in zip(ys, first, es, strict=True))
    ls = fill_at(ys, caps, L, b_star, es) or first

    def cost(split: list[int]) -> tuple[float, float]:
        cs = [y * n + e for y, n, e in zip(ys, split, es, strict=True)]
        return max(cs), sum(cs)

    b, s = cost(ls)
    if m is None or (len(set(ys)) == 1 and not any(es)):
        return ls, b, s
    # Bubble trade: a larger bottleneck lets fast stages take layers from slow ones.
    floor_sum = _least_sum(ys, caps, L) + sum(es)
    best = ((m - 1) * b + s, ls, b, s)
    heap = [
        (y * (n + 1) + es[j], j)
        for j, (y, n, c) in enumerate(zip(ys, ls, caps, strict=True))
        if n < c
    ]
    heapq.heapify(heap)
    seen = 0
    # few micro-batches: walk every breakpoint; many: the first few are all that can pay
    limit = 4 * L if m <= len(ys) else len(ys) + 2
    while heap and seen < limit:
        nb, j = heapq.heappop(heap)
        if (m - 1) * nb + floor_sum >= best[0] - 1e-12:
            break  # no larger bottleneck can pay for itself any more
        seen += 1
        split = fill_at(ys, caps, L, nb, es)
        if split is not None:
            cb, cs = cost(split)
            if (m - 1) * cb + cs < best[0] - 1e-12:
                best = ((m - 1) * cb + cs, split, cb, cs)
        n_next = int((nb - es[j]) / ys[j] + 1e-9) + 1
        if n_next <= caps[j]:
            heapq.heappush(heap, (ys[j] * n_next + es[j], j))
    return best[1], best[2], best[3]


# LineFloor's grid of bottlenecks, as multiples of the least one: fine where the solved
# bottleneck nearly always is (at the least one or a step above), coarse beyond
_FLOOR_GRID = (1.0, 1.03, 1.1, 1.4)


@dataclass(frozen=True)
class LineFloor:
    """What `split_layers` (m None) can give a set of paces under any caps, order and
    extras >= 0, without solving it: its bottleneck b is at least the integral least
    bottleneck without memory caps (caps only take splits away), `bs[0]`, and its fill sum is
    at least F(b), the least sum with every stage within b (nonincreasing in b). `count`
    bounds the micro-batches its line (m-1)*b + s takes within T from above: the line of
    (b, F(b)) takes the most just where F steps down, and F is sampled on a grid `bs` (`fs[i]`
    = F(bs[i+1])), so on [bs[i], bs[i+1]] at most (T - fs[i]) / bs[i] + 1, beyond the grid
    at most (T - fmin) / bs[-1] + 1 (fmin: the least sum at any b)."""

    bs: tuple[float, ...]
    fs: tuple[float, ...]
    fmin: float

    def count(self, T: float) -> int:
        """At least `microbatch.line_count` of the solved line within T (-1: not even one)."""
        if self.fmin > T + 1e-9:
            return -1
        h = (T - self.fmin) / self.bs[-1]
        for b, f in zip(self.bs, self.fs, strict=False):
            h = max(h, (T - f) / b)
        return int(h + 1e-9) + 1


def line_floor(ys: Sequence[float], L: int) -> LineFloor | None:
    """The `LineFloor` of these paces (None when no split exists): a few heap steps and
    O(S) sums, against an order search and a capped split; the climbs reject neighbours by
    it before solving their new pipelines (localsearch.py)."""
    S = len(ys)
    uncapped = [L] * S
    first = min_bottleneck(ys, uncapped, L)
    if first is None:
        return None
    b0 = max(y * n for y, n in zip(ys, first, strict=True))
    fmin = max(b0, _least_sum(ys, uncapped, L))  # a sum is at least its largest term
    slow_first = sorted(ys, reverse=True)
    bs = tuple(b0 * g for g in _FLOOR_GRID)
    return LineFloor(
        bs, tuple(max(fmin, _least_sum_within(slow_first, L, b)) for b in bs[1:]), fmin
    )


def _least_sum_within(slow_first: Sequence[float], L: int, b: float) -> float:
    """F(b): the least sum of y_j * l_j with every y_j * l_j <= b (no caps), as `fill_at`
    finds it: every stage filled to b, the excess trimmed off the slowest stages."""
    fill = [int(b / y + 1e-9) for y in slow_first]
    excess = sum(fill) - L
    total = 0.0
    for y, n in zip(slow_first, fill, strict=True):
        cut = min(excess, n - 1) if excess > 0 else 0
        excess -= cut
        total += y * (n - cut)
    return total


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


def polish_split(
    ys: Sequence[float], es: Sequence[float], caps: Sequence[int], ls: list[int], m: int | None
) -> list[int]:
    """Move single layers between stages while the exact 1F1B time at m falls.

    The split above minimises the bound (m-1) * max c + sum c; the exact time also rewards a
    bottleneck early in the pipeline (later stages overlap its backward passes). That matters
    when micro-batches are few; with many (or m None) the bound's split stands.
    """
    S = len(ys)
    if S == 1 or m is None or m <= 1 or m > exact_micro_batches(S):
        return ls
    ls = list(ls)

    def costs(split: list[int]) -> list[float]:
        return [y * n + e for y, n, e in zip(ys, split, es, strict=True)]

    best = pipeline_time(m, costs(ls))
    for _ in range(2 * S):
        move = None
        cur = costs(ls)
        # only layers out of the two costliest stages: the others rarely shorten the path
        givers = range(S) if S <= 3 else sorted(range(S), key=lambda j: -cur[j])[:2]
        for a in givers:
            if ls[a] <= 1:
                continue
            for b in range(S):
                if b == a or ls[b] >= caps[b]:
                    continue
                ls[a] -= 1
                ls[b] += 1
                c = costs(ls)
                if pipeline_time_lower(m, c) < best - 1e-12:
                    t = pipeline_time(m, c)
                    if t < best - 1e-12:
                        best, move = t, (a, b)
                ls[a] += 1
                ls[b] -= 1
        if move is None:
            break
        ls[move[0]] -= 1
        ls[move[1]] += 1
    return ls
