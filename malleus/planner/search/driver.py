"""`plan()`: Malleus's planner search, exact inner solvers, no solver processes.

1. Group every straggler node's GPUs (grouping.py): per node, the fastest grouping for each
   group count (any node may be split, a uniformly slow one included); globally, either every
   combination (small clusters) or one price per extra group (`lam`) that each node trades
   against speed. With many distinct straggling rates the search plans on rates rounded up to
   a 4% geometric grid (`bucketed`), so 800 stragglers are a few dozen classes.
2. On small clusters (up to 64 GPUs), rank the groupings by their simplest layout (every group
   a one-stage pipeline, where memory allows) so that a deadline cuts the least promising.
   For each grouping, score a family of template layouts (templates.py): healthy groups in the
   fewest stages memory allows, odd groups in special pipelines topped up with healthy ones;
   for the best few groupings with few odd groups, also every split of the odd groups over
   the best template's pipeline count (healthy groups to the slowest). Every pipeline is
   solved exactly (layers.py) and micro-batches are split exactly (microbatch.py); symmetric
   pipelines are counted, not enumerated. Layouts are scored on any-m lines first; those
   worth the exact per-m score are refined the likeliest first by their pipelines' floors.
3. Hill-climb the best layouts (localsearch.py), then materialise the best few into ranks
   (materialize.py), keeping groups where the previous plan had them; plans found on bucketed
   rates are re-split (layers, micro-batches) under the true rates (`_polish`).
4. Add the uniform plan and the previous plan (re-split) as candidates; after a bucketed
   search, also the fastest candidate settled under the true rates (settle.py: micro-batches
   split exactly, groups traded into the slowest pipeline). Return the fastest, or among those
   within 1% of it the one that moves the least state.

The budget is one `Deadline` (deadline.py) that every phase consults before each unit of work
(a node grouped, a pipeline solved, a layout scored, a neighbour tried): grouping ends by 35%
of it, templates (scored on lines) by 38% (or 12% after a late grouping) and their refinement
by 52%, partitions by 54% and theirs by 57% (beyond 64 GPUs with more than 16 GPUs
straggling: templates by 50%, partitions by 55%), the climbs share the rest. With many
distinct rates and many stragglers the phases get 84% of it and score pipelines with quick
stage orders; up to 92% of it re-solves the chosen layouts' orders in
full (`_full_orders`). Settling gets `_SETTLE_SHARE` of the budget again, after it. The
default budget is CPU time of the planning thread (`default_budget`); `time_limit` is wall
time. Problems of up to `COMPLETE_UP_TO` GPUs have no budget: their search runs every phase
to its end (a few thousand units of work), so their answer never depends on the clock, the
machine's load or the caller's limit.

Steps 1-3 up to materialising (the phases and their shares of the budget) live in phases.py;
this module holds `plan()` and what surrounds the phases: the budget, rate bucketing, choosing
which layouts to materialise, polishing under the true rates, the final choice and estimate,
and the errors for problems no layout fits.
"""

from __future__ import annotations

import math
import time

from ..cost import (
    ideal_step_time,
    plan_step_time,
    reference_step_time,
    step_time_terms,
    uniform_plan,
)
from ..memory import migration_mb, stage_memory_mb
from ..pace import group_pace, shard_exponent
from ..plan import Estimate, Pipeline, Plan, Stage
from ..problem import MAX_RATE, PlanningProblem, ProblemError
from ..validate import validate_plan
from .deadline import Deadline, cpu_clock, wall_clock
from .evaluate import Evaluator
from .layers import Cls, PipeSolution, solve_pipeline
from .materialize import materialize
from .microbatch import split_linear
from .nodegroups import Group
from .phases import Candidate, score_within, search_layouts
from .previous import previous_variants
from .settle import Solved, settle

__all__ = [
    "BUCKET_ABOVE",
    "BUCKET_STEP",
    "COMPLETE_UP_TO",
    "MIGRATION_SLACK",
    "Deadline",
    "bucketed",
    "default_budget",
    "plan",
    "true_cls",
]

MIGRATION_SLACK = 0.01
"""Plans within this fraction of the best step time compete on migrated state instead."""

