"""Hill climbing on abstract layouts: move, swap, merge, split, idle or re-admit one group.

Templates get the structure right; the last few per cent are integrality (whole layers, whole
micro-batches) and memory corner cases, which small moves fix. A move is accepted when it lowers
the step time, or keeps it and lowers the number of pipelines that sit at the step time (one
step closer to lowering it). Moves are tried critical pipelines first; the caller says when to
stop.

On large layouts (unrefined scores: the linear micro-batch split) a neighbour is a change of a
few pipelines (`Move`), judged from those alone (`Tally`): micro-batches that fit below and at
the step time, a pipeline not solved yet counted by its floor (layersplit.LineFloor). Only the
neighbours it accepts are built and scored; "fewer at the step time" is then micro-batches
rather than pipelines (the linear split's own measure).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator

from .evaluate import Evaluator, Layout, PipeKey, Scored, merge
from .layers import Cls, PipeSolution
from .microbatch import line_count

__all__ = [
    "Stop",
    "Tally",
    "apply_move",
    "candidate_moves",
    "critical",
    "explore",
    "improve",
    "used_groups",
]


def critical(ev: Evaluator, sc: Scored, enough: int | None = None) -> int:
    """Pipelines whose time equals the step time (counting stops at `enough`)."""
    n = 0
    thr = sc.time - sc.tail - 1e-9
    for (key, count), (m, up) in zip(sc.layout, sc.splits, strict=True):
        # an unrefined score timed every pipeline by its any-m solution: so does this count
        # (solving each pipeline at its own m for a figure left unused cost a climb dearly)
        sol = None if sc.refined else ev.pipe(key)
        if sol is not None:
            mm = m + (1 if up else 0)
            # the 1F1B line bounds the makespan from above: most pipelines of a layout sit
            # below the step time by it, and a makespan is the climb's dearest arithmetic
            if (mm - 1) * sol.bottleneck + sol.fill < thr - 1e-9:
                continue
            top = sol.time(mm)
        else:
            top = ev.time_at(key, m + 1) if up else ev.time_at(key, m)
        if top >= thr:
            n += up if up else count
            if enough is not None and n >= enough:
                return n
    return n


def _remove(key: PipeKey, c: Cls) -> PipeKey:
    lst = list(key)
    lst.remove(c)
    return tuple(lst)


Move = tuple[tuple[PipeKey, ...], tuple[PipeKey, ...]]
"""A neighbour as a change: pipelines taken out (one of each key listed), pipelines put in."""


def candidate_moves(layout: Layout, idle: Counter[Cls], order: list[int]) -> Iterator[Move]:
    """Every neighbour of a layout, pipelines `order` first: move, swap, idle or re-admit one
    group, merge two pipelines, split a small one."""
    keys = [k for k, _ in layout]
    counts = dict(layout)

    def srt(*cs: Cls) -> PipeKey:
        return tuple(sorted(cs))

    for ia in order:
        a = keys[ia]
        others = [b for b in keys if b != a or counts[a] >= 2]
        for c in sorted(set(a)):
            a2 = _remove(a, c)
            if not a2:  # a pipeline left with no group does not score: no neighbour
                continue
            for b in others:  # move c to another pipeline (possibly one of the same key)
                yield (a, b), (a2, srt(*b, c))
            yield (a,), (a2, (c,))  # c alone in a new pipeline
            yield (a,), (a2,)  # idle c
            for b in others:  # swap c with a different class d of another pipeline
                for d in sorted(set(b)):
                    if d != c:
                        yield (a, b), (srt(*a2, d), srt(*_remove(b, d), c))
        for c in sorted(idle):  # re-admit an idle group into a
            yield (a,), (srt(*a, c),)
        for b in others:  # merge a with another pipeline
            yield (a, b), (srt(*a, *b),)
        if 2 <= len(a) <= 8:  # split a into two (small pipelines only)
            idx = range(len(a))
            seen: set[PipeKey] = set()
            for r in range(1, len(a) // 2 + 1):
                for part in itertools.combinations(idx, r):
                    x = srt(*(a[i] for i in part))
                    if x in seen:
                        continue
                    seen.add(x)
                    yield (a,), (x, tuple(a[i] for i in idx if i not in part))


def apply_move(layout: Layout, move: Move) -> Layout:
    left: Counter[PipeKey] = Counter(dict(layout))
    for k in move[0]:
        left[k] -= 1
    return merge([*left.items(), *((k, 1) for k in move[1])])


_NONE = -(1 << 40)  # a pipeline that cannot take one micro-batch within T: the layout cannot


class Tally:
    """The linear split's verdict on a neighbour from its changed pipelines alone.

    An unrefined, uncalibrated score is the linear micro-batch split: its step time is at most
    T exactly when the pipelines' lines take B micro-batches within T (microbatch.line_count),
    and the micro-batches that must sit at the step time T are B minus what fits below it.
    So a neighbour lowers T when what fits below T reaches B, ties when what fits at T does,
    and is one step closer to lowering it when more fits below T than before; each is the
    layout's tally with the removed pipelines' counts taken out and the new ones' put in. A
    new pipeline not solved yet counts first by its floor (`Evaluator.floor`, never fewer
    than it takes): most neighbours are rejected before their pipelines are solved or the
    micro-batches split, which was most of a climb's cost.
    """

    def __init__(self, ev: Evaluator, best: Scored) -> None:
        self.ev = ev
        self.B = ev.problem.micro_batches
        self.hi_t = best.time + 1e-9  # the climb's tie tolerance
        # below T by more than line_count's own tolerance (1e-9 micro-batches)
        self.lo_t = best.time - 1e-7 * max(1.0, best.time)
        self.counts: dict[PipeKey, tuple[int, int]] = {}
        self.hi = self.lo = 0
        for key, n in best.layout:
            sol = ev.pipe(key)
            assert sol is not None  # an unrefined score solved every pipeline
            hi, lo = self._exact(sol)
            self.counts[key] = (hi, lo)
            self.hi += n * hi
            self.lo += n * lo

    def _exact(self, sol: PipeSolution) -> tuple[int, int]:
        line = [(sol.bottleneck, sol.fill, 1)]
        return _fit(line_count(line, self.hi_t)), _fit(line_count(line, self.lo_t))

    def judge(self, move: Move) -> bool:
        """False when the neighbour neither lowers the step time nor ties it with less at it."""
        hi, lo = self.hi, self.lo
        for k in move[0]:
            h, low = self.counts[k]
            hi, lo = hi - h, lo - low
        bound = hi
        for k in move[1]:
            if not k:
                return False  # a pipeline left with no group
            if self.ev.solved(k):
                sol = self.ev.pipe(k)
                if sol is None:
                    return False  # cannot hold the model with many in flight: no score
                bound += self._exact(sol)[0]
            else:
                floor = self.ev.floor(k)
                if floor is None:
                    return False
                bound += _fit(floor.count(self.hi_t))
        if bound < self.B:
            return False  # slower than the layout even by its new pipelines' floors
        for k in move[1]:
            sol = self.ev.pipe(k)
            if sol is None:
                return False
            h, low = self._exact(sol)
            hi, lo = hi + h, lo + low
        return lo >= self.B or (hi >= self.B and lo > self.lo)


def _fit(n: int) -> int:
    return _NONE if n < 0 else n


def used_groups(layout: Layout) -> Counter[Cls]:
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
    B = ev.problem.micro_batches
    # the linear split's tally (Tally) where the score is that split: unrefined, no
    # calibrated tail, and too few pipelines for a fallback to the per-m greedy split
    linear = not refine and ev.problem.calibration is None
    best_crit = 0 if linear else critical(ev, best)
    improved = True
    while improved and not stop():
        improved = False
        idle = available - used_groups(best.layout)
        tally = None
        if linear and not best.refined and (best.dp + 2) * 4 < B:
            tally = Tally(ev, best)
        elif linear:
            best_crit = critical(ev, best)
        # critical pipelines first: they are the ones a move must relieve
        order = sorted(range(len(best.layout)), key=lambda i: -_level_time(ev, best, i))
        # every neighbour uses only groups of the layout or idle ones (candidate_moves builds
        # them so): no count of used groups to check, which cost a climb a fifth of its time
        dp_now = best.dp
        for move in candidate_moves(best.layout, idle, order):
            if stop():
                break
            n = dp_now + len(move[1]) - len(move[0])
            if n == 0 or (dp is not None and n != dp):
                continue
            if tally is not None and not tally.judge(move):
                continue
            lay = apply_move(best.layout, move)
            if refine and ev.floor_bound(lay) > best.time + 1e-9:
                continue  # slower whatever its pipelines' solutions: not worth solving them
            sc = ev.score(lay, refine=refine)
            if sc is None or sc.time > best.time + 1e-9:
                continue
            if tally is not None:  # it judged the neighbour better; the score: no slower
                best, improved = sc, True
                break
            if sc.time < best.time - 1e-9:
                best, best_crit, improved = sc, critical(ev, sc), True
                break
            crit = critical(ev, sc, enough=best_crit)  # a tie must lower the count
            if crit < best_crit:
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
            idle = available - used_groups(cur)
            order = list(range(len(cur)))
            rng.shuffle(order)
            moves = [
                c
                for c in (
                    apply_move(cur, mv)
                    for mv in itertools.islice(candidate_moves(cur, idle, order), 64)
                )
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
