"""Layout templates: turn one grouping into a family of abstract layouts worth scoring.

Under the cost model a layout's step time is roughly L * (B + stages - pipelines) / speed: the
bubble costs one micro-batch slot per extra stage, whichever pipeline it sits in. So the
templates keep the healthy full groups in as few stages as memory allows and put the odd groups
(slow or small) into a few *special* pipelines, each topped up with healthy groups until it
holds the model (mode "min") or until its speed matches a healthy pipeline's ("balance", which
keeps micro-batches even). The rest of the healthy groups form q pool pipelines of near-equal
depth; q, the number of special pipelines and the top-up mode are what the family enumerates.
A second family deals every group into d pipelines by LPT (full groups first, since they carry
the memory), which finds the mixed pipelines small clusters need.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from .deadline import Deadline
from .evaluate import Evaluator, Layout, PipeKey, merge
from .layers import Cls

__all__ = [
    "TopupMemo",
    "healthy_depths",
    "lpt",
    "partition_layouts",
    "special_counts",
    "template_layouts",
]

TopupMemo = dict[tuple[object, ...], "int | None"]
"""Fewest healthy groups per (odd groups, healthy count): shared by every grouping's templates."""
_TOPUP_LINEAR = 3  # counts tried one by one before doubling
_DEPTH_PROBE = 16  # full groups assumed when probing pipeline depths with few healthy ones


def healthy_depths(ev: Evaluator, hc: Cls, H: int) -> tuple[int, int] | None:
    """(least depth that fits with few micro-batches, least depth that fits with many)."""
    L = ev.problem.layers
    lo = hi = None
    for S in range(1, min(H, L) + 1):
        key = (hc,) * S
        if lo is None and ev.pipe(key, 1) is not None:
            lo = S
        if ev.pipe(key) is not None:
            hi = S
            break
    if hi is None:
        return None if lo is None else (lo, min(H, L))
    return (lo if lo is not None else hi), hi


def lpt(classes: list[Cls], bins: int) -> list[list[Cls]]:
    """Longest-processing-time: fastest first, each into the slowest bin so far."""
    out: list[list[Cls]] = [[] for _ in range(bins)]
    heap = [(0.0, i) for i in range(bins)]
    for c in sorted(classes, key=lambda c: (c[0], c[1])):
        v, i = heapq.heappop(heap)
        out[i].append(c)
        heapq.heappush(heap, (v + 1.0 / c[0], i))
    return [b for b in out if b]


def special_counts(n_odd: int, nodes: int, cap: int) -> list[int]:
    """How many special pipelines to try: all small counts, then a geometric ladder.

    Ordered by distance (in log scale) from one per straggler node, the natural guess, so a
    search cut short by its deadline has tried the likeliest counts.
    """
    top = min(n_odd, cap)
    vals = set(range(1, min(top, 12) + 1))
    v = 12.0
    while v < top:
        v *= 1.35
        vals.add(min(top, int(v)))
    vals.add(top)
    if 0 < nodes <= top:
        vals.add(nodes)
    guess = max(1, min(nodes, top))
    return sorted((x for x in vals if x >= 1), key=lambda x: (abs(math.log(x / guess)), x))


def _topup(
    ev: Evaluator,
    group: list[Cls],
    hc: Cls,
    H: int,
    dl: Deadline | None = None,
    memo: TopupMemo | None = None,
) -> int | None:
    """Fewest healthy groups that let this set of groups hold the model (None: none do, or
    the deadline passed). A few counts one by one, then doubling and bisection: memory room
    grows with every healthy group added, so feasibility is monotone in practice."""
    L = ev.problem.layers
    key = (tuple(sorted(group)), H)
    if memo is not None and key in memo:
        return memo[key]
    top = min(H, L - len(group))

    def fits(h: int) -> bool | None:
        if dl is not None:
            if dl.expired():
                return None
            dl.spend()
        return ev.pipe(tuple(sorted(group + [hc] * h))) is not None

    found: int | None = None
    h = 0
    while h <= min(top, _TOPUP_LINEAR):
        ok = fits(h)
        if ok is None:
            return None
        if ok:
            found = h
            break
        h += 1
    if found is None and h <= top:
        lo, step = h - 1, 1  # lo: known not to fit
        hi = None
        while hi is None:
            step *= 2
            cand = min(top, lo + step)
            ok = fits(cand)
            if ok is None:
                return None
            if ok:
                hi = cand
            elif cand == top:
                break
            else:
                lo = cand
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                ok = fits(mid)
                if ok is None:
                    return None
                lo, hi = (lo, mid) if ok else (mid, hi)
            found = hi
    if memo is not None:
        memo[key] = found
    return found