COMPLETE_UP_TO = 8
"""Problems of up to this many GPUs are searched to the end, whatever the deadline or time
limit: every phase ends by itself (hill climbs at a local optimum, the kick-and-climb after 40
fruitless kicks, partitions at `phases._PART_MAX` per grouping). Cut by a deadline, the search
returns what its first phases found: the 8-GPU problem of tests/planner/test_search.py came
back at 128 instead of 40 on a loaded machine. Run to the end, the 8-GPU problems tried took
at most 12,000 units of work and 1.5 s of CPU (8 distinct rates, 1,000 layers, a million
micro-batches; 0.05-0.4 s is usual)."""

# Rate buckets: with more distinct straggling rates than this, the search plans with every
# rate rounded up to a geometric grid of this step (so that 800 stragglers are a few dozen
# classes, and nodes with equal rounded rates share their grouping options); the plans it
# finds are then re-split (layers and micro-batches) under the true rates.
BUCKET_ABOVE, BUCKET_STEP = 48, 0.04
# Quick stage orders (layers.best_order `quick`) when the rates are bucketed (many distinct
# ones) and more than this many GPUs straggle: below, layouts have few distinct pipelines and
# full orders are affordable (and the climbs need them to leave plateaus of equal step times).
_QUICK_ABOVE = 128
# quick-order searches end by 84% of the budget; then the winners' orders are re-solved in
# full until 92% (the rest pays for materialising and polishing before settle.py starts)
_QUICK_SEARCH_END, _ORDERS_END = 0.84, 0.92
# settle.py's trades after a bucketed search: this share of the budget again, after it (the
# search's own shares cut instead moved its layouts by up to 7% at 1024 GPUs: it is not
# monotone in its budget)
_SETTLE_SHARE = 0.06
_MATERIALIZE = 2  # without a previous plan, the best few layouts become plans (and polished)


def _worth_materializing(problem: PlanningProblem, found: list[Candidate]) -> list[Candidate]:
    """Distinct layouts that can win: with a previous plan, every one within the migration
    slack of the best (they compete on moved state); without, the best `_MATERIALIZE` and any
    that tie with the best (they compete on GPUs left idle)."""
    found = sorted(found, key=lambda c: c.scored.time)
    out: list[Candidate] = []
    for c in found:
        if any(c.scored.layout == o.scored.layout for o in out):
            continue
        tie = c.scored.time <= found[0].scored.time + 1e-9  # ties compete on idle GPUs
        if problem.previous_plan is None and len(out) >= _MATERIALIZE and not tie:
            continue
        if out and c.scored.time > found[0].scored.time * (1 + 2 * MIGRATION_SLACK) + 1e-9:
            break
        out.append(c)
    return out


def _full_orders(
    problem: PlanningProblem, picked: list[tuple[Candidate, Evaluator]], dl: Deadline
) -> list[tuple[Candidate, Evaluator]]:
    """The layouts a quick-order search picked, re-scored with full stage-order searches
    (`layers.best_order`) while the deadline allows; each keeps the faster of its two scores,
    with the evaluator that scored it (materialising reads that evaluator's pipelines)."""
    full = Evaluator(problem)
    out = []
    for c, ev in picked:
        sc = None if dl.expired() else score_within(full, dl, c.scored.layout, c.scored.refined)
        if sc is not None and sc.time <= c.scored.time + 1e-9:
            out.append((Candidate(sc, c.grouping), full))
        else:
            out.append((c, ev))
    out.sort(key=lambda x: x[0].scored.time)
    return out


def _settled(problem: PlanningProblem, best: Plan, dl: Deadline, solved: Solved) -> Plan | None:
    """settle.py's trades on the fastest plan under the true rates (a bucketed search placed
    its groups by rounded rates), on `_SETTLE_SHARE` of the budget (time and work) again."""
    span = dl.end - dl.start
    work = None if dl.work is None else int(_SETTLE_SHARE * dl.work)
    seconds = _SETTLE_SHARE * span if math.isfinite(span) else math.inf
    own = Deadline(seconds, clock=dl.clock, work=work)

    def stop() -> bool:
        own.spend()
        return own.expired()

    return settle(problem, best, lambda ranks: true_cls(problem, ranks), stop, solved)


