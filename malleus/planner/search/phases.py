"""The search's phases on one (possibly bucketed) problem: from groupings to the best layouts.

Steps 1-3 of driver.py's `plan()`, up to materialising: candidate groupings (grouping.py; on
small clusters ranked by their simplest layout first, `_rank_groupings`), template
layouts for every grouping, interleaved (templates.py), partition layouts for the best few
groupings with few odd groups, then a hill climb from each of the best distinct layouts and a
kick-and-climb from the best (localsearch.py). Templates and partitions are scored on any-m
lines (cheap), then those the climbs would refine are refined the likeliest first by their
pipelines' floors (`_refine_best`); large layouts are ranked for the climbs by their refined
scores (`_starts`). Each phase ends by its share of the one `Deadline` (`_GROUPING_END`,
`_TEMPLATES_END`, `_TEMPLATES_REFINED`, `_PARTITIONS_END`, `_PARTITIONS_REFINED`, each at
least `_TEMPLATES_MIN` / `_PARTITIONS_MIN` / `_REFINE_MIN` after the phase before actually
ended; the climbs share the rest) and always yields one layout at least. Apart from driver.py, which owns what surrounds the
phases: the budget, rate bucketing, materialising, polishing and choosing the plan.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..pace import healthy_pace
from ..problem import PlanningProblem
from .deadline import Deadline
from .evaluate import Evaluator, Layout, Scored, merge
from .grouping import Grouping, candidate_groupings
from .layers import Cls
from .localsearch import explore, improve
from .templates import TopupMemo, partition_layouts, template_layouts

__all__ = ["Candidate", "debug", "score_within", "search_layouts"]

_KEEP = 6  # best distinct template layouts that get a hill climb
# ... chosen among this many (by lines), refined first within this share of what is left
_RANK_POOL, _RANK_SHARE = 24, 0.25
# Partition layouts (templates.partition_layouts): for the best few groupings with at most this
# many odd groups, every split of them over as many pipelines as their best template has.
_PART_GROUPINGS, _PART_MAX_ODD, _PART_MAX = 3, 10, 1500
# Shares of the budget up to 64 GPUs: groupings end by 35% of it, templates by 38% (scored by
# lines: cheap) and their refinement (`_refine_best`) by 52%, partitions by 54% and theirs by
# 57%; the hill climbs and the kick-and-climb get the rest.
_GROUPING_END, _TEMPLATES_END, _PARTITIONS_END = 0.35, 0.38, 0.54
_TEMPLATES_REFINED, _PARTITIONS_REFINED = 0.52, 0.57
_TEMPLATES_MIN, _PARTITIONS_MIN, _REFINE_MIN = 0.12, 0.03, 0.03
# The same four ends beyond 64 GPUs with more than `_FEW_STRAGGLERS` GPUs straggling:
# templates by 50%, partitions by 55%, as before refinement by floors (there only layouts of at
# most 8 distinct pipelines are refined at all; with many straggling rates most are not, and
# their templates need the time: Planner spread section). With few stragglers the layouts
# have few distinct pipelines, and 128 GPUs with 2 at 8x took 444.6 to 400 with these ends
# and to 383.5 with the small clusters' (bench/planner_held.py, `random 168`).
_LARGE_ENDS = (0.5, 0.5, 0.55, 0.55)
_FEW_STRAGGLERS = 16
H_ALONE = bool(int(os.environ.get("HA", "1")))
_WAVE = 8  # ranked groupings (small clusters) whose templates are interleaved at once


@dataclass
class Candidate:
    scored: Scored
    grouping: Grouping


def _available(g: Grouping) -> Counter[Cls]:
    return Counter(x.cls for x in (*g.healthy, *g.odd))


def _stopper(dl: Deadline) -> Callable[[], bool]:
    """A hill climb's stop(): one unit of work per call, True once the deadline passed."""

    def stop() -> bool:
        dl.spend()
        return dl.expired()

    return stop


def score_within(ev: Evaluator, dl: Deadline, lay: Layout, refine: bool) -> Scored | None:
    """Score a layout, its pipelines solved one at a time under the deadline first (a layout
    of many distinct pipelines is many units of work): None once the deadline has passed."""
    for key, _ in lay:
        if dl.expired():
            return None
        ev.pipe(key)  # cached for the score below
        dl.spend()
    return ev.score(lay, refine=refine)


