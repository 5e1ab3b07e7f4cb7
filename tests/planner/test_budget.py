"""The planning budget is a deadline every phase honours (issue 13): asserted on counted work.

The clock here is the planner's own work: every pipeline solve and layout score advances it, so
"how much work happened after the deadline" is a count, not a timing, and a busy machine cannot
make these tests flaky.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import Any

import pytest

from malleus.planner import PlanningProblem, default_budget, plan, validate_plan
from malleus.planner.search import deadline, evaluate
from malleus.planner.search.deadline import Deadline, cpu_clock
from malleus.planner.search.driver import BUCKET_STEP, COMPLETE_UP_TO, bucketed
from malleus.planner.search.evaluate import Evaluator
from tests.planner.setting_70b import problem_70b


def spread(world: int, share: float, seed: int = 0) -> PlanningProblem:
    """The 70B setting at `world` GPUs with `share` of them straggling at 1.2-3x."""
    rng = random.Random(seed)
    n = max(1, round(world * share))
    rates = {r: round(rng.uniform(1.2, 3.0), 2) for r in rng.sample(range(world), n)}
    return problem_70b(world, rates=rates)


class WorkClock:
    """A clock that ticks once per pipeline solved (stage order, layer split) and per layout
    scored: the planner's real units of work, patched into the evaluator."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ticks = 0

        def counted(f: Any) -> Any:
            def g(*args: Any, **kw: Any) -> Any:
                self.ticks += 1
                return f(*args, **kw)

            return g

        for name in ("best_order", "solve_pipeline"):
            monkeypatch.setattr(evaluate, name, counted(getattr(evaluate, name)))
        monkeypatch.setattr(Evaluator, "score", counted(Evaluator.score))

    def __call__(self) -> float:
        return float(self.ticks)


def test_deadline_children_never_outlive_their_parent() -> None:
    now = [0.0]
    dl = Deadline(10.0, clock=lambda: now[0], work=100)
    half = dl.until(0.5)
    assert not half.expired()
    now[0] = 5.0
    assert half.expired() and not dl.expired()
    share = dl.share(0.5)  # half of the 5 s left
    now[0] = 7.4
    assert not share.expired()
    now[0] = 7.6
    assert share.expired()
    # work: a child spends its parent's units too, and ends when the parent's run out
    child = dl.share(1.0)
    child.spend(100)
    assert dl.work_done == 100 and dl.expired() and child.expired()
    # once expired, always expired (a phase asking again does not restart)
    now[0] = 0.0
    assert dl.expired()