def default_budget(world: int) -> float:
    """Search CPU seconds when no time_limit is given: 0.6 s up to 64 GPUs, 0.7 s at 1024,
    ~3.7 s at 4096, ~7.7 s at 8192, so that the whole plan() call (the search, then
    materialising, validating and scoring a few plans) stays within 1 s at 1024 GPUs and 10 s
    at 8192 whatever the spread of the stragglers (docs/benchmarks.md, "Planner spread")."""
    if world <= 1024:
        return 0.6 + 0.0001 * max(0, world - 64)
    # beyond 1024 GPUs the settling after the search (`_SETTLE_SHARE` more) and materialising
    # grow with the world: 8192 GPUs at 5% took 10.0 s in all with 0.00105 s per GPU
    return 0.696 + 0.00098 * (world - 1024)


def bucketed(problem: PlanningProblem) -> PlanningProblem:
    """The problem the search plans on: rates rounded up to a geometric grid when many differ."""
    distinct = {v for v in problem.rates.values() if v is not None and v != 1.0}
    if len(distinct) <= BUCKET_ABOVE:
        return problem
    step = math.log1p(BUCKET_STEP)

    def up(v: float) -> float:
        q = math.exp(math.ceil(math.log(v) / step - 1e-9) * step)
        return max(v, min(q, MAX_RATE))

    rates = {
        r: (None if v is None else (1.0 if v == 1.0 else up(v))) for r, v in problem.rates.items()
    }
    return problem.model_copy(update={"rates": rates})


def true_cls(problem: PlanningProblem, ranks: list[int]) -> Cls:
    """A group's class under the problem's own rates (as grouping.Group.cls builds it)."""
    node = problem.node_of(ranks[0])
    k = shard_exponent(problem.tp, len(ranks))
    return Group(tuple(ranks), node, k, group_pace(problem, ranks), problem.link_rate(node)).cls


def _polish(problem: PlanningProblem, plan: Plan, solved: Solved) -> list[Plan]:
    """The plan's stages kept, layers re-split under the true rates: at each pipeline's own
    micro-batch count, and (when every pipeline fits with any count) with the micro-batches
    re-split too. The caller scores both with the cost model; `solved` keeps every pipeline
    solved (settle.py starts from one of these plans)."""
    kept: list[Pipeline] = []
    lines: list[tuple[float, float, int]] = []
    any_sols: list[PipeSolution] = []
    for p in plan.pipelines:
        ranks = [list(s.ranks) for s in p.stages]
        order = [true_cls(problem, r) for r in ranks]
        if any(not math.isfinite(c[0]) for c in order):
            return []
        at_m = solved[(tuple(order), p.micro_batches)] = solve_pipeline(
            problem, order, p.micro_batches, order
        )
        if at_m is None:
            return []
        kept.append(Pipeline(micro_batches=p.micro_batches, stages=_stages(ranks, at_m)))
        any_m = solved[(tuple(order), None)] = solve_pipeline(problem, order, None, order)
        if any_m is not None:
            any_sols.append(any_m)
            lines.append((any_m.bottleneck, any_m.fill, 1))
    out = [Plan(tp=plan.tp, pipelines=kept, excluded=list(plan.excluded))]
    if len(any_sols) == len(kept):
        res = split_linear(lines, problem.micro_batches)
        if res is not None:
            resplit = [
                Pipeline(micro_batches=m + up, stages=_stages([s.ranks for s in p.stages], sol))
                for p, sol, (m, up) in zip(kept, any_sols, res[1], strict=True)
            ]
            out.append(Plan(tp=plan.tp, pipelines=resplit, excluded=list(plan.excluded)))
    return out


