"""Splitting a uniformly slow node into smaller TP groups when alpha makes it pay (issue 13).

With the 70B alpha [1, 1.9, 3.66, 7.22] a pair of GPUs holding 4 shards each runs at 3.66 where
a group of 8 runs at 1: four pairs do 4/3.66 = 1.093 group-of-8 speeds, about 9% more. The
plans below are built by hand (ranks and layers written out), validated and timed by the cost
model, and the planner must match or beat them.
"""

from __future__ import annotations

import itertools
from typing import Any

from malleus.planner import (
    Pipeline,
    Plan,
    PlanningProblem,
    Stage,
    plan,
    plan_step_time,
    validate_plan,
)
from tests.planner.exhaustive import optimum
from tests.planner.setting_70b import ALPHA_70B, MEM_70B

SLOW = {str(r): 1.57 for r in range(8, 16)}  # node 1, every GPU at 1.57x


def cluster(**over: Any) -> PlanningProblem:
    data: dict[str, Any] = {
        "nodes": 8,
        "gpus_per_node": 8,
        "rates": SLOW,
        "model": {"layers": 80, "tp": 8, "alpha": ALPHA_70B},
        "micro_batches": 64,
    }
    data.update(over)
    return PlanningProblem.load(data)


def group(node: int, first: int, size: int) -> list[int]:
    return list(range(node * 8 + first, node * 8 + first + size))


def pipe(m: int, *stages: tuple[list[int], int]) -> Pipeline:
    out, start = [], 0
    for ranks, n in stages:
        out.append(Stage(ranks=ranks, layers=(start, start + n)))
        start += n
    return Pipeline(micro_batches=m, stages=out)


def timed(p: PlanningProblem, hand: Plan) -> float:
    assert validate_plan(p, hand) == []
    return plan_step_time(p, hand)


