"""Hill climbing on abstract layouts: move, swap, merge, split, idle or re-admit one group.

Templates get the structure right; the last few per cent are integrality (whole layers, whole
micro-batches) and memory corner cases, which small moves fix. A move is accepted when it lowers
the step time, or keeps it and lowers the number of pipelines that sit at the step time (one
step closer to lowering it). Moves are tried critical pipelines first; the caller says when to
stop.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator

from .evaluate import Evaluator, Layout, PipeKey, Scored, merge
from .layers import Cls

__all__ = ["Stop", "critical", "explore", "improve"]


def critical(ev: Evaluator, sc: Scored) -> int:
    """Pipelines whose time equals the step time."""
    n = 0
    for (key, count), (m, up) in zip(sc.layout, sc.splits, strict=True):
        # an unrefined score timed every pipeline by its any-m solution: so does this count
        # (solving each pipeline at its own m for a figure left unused cost a climb dearly)
        sol = None if sc.refined else ev.pipe(key)
        if sol is not None:
            top = sol.time(m + (1 if up else 0))
        else:
            top = ev.time_at(key, m + 1) if up else ev.time_at(key, m)
        if top >= sc.time - sc.tail - 1e-9:
            n += up if up else count
    return n


def _remove(key: PipeKey, c: Cls) -> PipeKey:
    lst = list(key)
    lst.remove(c)
    return tuple(lst)


def _neighbours(layout: Layout, idle: Counter[Cls], order: list[int]) -> Iterator[Layout]:
    keys = [k for k, _ in layout]
    counts = dict(layout)

    def without(*ks: PipeKey) -> list[tuple[PipeKey, int]]:
        left = Counter(counts)
        for k in ks:
            left[k] -= 1
        return [(k, n) for k, n in left.items() if n > 0]

    for ia in order:
        a = keys[ia]
        for c in sorted(set(a)):
            a2 = _remove(a, c)
            # move c to another pipeline (possibly one of the same key)
            for b in keys:
                if b == a and counts[a] < 2:
                    continue
                rest = without(a, b)
                yield merge([*rest, (a2, 1), ((*b, c), 1)])
            # c alone in a new pipeline
            yield merge([*without(a), (a2, 1), ((c,), 1)])
            # idle c
            yield merge([*without(a), (a2, 1)])
            # swap c with a different class d of another pipeline
            for b in keys:
                if b == a and counts[a] < 2:
                    continue
                for d in sorted(set(b)):
                    if d == c:
                        continue
                    rest = without(a, b)
                    yield merge([*rest, ((*a2, d), 1), ((*_remove(b, d), c), 1)])
        # re-admit an idle group into a
        for c in sorted(idle):
            yield merge([*without(a), ((*a, c), 1)])
        # merge a with another pipeline
        for b in keys:
            if b == a and counts[a] < 2:
                continue
            yield merge([*without(a, b), ((*a, *b), 1)])
        # split a into two (small pipelines only)
        if 2 <= len(a) <= 8:
            idx = range(len(a))
            seen: set[PipeKey] = set()
            for r in range(1, len(a) // 2 + 1):
                for part in itertools.combinations(idx, r):
                    x = tuple(sorted(a[i] for i in part))
                    if x in seen:
                        continue
                    seen.add(x)
                    y = tuple(a[i] for i in idx if i not in part)
                    yield merge([*without(a), (x, 1), (y, 1)])


def _used(layout: Layout) -> Counter[Cls]:
    c: Counter[Cls] = Counter()
    for key, n in layout:
        for cls in key:
            c[cls] += n
    return c


Stop = Callable[[], bool]  # True once the search must end


def _level_time(ev: Evaluator, sc: Scored, i: int) -> float:
    """Time of the i-th pipeline class one micro-batch above its level, as the score timed it
    (an unrefined score: by the any-m solution; solving each pipeline at its own m to rank
    the pipelines cost a climb on a large layout more than its moves did)."""
    key, m = sc.layout[i][0], sc.splits[i][0] + 1
    sol = None if sc.refined else ev.pipe(key)
    return sol.time(m) if sol is not None else ev.time_at(key, m)


def improve(
    ev: Evaluator,
    start: Scored,
    available: Counter[Cls],
    stop: Stop,
    dp: int | None,
    refine: bool,
) -> Scored:
    """First-improvement hill climb from `start` until no move helps or `stop()` (asked
    before any work, and before every neighbour scored)."""
    best = start
    if stop():
        return best
    best_crit = critical(ev, best)
    improved = True
    while improved and not stop():
        improved = False
        idle = available - _used(best.layout)
        # critical pipelines first: they are the ones a move must relieve
        order = sorted(range(len(best.layout)), key=lambda i: -_level_time(ev, best, i))
        # every neighbour uses only groups of the layout or idle ones (_neighbours builds
        # them so): no count of used groups to check, which cost a climb a fifth of its time
        for cand in _neighbours(best.layout, idle, order):
            if stop():
                break
            if dp is not None and sum(n for _, n in cand) != dp:
                continue
            if not cand:
                continue
            sc = ev.score(cand, refine=refine)
            if sc is None or sc.time > best.time + 1e-9:
                continue
            crit = critical(ev, sc)
            if sc.time < best.time - 1e-9 or crit < best_crit:
                best, best_crit, improved = sc, crit, True
                break
    return best


def explore(
    ev: Evaluator,
    start: Scored,
    available: Counter[Cls],
    stop: Stop,
    dp: int | None,
    refine: bool,
    seed: int = 0,
    patience: int = 40,
) -> Scored:
    """Iterated local search: kick the best layout with 1-3 random moves, climb, keep if better.

    Stops at `stop()` or after `patience` kicks in a row that found nothing better.

    Hill climbing stops at the first layout no single move improves; near-optimal layouts are
    often two moves apart (a group leaves a pipeline that must then absorb another one).
    """
    rng = random.Random(seed)
    best = start
    misses = 0
    while not stop() and misses < patience:
        misses += 1
        cur = best.layout
        for _ in range(rng.randint(1, 3)):
            idle = available - _used(cur)
            order = list(range(len(cur)))
            rng.shuffle(order)
            moves = [
                c
                for c in itertools.islice(_neighbours(cur, idle, order), 64)
                if c and (dp is None or sum(n for _, n in c) == dp)
            ]
            if not moves:
                break
            cur = rng.choice(moves)
        sc = ev.score(cur, refine=refine)
        if sc is None:
            continue
        sc = improve(ev, sc, available, stop, dp, refine)
        if sc.time < best.time - 1e-9:
            best, misses = sc, 0
    return best
