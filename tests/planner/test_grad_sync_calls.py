"""The gradient sync's per-call term: each GPU pays one all-reduce call per distinct holder set
of its gradients (the trainer's buckets), at the intra- or inter-node figure, times the slowest
link of the group, beside the per-MB part (docs/architecture.md, "Cost model").

Every expected figure is counted by hand from the plan below (the trainer's own bucket count is
checked against the model in tests/trainer/parallel/test_grad_sync_calls.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from malleus.planner import Pipeline, Plan, PlanningProblem, Stage, step_time_terms
from malleus.planner.cost import grad_sync_by_gpu

CALLS = {"grad_sync_call_intra": 0.01, "grad_sync_call_inter": 0.1}


def problem(cal: dict[str, float], links: dict[str, float] | None = None) -> PlanningProblem:
    """2 nodes x 4 GPUs, tp 2, 4 layers; no memory model: 1 MB of gradient per layer shard."""
    return PlanningProblem.load(
        {
            "nodes": 2,
            "gpus_per_node": 4,
            "model": {"layers": 4, "tp": 2},
            "micro_batches": 6,
            "calibration": {"layer_seconds": 0.1, **cal},
            "link_rates": links or {},
        }
    )


def plan(*pipelines: list[tuple[list[int], tuple[int, int]]]) -> Plan:
    return Plan(
        tp=2,
        pipelines=[
            Pipeline(micro_batches=2, stages=[Stage(ranks=r, layers=lay) for r, lay in p])
            for p in pipelines
        ],
    )


# Mixed: a full group holding every layer, a pipeline of single GPUs, one of full groups, in
# both nodes. Cuts at 2 split the layers into columns [0, 2) and [2, 4), each spanning nodes.
MIXED = plan(
    [([0, 1], (0, 4))],
    [([2], (0, 2)), ([3], (2, 4))],
    [([4, 5], (0, 2)), ([6, 7], (2, 4))],
)
# Per column: a single GPU (2 shards) meets two shard sets, a group member one, and every GPU
# one more set for the column's norm weights (held by every GPU of the column's stages).
MIXED_CALLS = {0: 4, 1: 4, 2: 3, 3: 3, 4: 2, 5: 2, 6: 2, 7: 2}
UNIFORM = plan(*([([2 * i, 2 * i + 1], (0, 4))] for i in range(4)))  # 2 calls each, across
INSIDE = plan(  # column [0, 2) all on node 0, [2, 4) all on node 1: 2 calls each, in a node
    [([0, 1], (0, 2)), ([4, 5], (2, 4))],
    [([2, 3], (0, 2)), ([6, 7], (2, 4))],
)
SINGLES = plan([([0], (0, 4))], [([4], (0, 4))])  # all shards on one GPU: one set, norms too


def test_calls_per_gpu_mixed_against_uniform() -> None:
    p = problem(CALLS)
    assert grad_sync_by_gpu(p, MIXED) == pytest.approx({r: 0.1 * n for r, n in MIXED_CALLS.items()})
    assert grad_sync_by_gpu(p, UNIFORM) == pytest.approx({r: 0.2 for r in range(8)})
    assert step_time_terms(p, MIXED).grad_sync == pytest.approx(0.4)
    assert step_time_terms(p, UNIFORM).grad_sync == pytest.approx(0.2)
    assert grad_sync_by_gpu(p, SINGLES) == pytest.approx({0: 0.1, 4: 0.1})


def test_calls_inside_a_node_take_the_intra_figure() -> None:
    p = problem(CALLS)
    assert grad_sync_by_gpu(p, INSIDE) == pytest.approx({r: 2 * 0.01 for r in range(8)})
    # node 1's links 3x slow: its column's calls take 3x; node 0's do not
    slow = problem(CALLS, {"1": 3.0})
    assert grad_sync_by_gpu(slow, INSIDE) == pytest.approx(
        {r: 2 * 0.01 * (3.0 if r >= 4 else 1.0) for r in range(8)}
    )
    # across nodes every group touches node 1
    assert grad_sync_by_gpu(slow, MIXED)[0] == pytest.approx(4 * 0.1 * 3.0)


def test_calls_add_to_the_per_mb_part() -> None:
    """GPU 0 syncs 4 layers x 1 shard = 4 MB in 4 calls, GPU 2 2 layers x 2 shards = 4 MB in 3,
    GPU 4 2 MB in 2 (0.5 per MB across nodes)."""
    cal: dict[str, Any] = {**CALLS, "grad_sync_inter": 0.5, "grad_sync_intra": 0.2}
    by_gpu = grad_sync_by_gpu(problem(cal), MIXED)
    assert by_gpu[0] == pytest.approx(4 * 0.5 + 4 * 0.1)
    assert by_gpu[2] == pytest.approx(4 * 0.5 + 3 * 0.1)
    assert by_gpu[4] == pytest.approx(2 * 0.5 + 2 * 0.1)
    assert step_time_terms(problem(cal), MIXED).grad_sync == pytest.approx(2.4)
    # without the call terms (every problem written before them): the per-MB part alone
    per_mb = {k: v for k, v in cal.items() if not k.startswith("grad_sync_call")}
    assert step_time_terms(problem(per_mb), MIXED).grad_sync == pytest.approx(2.0)


def test_one_pipeline_has_no_sync() -> None:
    one = plan([([0, 1], (0, 2)), ([2, 3], (2, 4))])
    assert grad_sync_by_gpu(problem(CALLS), one) == {}
    assert step_time_terms(problem(CALLS), one).grad_sync == 0.0