def _spread(pipes: list[list[Cls]], hc: Cls, P: int, L: int) -> None:
    """Give P healthy groups to the slowest pipelines, one at a time (at most L stages each)."""
    heap = [(sum(1.0 / c[0] for c in p), i) for i, p in enumerate(pipes) if len(p) < L]
    heapq.heapify(heap)
    for _ in range(P):
        if not heap:
            return  # the rest stay idle: a stage needs a layer
        v, i = heapq.heappop(heap)
        pipes[i].append(hc)
        if len(pipes[i]) < L:
            heapq.heappush(heap, (v + 1.0 / hc[0], i))


def _pool(P: int, q: int, hc: Cls, L: int) -> list[tuple[PipeKey, int]]:
    """P healthy groups in q pipelines of near-equal depth (beyond L stages they stay idle)."""
    d, r = divmod(P, q)
    if d >= L:
        return [((hc,) * L, q)]
    return [((hc,) * d, q - r), ((hc,) * (d + 1), r)]


def template_layouts(
    ev: Evaluator,
    hc: Cls,
    H: int,
    odd: list[Cls],
    n_nodes: int,
    dp: int | None,
    deadline: Deadline | None = None,
    memo: TopupMemo | None = None,
) -> Iterator[Layout]:
    """Every template layout for a grouping with H healthy full groups and these odd groups.

    Ends early (a generator that stops) once `deadline` has passed, even between layouts."""
    B, L = ev.problem.micro_batches, ev.problem.layers
    # depths of full-group pipelines, as if healthy groups were plenty (with stragglers on
    # almost every node there are few or none, and the odd groups still need that memory)
    depths = healthy_depths(ev, hc, max(H, min(_DEPTH_PROBE, L)))
    if depths is None:
        s_lo, s_hi, m_hi = 1, 1, 1
    else:
        s_lo, m_hi = depths[0], depths[1] + 2
        s_hi = max(s_lo, min(m_hi, max(1, H)))
    depth_range = range(s_lo, s_hi + 1)
    mem_range = range(s_lo, max(s_hi, m_hi) + 1)
    seen: set[Layout] = set()

    def emit(pipes: list[tuple[PipeKey, int]]) -> Iterator[Layout]:
        lay = merge(pipes)
        n = sum(c for _, c in lay)
        if lay and lay not in seen and n <= B and (dp is None or n == dp):
            seen.add(lay)
            yield lay

    if not odd:
        for q in _pool_counts(H, 0, depth_range, B, dp):
            if q:
                yield from emit(_pool(H, q, hc, L))
        return
    for lay in _balanced(hc, H, odd, depth_range, B, L, dp, mem_range):
        yield from emit(lay)
    cap = min(B, dp) if dp is not None else B
    for p in special_counts(len(odd), n_nodes, cap):
        bins = lpt(odd, p)
        mins = []
        for b in bins:
            h = _topup(ev, b, hc, H, deadline, memo)
            if h is None:
                break
            mins.append(h)
        if deadline is not None and deadline.expired():
            return
        if len(mins) < len(bins):
            continue
        targets: list[int | None] = [None, *depth_range]
        for target in targets:
            hs = []
            for b, h in zip(bins, mins, strict=True):
                assert h is not None
                if target is not None:
                    want = round(target - sum(1.0 / c[0] for c in b) * hc[0])
                    h = max(h, min(want, ev.problem.layers - len(b)))
                hs.append(h)
            P = H - sum(hs)
            if P < 0:
                continue
            for q in _pool_counts(P, len(bins), depth_range, B, dp):
                specials = [list(b) + [hc] * h for b, h in zip(bins, hs, strict=True)]
                pipes: list[tuple[PipeKey, int]] = []
                if q == 0:
                    _spread(specials, hc, P, L)
                else:
                    pipes.extend(_pool(P, q, hc, L))
                pipes.extend((tuple(s), 1) for s in specials)
                yield from emit(pipes)