def splits_node_1(result: Plan) -> bool:
    return any(s.ranks and s.ranks[0] // 8 == 1 and len(s.ranks) < 8 for _, _, s in result.stages())


def test_one_node_alone_four_pairs_beat_one_group_of_eight() -> None:
    p = PlanningProblem.load(
        {
            "nodes": 1,
            "gpus_per_node": 8,
            "rates": {str(r): 1.57 for r in range(8)},
            "model": {"layers": 4, "tp": 8, "alpha": ALPHA_70B},
            "micro_batches": 4,
        }
    )
    whole = Plan(tp=8, pipelines=[pipe(4, (group(0, 0, 8), 4))])
    pairs = Plan(tp=8, pipelines=[pipe(1, (group(0, 2 * i, 2), 4)) for i in range(4)])
    # one group: 4 micro-batches x 4 layers x 1.57; a pair: one micro-batch x 4 x 3.66 x 1.57
    assert timed(p, whole) == 4 * 4 * 1.57
    assert timed(p, pairs) < timed(p, whole) * 0.92
    result = plan(p)
    assert result.estimate is not None
    assert result.estimate.step_time <= timed(p, pairs) + 1e-9
    assert result.estimate.step_time >= optimum(p) - 1e-9  # and it is the optimum
    assert result.estimate.step_time <= optimum(p) + 1e-9


def test_64_gpus_slow_node_as_pairs_without_memory_bound() -> None:
    # 7 healthy groups alone (80 per micro-batch) and node 1 (1.57x) in 276 micro-batches.
    # Whole, node 1 takes 125.6 per micro-batch: 7*36 + 22 = 274 < 276 by T = 2880, so 2960.
    # As four pairs (459.7 per micro-batch each): 7*36 + 4*6 = 276 by T = 2880.
    p = cluster(micro_batches=276)
    healthy = [n for n in range(8) if n != 1]
    pairs = Plan(
        tp=8,
        pipelines=[pipe(36, (group(n, 0, 8), 80)) for n in healthy]
        + [pipe(6, (group(1, 2 * i, 2), 80)) for i in range(4)],
    )
    whole = Plan(
        tp=8,
        pipelines=[pipe(37, (group(n, 0, 8), 80)) for n in healthy[:3]]
        + [pipe(36, (group(n, 0, 8), 80)) for n in healthy[3:]]
        + [pipe(21, (group(1, 0, 8), 80))],
    )
    assert timed(p, pairs) == 2880.0
    assert timed(p, whole) == 2960.0
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time <= timed(p, pairs) + 1e-9
    assert splits_node_1(result)


def test_64_gpus_slow_node_70b_memory_matches_the_hand_built_plans() -> None:
    # the reference 70B memory model: a pipeline needs about two full groups' memory, so the
    # pairs must share pipelines with healthy groups (6 + 6 layers beside 34 + 34) and their
    # extra stages cost bubble; the node whole at the end of a 4-stage pipeline wins here
    p = cluster(memory=MEM_70B)
    whole = Plan(
        tp=8,
        pipelines=[
            pipe(17, (group(0, 0, 8), 39), (group(2, 0, 8), 41)),
            pipe(17, (group(3, 0, 8), 39), (group(4, 0, 8), 41)),
            pipe(
                30,
                (group(5, 0, 8), 22),
                (group(6, 0, 8), 22),
                (group(7, 0, 8), 22),
                (group(1, 0, 8), 14),
            ),
        ],
    )
    pairs = Plan(
        tp=8,
        pipelines=[
            pipe(26, (group(0, 0, 8), 26), (group(2, 0, 8), 27), (group(3, 0, 8), 27)),
            pipe(
                19,
                (group(1, 0, 2), 6),
                (group(1, 2, 2), 6),
                (group(4, 0, 8), 34),
                (group(5, 0, 8), 34),
            ),
            pipe(
                19,
                (group(1, 4, 2), 6),
                (group(1, 6, 2), 6),
                (group(6, 0, 8), 34),
                (group(7, 0, 8), 34),
            ),
        ],
    )
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time <= min(timed(p, whole), timed(p, pairs)) + 1e-9


def test_64_gpus_node_at_2x_as_pairs_within_one_percent() -> None:
    # issue 27: a node at 2x among seven healthy ones, 272 micro-batches. Four pairs run at
    # 3.66 x 2 = 7.32 per layer (585.6 per micro-batch), the node whole at 160: the pairs
    # carry 4 x 5 = 20 micro-batches by 2928 beside 7 x 36 = 252 healthy ones, the whole node
    # only 18 (270 < 272), so it needs 2960.
    p = cluster(rates={str(r): 2.0 for r in range(8, 16)}, micro_batches=272)
    healthy = [n for n in range(8) if n != 1]
    pairs = Plan(
        tp=8,
        pipelines=[pipe(36, (group(n, 0, 8), 80)) for n in healthy]
        + [pipe(5, (group(1, 2 * i, 2), 80)) for i in range(4)],
    )
    whole = Plan(
        tp=8,
        pipelines=[pipe(37, (group(n, 0, 8), 80)) for n in healthy[:2]]
        + [pipe(36, (group(n, 0, 8), 80)) for n in healthy[2:]]
        + [pipe(18, (group(1, 0, 8), 80))],
    )
    assert timed(p, pairs) == 2928.0
    assert timed(p, whole) == 2960.0
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time <= timed(p, pairs) * 1.01


def two_nodes(rate: float, micro_batches: int) -> PlanningProblem:
    return PlanningProblem.load(
        {
            "nodes": 2,
            "gpus_per_node": 8,
            "rates": {str(r): rate for r in range(8, 16)},
            "model": {"layers": 80, "tp": 8, "alpha": ALPHA_70B},
            "micro_batches": micro_batches,
        }
    )


def hand_built(p: PlanningProblem, size: tuple[int, int]) -> Plan:
    """Healthy nodes in groups of size[0], node 1 (the slow one) in groups of size[1], every
    group a one-stage pipeline; micro-batches dealt one at a time to the pipeline that ends
    first (a group left without one sits out)."""
    sizes = [size[int(n == 1)] for n in range(p.nodes)]
    groups = [group(n, a, s) for n, s in enumerate(sizes) for a in range(0, 8, s)]
    per = [plan_step_time(p, Plan(tp=8, pipelines=[pipe(1, (g, 80))])) for g in groups]
    m = [0] * len(groups)
    for _ in range(p.micro_batches):
        i = min(range(len(groups)), key=lambda j: ((m[j] + 1) * per[j], j))
        m[i] += 1
    used = [(g, n) for g, n in zip(groups, m, strict=True) if n]
    idle = sorted(r for g, n in zip(groups, m, strict=True) if not n for r in g)
    return Plan(tp=8, pipelines=[pipe(n, (g, 80)) for g, n in used], excluded=idle)


def test_16_gpus_slow_node_split_within_one_percent_of_hand_built_plans() -> None:
    # issue 27: on two nodes of 8 every combination of the nodes' groupings is a candidate
    # (81 of them); the default search scored the costliest first (many single-GPU groups)
    # and ran out of budget before it reached the pairs: 1155.2 at 3x with 16 micro-batches,
    # 31% behind every node in pairs (878.4: healthy pairs 3 micro-batches of 292.8, slow
    # pairs 1 of 878.4), 1216 at 2x with 24, 5% behind every GPU alone (1155.2), and 879.2 at
    # 1.57x with 16, 16% behind every node in groups of 4 (760).
    cases = {(3.0, 16): (2, 2), (2.0, 24): (1, 1), (1.57, 16): (4, 4)}
    for (rate, m), best_sizes in cases.items():
        p = two_nodes(rate, m)
        hand = {
            sizes: timed(p, hand_built(p, sizes))
            for sizes in itertools.product((8, 4, 2, 1), repeat=2)
        }
        assert min(hand, key=lambda s: (hand[s], s)) == best_sizes  # what the comment says
        assert hand[best_sizes] < hand[(8, 8)] * 0.96  # splitting pays
        result = plan(p)
        assert validate_plan(p, result) == []
        assert result.estimate is not None
        assert result.estimate.step_time <= min(hand.values()) * 1.01, (rate, m, hand)


def test_64_gpus_healthy_nodes_in_pairs_beside_a_slow_node_of_singles() -> None:
    # issue 27: with no memory bound and alpha[k] < 2^k the healthy nodes pay to split too.
    # Node 1 at 1.57x, 276 micro-batches: healthy pairs (292.8 per micro-batch) carry 28 x 9 =
    # 252 by 3 x 906.8 = 2720.5, the slow node's singles (80 x 7.22 x 1.57 = 906.8) 8 x 3 =
    # 24; healthy full groups beside it keep 2880 (the first test above), which is where the
    # search stopped while it only split straggler nodes.
    p = cluster(micro_batches=276)
    hand = timed(p, hand_built(p, (2, 1)))
    assert abs(hand - 3 * 80 * 7.22 * 1.57) < 1e-9
    result = plan(p)
    assert validate_plan(p, result) == []
    assert result.estimate is not None
    assert result.estimate.step_time <= hand * 1.01
