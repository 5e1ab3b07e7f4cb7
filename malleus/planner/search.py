"""`plan()`: Malleus's planner search (DESIGN §5), exact inner solvers, no solver processes.

1. Group every straggler node's GPUs (grouping.py): per node, the fastest grouping for each
   group count; globally, either every combination (small clusters) or one price per extra
   group (`lam`) that each node trades against speed.
2. For each grouping, score a family of template layouts (templates.py): healthy groups in the
   fewest stages memory allows, odd groups in special pipelines topped up with healthy ones;
   for the best few groupings with few odd groups, also every split of the odd groups over
   the best template's pipeline count (healthy groups to the slowest). Every pipeline is solved exactly (layers.py) and micro-batches are split exactly
   (microbatch.py); symmetric pipelines are counted, not enumerated.
3. Hill-climb the best layouts (localsearch.py), then materialise a few into ranks
   (materialize.py), keeping groups where the previous plan had them.
4. Add the uniform plan and the previous plan (re-split) as candidates, and return the fastest,
   or among those within 1% of it the one that moves the least state.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .cost import (
    ideal_step_time,
    migration_mb,
    plan_step_time,
    reference_step_time,
    stage_memory_mb,
    uniform_plan,
)
from .evaluate import Evaluator, Scored
from .grouping import Grouping, candidate_groupings
from .layers import Cls
from .localsearch import explore, improve
from .materialize import materialize
from .plan import Estimate, Plan
from .previous import previous_variants
from .problem import PlanningProblem, ProblemError
from .templates import partition_layouts, template_layouts
from .validate import validate_plan

__all__ = ["MIGRATION_SLACK", "default_budget", "plan"]

MIGRATION_SLACK = 0.01
"""Plans within this fraction of the best step time compete on migrated state instead."""

_KEEP = 6  # best distinct template layouts that get a hill climb
# Without a time limit, at least this many layouts are scored before a deadline can cut the
# templates (resp. each hill climb) short: the answer does not depend on the machine's load.
_FLOOR_TEMPLATES, _FLOOR_CLIMB = 1500, 400
# Partition layouts (templates.partition_layouts): for the best few groupings with at most this
# many odd groups, every split of them over as many pipelines as their best template has.
_PART_GROUPINGS, _PART_MAX_ODD, _PART_MAX = 3, 10, 1500


@dataclass
class _Candidate:
    scored: Scored
    grouping: Grouping


def _available(g: Grouping) -> Counter[Cls]:
    return Counter(x.cls for x in (*g.healthy, *g.odd))


@dataclass
class _Clock:
    """When to stop: at deadlines, but without an explicit time limit only after a floor of
    work, so that a busy machine slows the planner down instead of changing its answer."""

    ev: Evaluator
    strict: bool

    def stopper(self, deadline: float, floor: int) -> Callable[[], bool]:
        least = self.ev.evaluations + floor

        def stop() -> bool:
            if time.perf_counter() < deadline:
                return False
            return self.strict or self.ev.evaluations >= least

        return stop


def _search(
    problem: PlanningProblem, ev: Evaluator, t0: float, budget: float, strict: bool
) -> list[_Candidate]:
    """Templates for every grouping (interleaved, half the budget), then hill climbing."""
    clock = _Clock(ev, strict)
    groupings = candidate_groupings(problem)
    small = problem.world <= 64
    hc: Cls = (problem.model.alpha_at(0), 0)
    gens = []
    for g in groupings:
        nodes = len({x.node for x in g.odd})
        odd = [x.cls for x in g.odd]
        gens.append((g, template_layouts(ev, hc, len(g.healthy), odd, nodes, problem.dp)))
    found: list[_Candidate] = []
    templates_done = clock.stopper(t0 + 0.5 * budget, _FLOOR_TEMPLATES)
    while gens and (not templates_done() or not found):
        active = []
        for g, gen in gens:
            batch = list(itertools.islice(gen, 4))
            for lay in batch:
                sc = ev.score(lay, refine=small or len(lay) <= 8)
                if sc is not None:
                    found.append(_Candidate(sc, g))
            if len(batch) == 4:
                active.append((g, gen))
        gens = active
    found.sort(key=lambda c: c.scored.time)
    _debug(f"templates: {len(groupings)} groupings, {ev.evaluations} layouts")
    found.extend(_partition_candidates(problem, ev, found, hc, small, clock, t0 + 0.6 * budget))
    found.sort(key=lambda c: c.scored.time)
    top: list[_Candidate] = []
    for c in found:
        if all(c.scored.layout != t.scored.layout for t in top):
            top.append(c)
        if len(top) >= _KEEP:
            break
    out = []
    deadline = t0 + budget
    for i, c in enumerate(top):
        # the best start gets half of what is left, the others share the rest
        left = deadline - time.perf_counter()
        share = 0.5 if i == 0 else 1.0 / (len(top) - i)
        refine = small or len(c.scored.layout) <= 8
        sc = c.scored
        if refine and not sc.refined:
            sc = ev.score(sc.layout, refine=True) or sc
        stop = clock.stopper(time.perf_counter() + max(0.0, left) * share, _FLOOR_CLIMB)
        better = improve(ev, sc, _available(c.grouping), stop, problem.dp, refine=refine)
        if not better.refined:
            better = ev.score(better.layout, refine=True) or better
        out.append(_Candidate(better, c.grouping))
        _debug(f"improve: {sc.time:.2f} -> {better.time:.2f}, {ev.evaluations} layouts")
    if out:
        # time left: kick-and-climb from the best layout found
        out.sort(key=lambda c: c.scored.time)
        c = out[0]
        refine = small or len(c.scored.layout) <= 8
        stop = clock.stopper(deadline, _FLOOR_CLIMB)
        found_ils = explore(ev, c.scored, _available(c.grouping), stop, problem.dp, refine)
        if not found_ils.refined:
            found_ils = ev.score(found_ils.layout, refine=True) or found_ils
        if found_ils.time < c.scored.time - 1e-9:
            out.insert(0, _Candidate(found_ils, c.grouping))
        _debug(f"explore: {c.scored.time:.2f} -> {found_ils.time:.2f}, {ev.evaluations} layouts")
    return out


def _partition_candidates(
    problem: PlanningProblem,
    ev: Evaluator,
    found: list[_Candidate],
    hc: Cls,
    small: bool,
    clock: _Clock,
    deadline: float,
) -> list[_Candidate]:
    """Partition layouts for the best few groupings (found sorted by time) with few odd groups."""
    picked: list[_Candidate] = []
    for c in found:
        if len(picked) >= _PART_GROUPINGS:
            break
        if all(c.grouping.key != p.grouping.key for p in picked):
            picked.append(c)
    # without a time limit every partition is scored (at most the cap): load-independent
    stop = clock.stopper(deadline, _PART_GROUPINGS * _PART_MAX)
    out: list[_Candidate] = []
    for c in picked:
        g = c.grouping
        P = problem.dp if problem.dp is not None else c.scored.dp
        if not 2 <= P <= min(len(g.odd), problem.micro_batches) or len(g.odd) > _PART_MAX_ODD:
            continue
        odd = [x.cls for x in g.odd]
        lays = partition_layouts(hc, len(g.healthy), odd, P, problem.layers)
        for lay in itertools.islice(lays, _PART_MAX):
            if stop():
                return out
            sc = ev.score(lay, refine=small or len(lay) <= 8)
            if sc is not None:
                out.append(_Candidate(sc, g))
    _debug(f"partitions: {len(picked)} groupings, {ev.evaluations} layouts")
    return out


def default_budget(world: int) -> float:
    """Search seconds when no time_limit is given: ~0.6 s at 64 GPUs, ~25 s at 4096."""
    return 0.6 + 0.006 * max(0, world - 64)


def _debug(msg: str) -> None:
    if os.environ.get("MALLEUS_PLANNER_DEBUG"):
        print(f"[planner {time.perf_counter():.2f}] {msg}", file=sys.stderr)


def _least_peak(problem: PlanningProblem, S: int, m: int) -> float:
    """Least per-GPU peak (MB) of any split of the layers over S full groups (bisection)."""
    mem = problem.memory
    assert mem is not None
    L = problem.layers

    def fits(peak: float) -> bool:
        total = 0
        for j in range(S):
            ends = mem.embedding_mb * (int(j == 0) + int(j == S - 1))
            per = mem.layer_mb + mem.activation_mb * min(S - j, m)
            room = peak - mem.fixed_mb - ends
            if room < per - 1e-9:
                return False  # not even one layer
            total += L if per <= 0 else math.floor(room / per + 1e-9)
        return total >= L

    lo, hi = 0.0, stage_memory_mb(problem, 1, L, S, 0, m) + mem.embedding_mb + 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _memory_error(problem: PlanningProblem) -> ProblemError:
    """No layout fits: say how far the most frugal one (full groups, best depth) is."""
    mem = problem.memory
    assert mem is not None
    dp = problem.dp or 1
    depth = max(1, len(problem.usable_ranks()) // problem.tp // dp)
    m = -(-problem.micro_batches // dp)
    need, S = min((_least_peak(problem, S, m), S) for S in range(1, min(depth, problem.layers) + 1))
    lo, hi = problem.layers // S, -(-problem.layers // S)
    layers = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return ProblemError(
        [
            f"memory: no layout fits; the smallest per-GPU need is {need:.0f} MB with {S} "
            f"stages of {layers} layers (full TP groups of {problem.tp}, {m} micro-batches "
            f"per pipeline), capacity {mem.capacity_mb:.0f} MB"
        ]
    )


def _shape_faults(problem: PlanningProblem) -> list[str]:
    """Faults no search can fix: more pinned pipelines than micro-batches or usable GPUs."""
    out = []
    usable = len(problem.usable_ranks())
    if problem.dp is not None and problem.dp > problem.micro_batches:
        out.append(
            f"dp: {problem.dp} pipelines need at least {problem.dp} micro-batches; the step "
            f"has {problem.micro_batches}"
        )
    if problem.dp is not None and problem.dp > usable:
        out.append(f"dp: {problem.dp} pipelines need at least {problem.dp} usable GPUs; {usable}")
    return out


def _finish(problem: PlanningProblem, plan: Plan, t0: float, uni: float | None) -> Plan:
    prev = problem.previous_plan
    plan.generation = prev.generation + 1 if prev is not None else 0
    ref = reference_step_time(problem)  # inf when no static layout fits even when healthy
    plan.estimate = Estimate(
        step_time=plan_step_time(problem, plan),
        uniform_step_time=uni,
        ideal_step_time=ideal_step_time(problem),
        reference_step_time=ref if math.isfinite(ref) else None,
        migration_mb=migration_mb(problem, prev, plan),
        planning_seconds=time.perf_counter() - t0,
    )
    return plan


def plan(problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
    """The fastest layout the search finds (never slower than uniform), with its estimate.

    `time_limit` bounds the search (seconds) strictly; it returns the best plan found so far.
    Without it the search gets `default_budget(world)` seconds, but never less than a fixed
    amount of work, so the same problem gets the same plan on a busy machine.
    Raises ProblemError when no layout fits in memory.
    """
    t0 = time.perf_counter()
    faults = _shape_faults(problem)
    if faults:
        raise ProblemError(faults)
    budget = time_limit if time_limit is not None else default_budget(problem.world)
    ev = Evaluator(problem)
    cands: list[Plan] = []
    for c in _search(problem, ev, t0, budget, strict=time_limit is not None):
        cands.append(materialize(problem, ev, c.scored, c.grouping))
    uni_plan = uniform_plan(problem)
    uni_time: float | None = None
    if uni_plan is not None and not validate_plan(problem, uni_plan):
        uni_time = plan_step_time(problem, uni_plan)
        if math.isfinite(uni_time):
            cands.append(uni_plan)
        else:
            uni_time = None
    cands.extend(previous_variants(problem, ev))
    scored = []
    for p in cands:
        if validate_plan(problem, p):
            continue
        t = plan_step_time(problem, p)
        if uni_time is not None and t > uni_time + 1e-9:
            continue
        scored.append((t, migration_mb(problem, problem.previous_plan, p), p))
    if not scored:
        if problem.memory is not None:
            raise _memory_error(problem)
        raise ProblemError(["no layout found (no usable pipeline could be formed)"])
    best_t = min(t for t, _, _ in scored)
    near = [x for x in scored if x[0] <= best_t * (1 + MIGRATION_SLACK) + 1e-9]
    # least migration, then fastest, then fewest idle GPUs (nothing sits out without reason)
    _, _, chosen = min(near, key=lambda x: (x[1], x[0], len(x[2].excluded)))
    return _finish(problem, chosen.model_copy(deep=True), t0, uni_time)