def _balanced(
    hc: Cls,
    H: int,
    odd: list[Cls],
    depths: range,
    B: int,
    L: int,
    dp: int | None,
    mem_depths: range | None = None,
) -> Iterator[list[tuple[PipeKey, int]]]:
    """All groups dealt into d pipelines by LPT: full groups first (they carry the memory)."""
    G = H + len(odd)
    if dp is not None:
        ds = {dp}
    elif G <= 24:
        ds = set(range(1, G + 1))
    else:
        ds = {G // S for S in depths} | {-(-G // S) for S in depths}
        # many small groups: a pipeline needs about S full groups' worth of memory, and a
        # group of tp/2^k GPUs brings 1/2^k of it
        units = H + sum(1.0 / (1 << c[1]) for c in odd)
        md = mem_depths or depths
        ds |= {int(units // S) for S in md} | {math.ceil(units / S) for S in md}
    groups = [hc] * H + odd
    orders = (
        sorted(groups, key=lambda c: (c[1], c[0])),  # full groups first, fastest first
        sorted(groups, key=lambda c: c[0] / (1 << c[1])),  # fastest per GPU first
    )
    for d in sorted(x for x in ds if 1 <= x <= min(B, G)):
        for order in orders:
            bins: list[list[Cls]] = [[] for _ in range(d)]
            heap = [(0.0, i) for i in range(d)]
            for c in order:
                v, i = heapq.heappop(heap)
                if len(bins[i]) < L:
                    bins[i].append(c)
                    v += 1.0 / c[0]
                heapq.heappush(heap, (v, i))
            yield [(tuple(b), 1) for b in bins if b]


def _pool_counts(P: int, p: int, depths: range, B: int, dp: int | None) -> list[int]:
    """Numbers of pool pipelines to try for P healthy groups beside p special pipelines."""
    if dp is not None:
        q = dp - p
        return [q] if 0 <= q <= P and (q > 0 or p > 0) else []
    room = B - p
    vals = {0} if p > 0 else set()
    for S in depths:
        vals.update((P // S, -(-P // S)))
    vals.add(min(P, room))
    return sorted(q for q in vals if 0 <= q <= min(P, room) and (q > 0 or p > 0))


def _partitions(items: list[Cls], bins: int) -> Iterator[list[list[Cls]]]:
    """Splits of a multiset of classes into exactly `bins` non-empty unlabelled bins (lazily;
    a split may repeat, but never by placing an item into one of two identical bins)."""
    cur: list[list[Cls]] = [[] for _ in range(bins)]

    def rec(i: int) -> Iterator[list[list[Cls]]]:
        if len(items) - i < sum(1 for b in cur if not b):
            return  # too few items left to fill every bin
        if i == len(items):
            yield [list(b) for b in cur]
            return
        for j in range(bins):
            if any(cur[x] == cur[j] for x in range(j)):
                continue  # the same as an earlier bin: same splits
            cur[j].append(items[i])
            yield from rec(i + 1)
            cur[j].pop()

    yield from rec(0)


def partition_layouts(
    hc: Cls, H: int, odd: list[Cls], pipelines: int, L: int, pool: bool = False
) -> Iterator[Layout]:
    """Every split of the odd groups over `pipelines` pipelines, healthy groups to the slowest
    (and with `pool`, also each healthy group a pipeline of its own beside them).

    The special-pipeline templates deal odd groups by LPT, which spreads each size class
    evenly; under tight memory the best layout can instead gather one node's half groups in
    one pipeline (fewer full groups there) and its small groups in the others. Only for few
    odd groups: the count grows like pipelines^len(odd) / pipelines!. The pool variant is the
    templates' pool pipelines for partitions: at 32 GPUs with 16 micro-batches and six slow
    GPUs on two nodes (bench/planner_held.py, `random 167`) the best layout keeps the only
    healthy full group alone and splits the odd groups over five pipelines (415.4; 424.7
    with the healthy group spread or the odd groups dealt by LPT).
    """
    seen: set[Layout] = set()
    for pipes in _partitions(sorted(odd), pipelines):
        alone = merge([*((tuple(p), 1) for p in pipes), ((hc,), H)]) if pool else None
        _spread(pipes, hc, H, L)
        for lay in (merge((tuple(p), 1) for p in pipes), alone):
            if lay is not None and lay not in seen:
                seen.add(lay)
                yield lay