def _stages(ranks: list[list[int]], sol: PipeSolution) -> list[Stage]:
    stages, start = [], 0
    for r, n in zip(ranks, sol.layers, strict=True):
        stages.append(Stage(ranks=list(r), layers=(start, start + n)))
        start += n
    return stages


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
    plan.failed = [r for r in range(problem.world) if problem.rate(r) is None]
    ref = reference_step_time(problem)  # inf when no static layout fits even when healthy
    cal = problem.calibration
    terms = step_time_terms(problem, plan) if cal is not None else None
    plan.estimate = Estimate(
        step_time=terms.total if terms is not None else plan_step_time(problem, plan),
        terms=terms.as_dict() if terms is not None else None,
        step_seconds=terms.total * cal.layer_seconds if terms is not None and cal else None,
        uniform_step_time=uni,
        ideal_step_time=ideal_step_time(problem),
        reference_step_time=ref if math.isfinite(ref) else None,
        migration_mb=migration_mb(problem, prev, plan),
        planning_seconds=time.perf_counter() - t0,
    )
    return plan


def plan(
    problem: PlanningProblem,
    *,
    time_limit: float | None = None,
    deadline: Deadline | None = None,
) -> Plan:
    """The fastest layout the search finds (never slower than uniform), with its estimate.

    `time_limit` bounds the search and the settling after it (wall seconds) strictly; it
    returns the best plan found so far. Without it the
    search gets `default_budget(world)` seconds of the planning thread's CPU time, so a busy
    machine slows the planner down rather than changing its answer much (callers that need a
    wall-time bound, like the controller, pass `time_limit`). `deadline` (tests, callers with
    their own clock or a work budget) replaces both. Every phase honours the deadline; what runs
    after it (materialising a few plans, scoring the uniform and previous plans) is bounded.
    Problems of up to `COMPLETE_UP_TO` GPUs ignore all three: their search always runs to its
    end, so the same problem gets the same plan on any machine under any limit.
    Raises ProblemError when no layout fits in memory.
    """
    t0 = time.perf_counter()
    faults = _shape_faults(problem)
    if faults:
        raise ProblemError(faults)
    if problem.world <= COMPLETE_UP_TO:
        dl = Deadline()  # no clock, no work bound: every phase runs to its end
    elif deadline is not None:
        dl = deadline
    elif time_limit is not None:  # the settling after it fits in the limit too
        dl = Deadline(time_limit / (1 + _SETTLE_SHARE), clock=wall_clock)
    else:
        dl = Deadline(default_budget(problem.world), clock=cpu_clock)
    sp = bucketed(problem)
    # Many distinct rates: thousands of distinct pipelines, each a stage-order search. The
    # search takes the load heuristic's orders (ten times cheaper, so it scores ten times the
    # layouts) and the layouts worth materialising are re-solved with full orders at the end.
    quick = sp is not problem and sum(1 for v in problem.rates.values() if v != 1.0) > _QUICK_ABOVE
    ev = Evaluator(sp, quick_orders=quick)
    found_layouts = search_layouts(sp, ev, dl.until(_QUICK_SEARCH_END) if quick else dl)
    picked = [(c, ev) for c in _worth_materializing(problem, found_layouts)]
    if quick:
        picked = _full_orders(sp, picked, dl.until(_ORDERS_END))
    cands: list[Plan] = []
    solved: Solved = {}
    for c, c_ev in picked:
        found = materialize(sp, c_ev, c.scored, c.grouping)
        cands.append(found)
        if sp is not problem:
            cands.extend(_polish(problem, found, solved))
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
    if scored and sp is not problem:
        settled = _settled(problem, min(scored, key=lambda x: x[0])[2], dl, solved)
        if settled is not None and not validate_plan(problem, settled):
            t = plan_step_time(problem, settled)
            if t < min(x[0] for x in scored) - 1e-9:
                scored.append((t, migration_mb(problem, problem.previous_plan, settled), settled))
    if not scored:
        if problem.memory is not None:
            raise _memory_error(problem)
        raise ProblemError(["no layout found (no usable pipeline could be formed)"])
    best_t = min(t for t, _, _ in scored)
    near = [x for x in scored if x[0] <= best_t * (1 + MIGRATION_SLACK) + 1e-9]
    # least migration, then fastest, then fewest idle GPUs (nothing sits out without reason)
    _, _, chosen = min(near, key=lambda x: (x[1], x[0], len(x[2].excluded)))
    return _finish(problem, chosen.model_copy(deep=True), t0, uni_time)