def search_layouts(problem: PlanningProblem, ev: Evaluator, dl: Deadline) -> list[Candidate]:
    """Groupings, templates for every grouping (interleaved), partitions, then hill climbing;
    each phase ends by its share of the deadline (and always yields one layout at least)."""
    groupings = candidate_groupings(problem, dl.until(_GROUPING_END))
    small = problem.world <= 64
    hc: Cls = (healthy_pace(problem), 0)
    found: list[Candidate] = []
    if small:
        groupings, found = _rank_groupings(problem, ev, groupings, dl.until(_GROUPING_END))
    # a phase that ran late (the nodes' options of a cluster straggling everywhere) does not
    # eat the next one: templates get at least _TEMPLATES_MIN of the budget
    small_ends = (_TEMPLATES_END, _TEMPLATES_REFINED, _PARTITIONS_END, _PARTITIONS_REFINED)
    few = sum(1 for v in problem.rates.values() if v != 1.0) <= _FEW_STRAGGLERS
    t_end, t_refined, p_end, p_refined = small_ends if small or few else _LARGE_ENDS
    templates_dl = dl.until(max(t_end, dl.used() + _TEMPLATES_MIN))
    memo: TopupMemo = {}

    def generator(g: Grouping, deadline: Deadline | None) -> Iterator[Layout]:
        nodes = len({x.node for x in g.odd})
        odd = [x.cls for x in g.odd]
        return template_layouts(ev, hc, len(g.healthy), odd, nodes, problem.dp, deadline, memo)

    # groupings ranked by real layouts (small clusters where one group holds the model) are
    # interleaved a wave at a time, the likeliest first: a grouping joins when one before it
    # has no template left (ranked by group counts alone, under a memory bound, all at once:
    # waves there cost a 64-GPU row 0.3% now and then)
    wave = _WAVE if found else len(groupings)
    waiting = iter(groupings)
    gens = [(g, generator(g, templates_dl)) for g in itertools.islice(waiting, wave)]
    while gens and not templates_dl.expired():
        active = []
        for g, gen in gens:
            batch = list(itertools.islice(gen, 4))
            for lay in batch:
                sc = score_within(ev, templates_dl, lay, False)
                if sc is not None:
                    found.append(Candidate(sc, g))
            if len(batch) == 4:
                active.append((g, gen))
        joining = itertools.islice(waiting, wave - len(active))
        gens = active + [(g, generator(g, templates_dl)) for g in joining]
    if not found:  # past the deadline with nothing: the first layout that fits, at any cost
        found = _first_feasible(problem, ev, groupings, generator)
    found.sort(key=lambda c: c.scored.time)
    debug(f"templates: {len(groupings)} groupings, {ev.evaluations} layouts")
    found = _refine_best(ev, found, small, _refine_dl(dl, t_refined))
    debug(f"refined: {found[0].scored.time if found else None}, {ev.evaluations} layouts")
    parts_dl = dl.until(max(p_end, dl.used() + _PARTITIONS_MIN))
    found.extend(_partition_candidates(problem, ev, found, hc, small, parts_dl))
    found = _refine_best(ev, found, small, _refine_dl(dl, p_refined))
    top = _starts(ev, found, small, dl.share(_RANK_SHARE))
    out = []
    for i, (c, ranked) in enumerate(top):
        # the best start gets half of what is left, the others share the rest
        share = 0.5 if i == 0 else 1.0 / (len(top) - i)
        refine = small or len(c.scored.layout) <= 8
        sc = c.scored
        if dl.expired():
            out.append(Candidate(ranked, c.grouping))
            continue
        if refine and not sc.refined:
            sc = score_within(ev, dl, sc.layout, True) or sc
        stop = _stopper(dl.share(share))
        better = improve(ev, sc, _available(c.grouping), stop, problem.dp, refine=refine)
        if not better.refined and (i == 0 or not dl.expired()):
            better = score_within(ev, dl, better.layout, True) or better
        if ranked.time < better.time:  # the climb's proxy (any-m lines) can mislead it
            better = ranked
        out.append(Candidate(better, c.grouping))
        debug(f"improve: {sc.time:.2f} -> {better.time:.2f}, {ev.evaluations} layouts")
    if out and not dl.expired():
        # time left: kick-and-climb from the best layout found
        out.sort(key=lambda c: c.scored.time)
        c = out[0]
        refine = small or len(c.scored.layout) <= 8
        found_ils = explore(ev, c.scored, _available(c.grouping), _stopper(dl), problem.dp, refine)
        if not found_ils.refined and found_ils is not c.scored:
            found_ils = score_within(ev, dl, found_ils.layout, True) or found_ils
        if found_ils.time < c.scored.time - 1e-9:
            out.insert(0, Candidate(found_ils, c.grouping))
        debug(f"explore: {c.scored.time:.2f} -> {found_ils.time:.2f}, {ev.evaluations} layouts")
    return out


