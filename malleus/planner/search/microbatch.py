"""Micro-batches across pipelines: minimise max_i T_i(m_i) with sum m_i = B, m_i >= 1.

Each T_i is nondecreasing in m_i, so the greedy that hands the next micro-batch to the pipeline
whose time grows least is exact. Identical pipelines come as classes (count c): a class moves
one level at a time for up to c pipelines, so thousands of pipelines cost a few heap steps.
For the linear case T_i(m) = (m-1)*b_i + s_i a bisection on T first jumps to just below the
optimum, and the greedy finishes from there.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

__all__ = ["ClassSplit", "greedy_split", "line_count", "split_linear"]

ClassSplit = tuple[int, int]  # (m, n_up): n_up pipelines of the class run m+1, the rest m


def line_count(lines: Sequence[tuple[float, float, int]], T: float) -> int:
    """Micro-batches that classes (b, s, count) of pipelines T(m) = (m-1)*b + s can take
    within T (-1 if one cannot take even one): split_linear's optimum is at most T exactly
    when this is at least B."""
    total = 0
    for b, s, c in lines:
        if s - 1e-9 > T:
            return -1
        total += c * (int((T - s) / b + 1e-9) + 1)
    return total


def greedy_split(
    times: Sequence[Callable[[int], float]],
    counts: Sequence[int],
    B: int,
    start: Sequence[int] | None = None,
) -> tuple[float, list[ClassSplit]] | None:
    """Exact greedy from `start` levels (default 1): classes of pipelines, times[i](m)."""
    n = sum(counts)
    if n == 0 or n > B:
        return None
    levels = list(start) if start is not None else [1] * len(counts)
    ups = [0] * len(counts)
    left = B - sum(c * m for c, m in zip(counts, levels, strict=True))
    if left < 0:
        levels = [1] * len(counts)
        left = B - n
    heap = [(times[i](levels[i] + 1), i) for i in range(len(counts))]
    heapq.heapify(heap)
    while left > 0:
        _, i = heapq.heappop(heap)
        take = min(left, counts[i] - ups[i])
        ups[i] += take
        left -= take
        if ups[i] == counts[i]:
            levels[i] += 1
            ups[i] = 0
        heapq.heappush(heap, (times[i](levels[i] + 1), i))
    T = max(times[i](levels[i] + (1 if ups[i] else 0)) for i in range(len(counts)))
    return T, list(zip(levels, ups, strict=True))


def split_linear(
    lines: Sequence[tuple[float, float, int]], B: int
) -> tuple[float, list[ClassSplit]] | None:
    """Classes (b, s, count) of pipelines with T(m) = (m-1)*b + s; None if more pipelines than B."""
    n = sum(c for _, _, c in lines)
    if n == 0 or n > B:
        return None
    lo = max(s for _, s, _ in lines)
    start = [1] * len(lines)
    if line_count(lines, lo) < B:
        hi = max(s + (B - 1) * b for b, s, _ in lines)
        # Above every s, count(T) lies within C of sum c*(T - s)/b (C pipelines, each within
        # one micro-batch of its line): a bracket about one b wide. The greedy below is exact
        # from any start under the optimum (it adds micro-batches in order of time, whatever
        # it starts from), so the bisection stops once the start is within a level or so.
        inv = sum(c / b for b, _, c in lines)
        cs = sum(c * s / b for b, s, c in lines)
        hi = min(hi, max(lo, (B + cs) / inv * (1 + 1e-9)))
        low = (B - sum(c for _, _, c in lines) + cs) / inv * (1 - 1e-9)
        if low > lo and line_count(lines, low) < B:
            lo = low
        step = 0.5 * min(b for b, _, _ in lines)
        for _ in range(100):
            if hi - lo <= max(step, 1e-9 * hi):
                break
            mid = (lo + hi) / 2
            if line_count(lines, mid) >= B:
                hi = mid
            else:
                lo = mid
        start = [int((lo - s) / b + 1e-9) + 1 for b, s, _ in lines]
    times = [lambda m, b=b, s=s: (m - 1) * b + s for b, s, _ in lines]
    return greedy_split(times, [c for _, _, c in lines], B, start)