def test_work_budget_alone_stops_the_search() -> None:
    dl = Deadline(work=5)
    for _ in range(5):
        assert not dl.expired()
        dl.spend()
    assert dl.expired()
    assert math.isinf(Deadline().left())


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_every_phase_stops_at_the_deadline(monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    # 512 GPUs with many stragglers, a deadline of 150 ticks of the work clock: every phase
    # asks before each unit of work (a node, a pipeline, a layout, a neighbour), so the
    # overrun is a few units, not the thousands a search left to run does
    p = spread(512, share)
    clock = WorkClock(monkeypatch)
    dl = Deadline(150.0, clock=clock)
    result = plan(p, deadline=dl)
    assert validate_plan(p, result) == []
    assert dl.expired()
    assert clock.ticks <= 150 + 100, clock.ticks
    # the same search with ten times the work does far more: the deadline is what stopped it
    clock.ticks = 0
    plan(p, deadline=Deadline(work=1500))
    assert clock.ticks > 2 * (150 + 100), clock.ticks


def test_the_deadline_is_checked_inside_the_grouping_enumeration() -> None:
    # an expired deadline before grouping: every node keeps full groups, one grouping comes
    # back, and a valid plan still does
    p = spread(512, 0.5)
    dl = Deadline(work=0)
    result = plan(p, deadline=dl)
    assert validate_plan(p, result) == []
    assert result.estimate is not None and result.estimate.uniform_step_time is not None
    assert result.estimate.step_time <= result.estimate.uniform_step_time


def test_a_work_budget_gives_the_same_plan_on_any_machine() -> None:
    p = spread(256, 0.2, seed=3)
    a = plan(p, deadline=Deadline(work=400))
    b = plan(p, deadline=Deadline(work=400))
    assert a.estimate is not None and b.estimate is not None
    assert a.estimate.step_time == b.estimate.step_time
    assert [q.micro_batches for q in a.pipelines] == [q.micro_batches for q in b.pipelines]


def test_default_budget_meets_the_targets() -> None:
    # issue 13: <= 1 s at 1024 GPUs, <= 10 s at 8192, whatever the spread; the budget leaves
    # room for what runs after the search (materialising, validating, scoring)
    assert default_budget(64) <= 0.6 + 1e-9
    assert default_budget(1024) <= 0.9
    assert default_budget(8192) <= 9.0
    assert all(default_budget(w) <= default_budget(2 * w) for w in (8, 64, 1024, 4096))


def test_many_distinct_rates_are_bucketed_upwards() -> None:
    p = spread(1024, 0.2)
    sp = bucketed(p)
    assert sp is not p
    assert all(sp.rates[r] >= v for r, v in p.rates.items() if v is not None)
    assert all(sp.rates[r] <= v * (1 + BUCKET_STEP) + 1e-9 for r, v in p.rates.items() if v)
    assert len(set(sp.rates.values())) < len(set(p.rates.values())) / 3
    few = spread(64, 0.05)
    assert bucketed(few) is few  # few distinct rates: planned as they are


def test_bucketed_search_is_scored_with_the_true_rates() -> None:
    p = spread(512, 0.5, seed=1)
    result = plan(p, deadline=Deadline(work=600))
    assert validate_plan(p, result) == []
    from malleus.planner import plan_step_time

    assert result.estimate is not None
    assert result.estimate.step_time == pytest.approx(plan_step_time(p, result))


class OpClock:
    """A clock that ticks once per call of the search's costly arithmetic: a layer split's
    greedy fill and trim, a 1F1B makespan, a micro-batch count, a node's grouping DP, a
    grouping policy. Unlike WorkClock (one tick per pipeline solved, however it is solved),
    it charges a stage-order search for every order it tries, so a cheaper way to the same
    layouts shows as a search that gets further on the same budget: a stand-in for CPU time
    that no load can move."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from malleus.planner import schedule
        from malleus.planner.search import grouping, layers, layersplit, microbatch, nodegroups

        self.ticks = 0
        schedule._pipeline_time_cached.cache_clear()  # cached makespans would not tick
        targets = (
            (layers, "min_bottleneck"),
            (layers, "fill_at"),
            (layersplit, "min_bottleneck"),
            (layersplit, "fill_at"),
            (schedule, "_one_f_one_b"),
            (microbatch, "line_count"),
            (nodegroups, "_grouping_dp"),
            (grouping, "choose_grouping"),
        )
        for mod, name in targets:
            f = getattr(mod, name)

            def g(*args: Any, _f: Any = f, **kw: Any) -> Any:
                self.ticks += 1
                return _f(*args, **kw)

            monkeypatch.setattr(mod, name, g)

    def __call__(self) -> float:
        return float(self.ticks)


def test_many_stragglers_reach_a_long_search_on_a_short_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # issue 13: with half the GPUs straggling (hundreds of distinct pipelines, a stage-order
    # search each) a budget of about the default's CPU time (6000 ticks of the op clock)
    # must come within 0.5% of five times as much. The search as it was reached 1152.8
    # against 1141.5 here (1% short): every pipeline paid for a full stage-order search and
    # the climbs ran out of budget.
    p = spread(512, 0.5)
    clock = OpClock(monkeypatch)
    short = plan(p, deadline=Deadline(6000.0, clock=clock))
    clock.ticks = 0
    long = plan(p, deadline=Deadline(30000.0, clock=clock))
    assert validate_plan(p, short) == [] and validate_plan(p, long) == []
    assert short.estimate is not None and long.estimate is not None
    assert short.estimate.step_time <= long.estimate.step_time * 1.005


SMALL = {
    # the problem of test_search's severe straggler: cut early, it came back at 128 (only ranks
    # 4 and 5 working) or 64 instead of 40
    "2x4 tp2 one 8x": {"nodes": 2, "gpus_per_node": 4, "rates": {"1": 8.0}},
    "1x4 tp2 two 3x": {
        "nodes": 1,
        "gpus_per_node": 4,
        "rates": {"0": 3.0, "2": 3.0},
        "model": {"layers": 4, "tp": 2},
        "micro_batches": 4,
    },
    "8x1 tp1 spread": {
        "nodes": 8,
        "gpus_per_node": 1,
        "rates": {"3": 5.0, "4": 1.5, "6": 2.2},
        "model": {"layers": 24, "tp": 1},
        "micro_batches": 24,
    },
    "1x8 tp1 failed + slow": {
        "nodes": 1,
        "gpus_per_node": 8,
        "rates": {"1": 3.0, "5": 1.7, "6": None},
        "model": {"layers": 16, "tp": 1},
        "micro_batches": 32,
    },
    "4x2 tp2 memory": {
        "nodes": 4,
        "gpus_per_node": 2,
        "rates": {"2": 2.0, "5": 1.86, "3": 100.0},
        "model": {"layers": 16, "tp": 2},
        "micro_batches": 8,
        "memory": {"capacity_mb": 1000, "layer_mb": 100, "activation_mb": 20, "embedding_mb": 100},
    },
}


@pytest.mark.parametrize("name", list(SMALL))
def test_a_small_problem_gets_its_plan_under_any_budget(name: str) -> None:
    # issue 28: up to COMPLETE_UP_TO GPUs the search runs to its end whatever it is given, so
    # a budget spent at once (a loaded machine, a stale clock, a tiny limit) and an endless
    # one give the same plan. Cut at work 0, the search as it was returned the uniform plan.
    data = {"model": {"layers": 8, "tp": 2}, "micro_batches": 16, **SMALL[name]}
    p = PlanningProblem.load(data)
    assert p.world <= COMPLETE_UP_TO
    full = plan(p, deadline=Deadline(work=10**9))
    assert validate_plan(p, full) == []
    for cut in (
        {"deadline": Deadline(work=0)},
        {"deadline": Deadline(0.0, clock=cpu_clock)},
        {"time_limit": 1e-9},
    ):
        got = plan(p, **cut)
        assert got.model_dump(exclude={"estimate"}) == full.model_dump(exclude={"estimate"}), cut
        assert got.estimate is not None and full.estimate is not None
        assert got.estimate.step_time == full.estimate.step_time
    if name == "2x4 tp2 one 8x":
        assert full.estimate.step_time == 40.0


def test_a_cpu_deadline_starts_from_a_fresh_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU clock caches its reading between reads. A deadline that started from the cached
    # reading counted the CPU used since then (another test's work) against its own budget.
    wall, cpu = [0.0], [100.0]

    def thread_time() -> float:
        wall[0] += 1.0  # a read preempted for a second on a loaded machine
        return cpu[0]

    fake = SimpleNamespace(perf_counter=lambda: wall[0], thread_time=thread_time)
    monkeypatch.setattr(deadline, "time", fake)
    monkeypatch.setattr(deadline._clocks, "clock", deadline._CpuClock(), raising=False)
    assert cpu_clock() == 100.0
    # one slow read does not stretch the interval to five times its length
    assert deadline._local_clock().every == 0.1
    cpu[0] = 100.5  # the caller's work, within the read interval
    assert cpu_clock() == 100.0  # the cached reading
    dl = Deadline(0.6, clock=cpu_clock)
    assert dl.start == 100.5 and dl.end == pytest.approx(101.1)
    assert not dl.expired()