def _refine_dl(dl: Deadline, end: float) -> Deadline:
    """A refinement's deadline: by `end` of the budget, `_REFINE_MIN` at least after now."""
    return dl.until(max(end, dl.used() + _REFINE_MIN))


def _refine_best(
    ev: Evaluator, found: list[Candidate], small: bool, dl: Deadline
) -> list[Candidate]:
    """`found` with the layouts the climbs would refine (small clusters, few distinct
    pipelines) refined while `dl` allows, the likeliest first, and sorted by time.

    Templates and partitions are scored by lines (any-m pipelines, the linear micro-batch
    split), five to ten times cheaper than refined (every pipeline solved again at its own
    micro-batch counts), so the budget reaches every grouping's templates. Lines rank layouts
    with few micro-batches per pipeline badly (the any-m split balances the steady state, and
    the bubble decides: at 64 GPUs with 4 slow GPUs and 32 micro-batches the winner scored 452
    by lines and 370 refined, 266th of 950 by lines), so they are refined in two orders taken
    in turn: by lines and by their floors' estimate (`Evaluator.floor_estimate`; the
    winner there: first); a layout whose floor bound (`Evaluator.floor_bound`) is no better
    than the best time found is not refined at all."""
    out = list(found)
    best = min((c.scored.time for c in found), default=float("inf"))
    todo = []
    for i, c in enumerate(found):
        if c.scored.refined or not (small or len(c.scored.layout) <= 8):
            continue
        bound = ev.floor_bound(c.scored.layout)
        if bound < best - 1e-9:
            todo.append((c.scored.time, ev.floor_estimate(c.scored.layout), bound, i))
    # the two rankings taken in turn: of the random held problems' winners (bench/
    # planner_held.py) the estimate ranked five first and two 5th and 15th, lines one first
    # and the others 26th to 266th; each guards against the other's blind spots
    by_lines = sorted(todo, key=lambda x: (x[0], x[3]))
    by_floor = sorted(todo, key=lambda x: (x[1], x[3]))
    done: set[int] = set()
    for _, _, bound, i in itertools.chain.from_iterable(zip(by_lines, by_floor, strict=True)):
        if dl.expired():
            break
        if i in done or bound >= best - 1e-9:
            continue
        done.add(i)
        sc = score_within(ev, dl, found[i].scored.layout, True)
        if sc is not None:
            out[i] = Candidate(sc, found[i].grouping)
            best = min(best, sc.time)
    out.sort(key=lambda c: c.scored.time)
    return out


def _alone(g: Grouping) -> Layout:
    """Every group of the grouping in a pipeline of its own (one stage each)."""
    return merge(((x.cls,), 1) for x in (*g.healthy, *g.odd))


