"""The cost model (docs/architecture.md, "Cost model"), checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from malleus.planner import (
    Pipeline,
    Plan,
    PlanningProblem,
    Stage,
    ideal_step_time,
    migration_mb,
    plan_step_time,
    reference_step_time,
    uniform_plan,
    uniform_step_time,
)
from malleus.planner.cost import group_rate, stage_memory_mb


def small(**over: object) -> PlanningProblem:
    data: dict[str, object] = {
        "nodes": 2,
        "gpus_per_node": 4,
        "model": {"layers": 8, "tp": 2},
        "micro_batches": 8,
    }
    data.update(over)
    return PlanningProblem.load(data)


def test_uniform_without_memory_is_pure_data_parallel() -> None:
    # 4 groups of 2; pp=1 divides groups and layers and dp=4 divides 8 micro-batches.
    p = small()
    u = uniform_plan(p)
    assert u is not None
    assert [s.ranks for _, _, s in u.stages()] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(pl.micro_batches == 2 for pl in u.pipelines)
    # each pipeline: one stage of 8 layers, m=2 -> (2-1)*8 + 8 = 16
    assert uniform_step_time(p) == 16.0


def test_uniform_slows_to_the_straggler_pace() -> None:
    # rank 1 at 3x drags group [0, 1]: (2-1)*24 + 24 = 48
    assert uniform_step_time(small(rates={1: 3.0})) == 48.0


def test_uniform_deepens_the_pipeline_when_memory_forces_it() -> None:
    # capacity 10, fixed 1, layer 1 MB/shard, no activations: 8 layers on one stage need 9 MB
    # with the embedding of 1 MB twice -> 11 > 10; pp=2 needs 4+1+1 = 6 MB per GPU.
    mem = {"capacity_mb": 10, "layer_mb": 1, "embedding_mb": 1, "fixed_mb": 1}
    p = small(memory=mem)
    u = uniform_plan(p)
    assert u is not None and u.dp == 2
    assert [s.layers for s in u.pipelines[0].stages] == [(0, 4), (4, 8)]
    # (4-1)*4 + 8 = 20 per pipeline
    assert uniform_step_time(p) == 20.0


def test_uniform_cannot_run_with_a_failed_gpu() -> None:
    assert math.isinf(uniform_step_time(small(rates={5: None})))


def test_ideal_and_reference_by_hand() -> None:
    p = small(rates={1: 3.0})
    # sum over GPUs of 1/(tp*rate) = 7/2 + 1/6 = 11/3; ideal = 8 * 8 / (11/3)
    assert ideal_step_time(p) == pytest.approx(64 * 3 / 11)
    # healthy uniform 16, world 8, capacity 7 + 1/3 -> 16 * 8 / (22/3)
    assert reference_step_time(p) == pytest.approx(16 * 8 * 3 / 22)


def test_reference_with_a_failed_gpu_counts_only_usable_capacity() -> None:
    p = small(rates={5: None})
    assert reference_step_time(p) == pytest.approx(16 * 8 / 7)


def test_group_rate_and_stage_memory_by_hand() -> None:
    p = small(
        rates={1: 3.0},
        model={"layers": 8, "tp": 2, "alpha": [1.0, 1.8]},
        memory={
            "capacity_mb": 100,
            "layer_mb": 2,
            "activation_mb": 0.5,
            "embedding_mb": 3,
            "fixed_mb": 4,
        },
    )
    assert group_rate(p, [0, 1]) == 3.0
    assert group_rate(p, [0]) == 1.8  # alpha[1] * 1.0
    assert group_rate(p, [1]) == pytest.approx(5.4)
    # 2 shards, 3 layers, stage 0 of 4, 8 micro-batches: in flight min(4, 8) = 4, embedding
    # 2 * (2*3 + 0.5*3*4 + 3) + 4 = 2 * 15 + 4 = 34
    assert stage_memory_mb(p, 2, 3, 4, 0, 8) == 34.0
    # stage 2 of 4: in flight 2, no embedding: 1 * (6 + 3) + 4 = 13
    assert stage_memory_mb(p, 1, 3, 4, 2, 8) == 13.0
    # few micro-batches cap the in-flight count: m=1 -> 1 * (6 + 1.5 + 3) + 4
    assert stage_memory_mb(p, 1, 3, 4, 0, 1) == 14.5


def test_plan_step_time_takes_the_slowest_pipeline() -> None:
    p = small(rates={4: 2.0})
    plan = Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=5,
                stages=[Stage(ranks=[0, 1], layers=(0, 3)), Stage(ranks=[2, 3], layers=(3, 8))],
            ),
            Pipeline(micro_batches=3, stages=[Stage(ranks=[4], layers=(0, 8))]),
        ],
        excluded=[5, 6, 7],
    )
    # pipeline 0: costs 3, 5 -> (5-1)*5 + 8 = 28; pipeline 1: y = 2 * 2 = 4, c = 32 -> 2*32+32
    assert plan_step_time(p, plan) == 96.0


def _two_stage(split: int, ranks: tuple[list[int], list[int]] = ([0, 1], [2, 3])) -> Plan:
    return Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=8,
                stages=[
                    Stage(ranks=ranks[0], layers=(0, split)),
                    Stage(ranks=ranks[1], layers=(split, 8)),
                ],
            )
        ],
        excluded=[4, 5, 6, 7],
    )


def test_migration_moves_only_what_a_rank_lacks() -> None:
    mem = {"capacity_mb": 1000, "layer_mb": 10, "embedding_mb": 7, "fixed_mb": 0}
    p = small(memory=mem)
    old = _two_stage(4)
    assert migration_mb(p, old, old) == 0.0
    assert migration_mb(p, None, old) == 0.0
    # boundary 4 -> 5: layer 4 (2 shards, one per GPU) moves to ranks 0 and 1
    assert migration_mb(p, old, _two_stage(5)) == 2 * 10
    # swapping the two groups moves everything: 8 layers x 2 shards + emb and head (2 shards each)
    assert migration_mb(p, old, _two_stage(4, ([2, 3], [0, 1]))) == 16 * 10 + 4 * 7
    # reversing the shard order inside a group moves that group's shards
    assert migration_mb(p, old, _two_stage(4, ([1, 0], [2, 3]))) == 4 * 2 * 10 + 2 * 7


def test_migration_of_a_halved_group_keeps_the_held_shard() -> None:
    p = small(memory={"capacity_mb": 1000, "layer_mb": 10, "embedding_mb": 0, "fixed_mb": 0})
    old = _two_stage(4)
    new = Plan(
        tp=2,
        pipelines=[
            Pipeline(
                micro_batches=8,
                stages=[Stage(ranks=[0], layers=(0, 4)), Stage(ranks=[2, 3], layers=(4, 8))],
            )
        ],
        excluded=[1, 4, 5, 6, 7],
    )
    # rank 0 held shard 0 of layers 0-3 and now needs both shards: 4 layers x 1 shard
    assert migration_mb(p, old, new) == 4 * 10
