"""The exact inner solvers against brute force: layer split, micro-batch split, node grouping."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from malleus.planner import PlanningProblem
from malleus.planner.search.layersplit import split_layers
from malleus.planner.search.microbatch import greedy_split, split_linear
from malleus.planner.search.nodegroups import all_node_options, node_options


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    return [
        tuple(b - a for a, b in itertools.pairwise((0, *cuts, total)))
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


paces = st.lists(st.sampled_from([1.0, 1.5, 1.9, 2.0, 3.0, 3.66, 7.22]), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(paces, st.integers(1, 12), st.data())
def test_min_bottleneck_split_is_exact(ys: list[float], L: int, data: st.DataObject) -> None:
    caps = [data.draw(st.integers(0, L)) for _ in ys]
    got = split_layers(ys, caps, L, None)
    splits = (
        [
            c
            for c in compositions(L, len(ys))
            if all(n <= cap for n, cap in zip(c, caps, strict=True))
        ]
        if len(ys) <= L
        else []
    )
    if not splits:
        assert got is None
        return
    assert got is not None
    best_b = min(max(y * n for y, n in zip(ys, c, strict=True)) for c in splits)
    best_s = min(
        sum(y * n for y, n in zip(ys, c, strict=True))
        for c in splits
        if max(y * n for y, n in zip(ys, c, strict=True)) <= best_b + 1e-9
    )
    ls, b, s = got
    assert sum(ls) == L and all(1 <= n <= cap for n, cap in zip(ls, caps, strict=True))
    assert math.isclose(b, best_b) and math.isclose(s, best_s)


@settings(max_examples=150, deadline=None)
@given(paces, st.integers(1, 10), st.integers(1, 4))
def test_bubble_aware_split_is_exact_with_few_micro_batches(
    ys: list[float], L: int, m: int
) -> None:
    if len(ys) > L:
        return
    caps = [L] * len(ys)
    got = split_layers(ys, caps, L, m)
    assert got is not None
    best = min(
        (m - 1) * max(y * n for y, n in zip(ys, c, strict=True))
        + sum(y * n for y, n in zip(ys, c, strict=True))
        for c in compositions(L, len(ys))
    )
    _, b, s = got
    assert math.isclose((m - 1) * b + s, best)


lines = st.lists(
    st.tuples(
        st.sampled_from([1.0, 2.5, 3.0, 7.0]), st.sampled_from([2.0, 5.0, 9.0]), st.integers(1, 3)
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=150, deadline=None)
@given(lines, st.integers(1, 10))
def test_micro_batch_split_is_exact(classes: list[tuple[float, float, int]], B: int) -> None:
    pipes = [(b, s) for b, s, c in classes for _ in range(c)]
    got = split_linear(classes, B)
    if len(pipes) > B:
        assert got is None
        return
    best = min(
        max((m - 1) * b + s for (b, s), m in zip(pipes, ms, strict=True))
        for ms in compositions(B, len(pipes))
    )
    assert got is not None
    T, levels = got
    assert math.isclose(T, best)
    assert sum(c * m + up for (_, _, c), (m, up) in zip(classes, levels, strict=True)) == B


def test_greedy_split_with_a_pipeline_that_cannot_take_many() -> None:
    # pipeline 1 fits only 2 micro-batches in memory: the rest must go to pipeline 0
    times = [lambda m: 3.0 * m, lambda m: 2.0 * m if m <= 2 else math.inf]
    T, levels = greedy_split(times, [1, 1], 7) or (None, None)
    assert T == 15.0 and levels == [(5, 0), (2, 0)]


def test_node_options_are_pareto_and_valid() -> None:
    p = PlanningProblem.load(
        {
            "nodes": 1,
            "gpus_per_node": 8,
            "rates": {"1": 3.0, "6": None},
            "model": {"layers": 8, "tp": 4, "alpha": [1.0, 1.9, 3.66]},
            "micro_batches": 8,
        }
    )
    opts = node_options(p, 0)
    every = all_node_options(p, 0)
    for o in opts:
        used = [r for g in o.groups for r in g.ranks]
        assert sorted(used + list(o.excluded)) == [0, 1, 2, 3, 4, 5, 7]
        assert all(len(g.ranks) in (1, 2, 4) for g in o.groups)
    # nothing in the full enumeration is strictly better on all four criteria
    for e in every:
        assert any(
            o.count <= e.count
            and o.speed >= e.speed - 1e-9
            and o.gpus >= e.gpus
            and o.slowest <= e.slowest + 1e-9
            for o in opts
        )
    # the failed GPU never appears, and a straggler-free full group of 4 is an option
    assert any(any(len(g.ranks) == 4 and g.y == 1.0 for g in o.groups) for o in opts)