def _rank_groupings(
    problem: PlanningProblem, ev: Evaluator, groupings: list[Grouping], dl: Deadline
) -> tuple[list[Grouping], list[Candidate]]:
    """The groupings the templates should try first, first; and what ranking them found.

    A small cluster enumerates every combination of its nodes' options (grouping.py): up to
    hundreds of groupings, whose templates a deadline cuts short, and the costliest (many
    single-GPU groups: long pipelines whose stage orders are searched) came first. Ranked by the
    step time of the grouping's simplest layout, every group a one-stage pipeline (a real
    layout, scored exactly, and kept as a candidate), where memory lets one group hold the
    model; then by fewer groups (cheaper templates, fewer stages of bubble); then by speed.
    At 16 GPUs with a node at 2x this took the default search from 1155 to 878 (the optimum
    a long search finds)."""
    found: list[Candidate] = []
    keyed = []
    for i, g in enumerate(groupings):
        t = float("inf")
        lay = _alone(g)
        n = sum(c for _, c in lay)
        if not dl.expired() and (problem.dp is None or problem.dp == n):
            sc = score_within(ev, dl, lay, True)
            if sc is not None:
                found.append(Candidate(sc, g))
                t = sc.time
        speed = sum(x.speed for x in (*g.healthy, *g.odd))
        keyed.append(((t, n, -speed, i), g))
    keyed.sort(key=lambda x: x[0])
    return [g for _, g in keyed], found


def _starts(
    ev: Evaluator, found: list[Candidate], small: bool, dl: Deadline
) -> list[tuple[Candidate, Scored]]:
    """The best `_KEEP` distinct layouts to climb from, each with its best score so far.

    Large layouts are scored on any-m lines (unrefined), which rank them loosely: at 1024
    GPUs (5%) the refined (per-m, exact makespan) time of the 7th best by lines was the best
    by 0.9%.
    So the best `_RANK_POOL` by lines are refined while `dl` allows and ranked by that."""
    pool: list[Candidate] = []
    for c in found:  # found is sorted by time
        if all(c.scored.layout != t.scored.layout for t in pool):
            pool.append(c)
        if len(pool) >= _RANK_POOL:
            break
    # only where the climbs are on lines too (the best start is a large layout): elsewhere the
    # starts are refined already, and refining a few large ones took time from their climbs
    rank = bool(pool) and not (small or len(pool[0].scored.layout) <= 8 or pool[0].scored.refined)
    ranked = []
    for c in pool:
        sc = c.scored
        if rank and not (len(sc.layout) <= 8 or sc.refined) and not dl.expired():
            sc = score_within(ev, dl, sc.layout, True) or sc
        ranked.append((c, sc if sc.time < c.scored.time else c.scored))
    ranked.sort(key=lambda x: x[1].time)
    return ranked[:_KEEP]


def _first_feasible(
    problem: PlanningProblem,
    ev: Evaluator,
    groupings: list[Grouping],
    generator: Callable[[Grouping, Deadline | None], Iterator[Layout]],
) -> list[Candidate]:
    """The first layout that fits, trying groupings in order (no deadline: a plan is owed)."""
    for g in groupings:
        for lay in generator(g, None):
            sc = ev.score(lay, refine=False)
            if sc is not None:
                return [Candidate(sc, g)]
    return []


def _partition_candidates(
    problem: PlanningProblem,
    ev: Evaluator,
    found: list[Candidate],
    hc: Cls,
    small: bool,
    dl: Deadline,
) -> list[Candidate]:
    """Partition layouts for the best few groupings (found sorted by time) with few odd groups."""
    picked: list[Candidate] = []
    for c in found:
        if len(picked) >= _PART_GROUPINGS:
            break
        if all(c.grouping.key != p.grouping.key for p in picked):
            picked.append(c)
    out: list[Candidate] = []
    for c in picked:
        g = c.grouping
        P = problem.dp if problem.dp is not None else c.scored.dp
        if not 2 <= P <= min(len(g.odd), problem.micro_batches) or len(g.odd) > _PART_MAX_ODD:
            continue
        odd = [x.cls for x in g.odd]
        pool = problem.dp is None and len(g.healthy) > 0  # healthy groups alone: more pipelines
        lays = partition_layouts(hc, len(g.healthy), odd, P, problem.layers, pool)
        for lay in itertools.islice(lays, _PART_MAX):
            if dl.expired():
                return out
            sc = score_within(ev, dl, lay, False)
            if sc is not None:
                out.append(Candidate(sc, g))
    debug(f"partitions: {len(picked)} groupings, {ev.evaluations} layouts")
    return out


def debug(msg: str) -> None:
    if os.environ.get("MALLEUS_PLANNER_DEBUG"):
        print(
            f"[planner {time.perf_counter():.2f} cpu {time.thread_time():.2f}] {msg}",
            file=sys.stderr,
        )
