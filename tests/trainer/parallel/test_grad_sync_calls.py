"""The cost model counts exactly the gradient all-reduces the trainer issues (one per bucket,
a distinct holder set of a GPU's pieces: trainer/parallel/layout.py), and the calibration fits
the sync as a cost per call plus one per MiB from known measurements."""

from __future__ import annotations

import pytest

from malleus.job import ModelConfig
from malleus.planner import Pipeline, Plan, PlanningProblem, Stage
from malleus.planner.cost import grad_sync_by_gpu
from malleus.trainer.measure.calibration_terms import MIB, CostSample, reduce_calibration
from malleus.trainer.parallel.layout import Layout

CFG = ModelConfig(layers=4, hidden=32, heads=4, ffn=64, vocab=256, sequence=16)


def plan(text: str, excluded: tuple[int, ...] = ()) -> Plan:
    """`m: r,r[a:b] > r[a:b]; ...`, the benchmark report's notation (bench/trainer_report.py)."""
    pipelines = []
    for part in text.split(";"):
        m, _, stages = part.partition(":")
        out = []
        for s in stages.split(">"):
            ranks, _, layers = s.strip().rstrip("]").partition("[")
            a, b = layers.split(":")
            out.append(Stage(ranks=[int(r) for r in ranks.split(",")], layers=(int(a), int(b))))
        pipelines.append(Pipeline(micro_batches=int(m), stages=out))
    return Plan(tp=2, pipelines=pipelines, excluded=list(excluded))


@pytest.mark.parametrize(
    ("text", "excluded"),
    [
        # bench/trainer.py's 16-GPU plans (docs/benchmarks.md, "Trainer"): planner and uniform
        (
            "6: 14,15[0:3] > 0[3:4]; 1: 6,7[0:2] > 1[2:4]; 5: 2,3[0:4]; 5: 4,5[0:4]; "
            "5: 8,9[0:4]; 5: 10,11[0:4]; 5: 12,13[0:4]",
            (),
        ),
        (
            "9: 0,2[0:2] > 4,5[2:4]; 6: 14,15[0:3] > 1,3[3:4]; "
            "17: 6,7[0:1] > 8,9[1:2] > 10,11[2:3] > 12,13[3:4]",
            (),
        ),
        ("; ".join(f"4: {2 * i},{2 * i + 1}[0:4]" for i in range(8)), ()),
        ("2: 0[0:4]; 2: 5[0:1] > 9[1:4]; 2: 12,13[0:2] > 3[2:4]", (1, 2, 4, 6, 7, 8, 10, 11)),
    ],
)
def test_the_model_counts_the_trainers_buckets(text: str, excluded: tuple[int, ...]) -> None:
    p = plan(text, excluded)
    problem = PlanningProblem.load(
        {
            "nodes": 4,
            "gpus_per_node": 4,
            "model": {"layers": 4, "tp": 2},
            "micro_batches": sum(x.micro_batches for x in p.pipelines),
            "calibration": {
                "layer_seconds": 1.0,
                "grad_sync_call_intra": 1.0,
                "grad_sync_call_inter": 1.0,
            },
        }
    )
    calls = grad_sync_by_gpu(problem, p)
    stage_ranks = [r for _, _, s in p.stages() for r in s.ranks]
    buckets = {r: len(list(Layout.from_plan(p, CFG, r, 16).my_buckets())) for r in stage_ranks}
    assert calls == pytest.approx(buckets)


def test_the_fit_separates_calls_from_bytes() -> None:
    """Two one-stage pipelines of two, one per node; node 1's links 3x slow (its TP calls read
    3x), so every cross-node figure ran at 3x. Each rank synced 1 MiB in 2 cross-node calls in
    0.09 s and its probe read 0.006 s per call (0.003 on node 1's own group, 0.001 on node 0's):
    a healthy link's call is 0.002 s, the sync's rest (0.09 / 3 - 2 x 0.002) s per MiB."""
    unit = 0.1

    def sample(best: float, intra_s: float) -> CostSample:
        return CostSample(
            steps=1, step_s=1.0, units=8, compute_s=0.4, calls=8, tp_s=0.04, tp_best=best,
            group=2, run_s=0.8, end_s=0.85, grad_inter_s=0.09, grad_inter_bytes=MIB,
            grad_inter_calls=2, call_inter_s=2 * 0.006, call_inter_groups=2,
            call_intra_s=intra_s, call_intra_groups=1,
        )  # fmt: skip

    samples = [sample(0.002, 0.001)] * 2 + [sample(0.006, 0.003)] * 2
    cal, links = reduce_calibration(samples, [[[0, 1]], [[2, 3]]], 2, unit)
    assert links == pytest.approx({0: 1.0, 1: 3.0})
    assert cal is not None
    assert cal["grad_sync_call_inter"] == pytest.approx(0.002 / unit)
    assert cal["grad_sync_call_intra"] == pytest.approx(0.001 / unit)
    assert cal["grad_sync_inter"] == pytest.approx((0.09 / 3 - 2 * 0.002) / unit)
    # a sync no longer than its calls has no per-MiB part (never negative)
    quick = [CostSample(**{**vars(s), "grad_inter_s": 0.003}) for s in samples]
    cal, _ = reduce_calibration(quick, [[[0, 1]], [[2, 3]]], 2, unit)
    assert cal is not None and cal["grad_sync_inter"] == 0.0
    assert cal["grad_sync_call_inter"] == pytest.approx(0.002 / unit)


def test_a_kind_the_plan_does_not_sync_is_never_free() -> None:
    """Two one-stage pipelines across nodes: only cross-node sync groups, so nothing measures
    the in-node kind. Its figures are the cross-node ones over the transfer probe's cross-node /
    in-node round trip (4x here), or an earlier calibration's where there is one (at this
    plan's host sharing): a 0 would price every in-node group's sync as free."""
    unit = 0.1

    def sample(intra_peer: int, inter_peer: int) -> CostSample:
        return CostSample(
            steps=1, step_s=1.0, units=8, compute_s=0.4, calls=8, group=1, run_s=0.8,
            end_s=0.85, grad_inter_s=0.05, grad_inter_bytes=MIB, grad_inter_calls=1,
            call_inter_s=0.004, call_inter_groups=1, probe_intra_s=0.001,
            probe_intra_peer=intra_peer, probe_inter_s=0.004, probe_inter_peer=inter_peer,
        )  # fmt: skip

    samples = [sample(1, 2), sample(0, 3), sample(3, 0), sample(2, 1)]
    pipelines = [[[0]], [[1]], [[2]], [[3]]]
    cal, _ = reduce_calibration(samples, pipelines, 2, unit)
    assert cal is not None
    assert cal["grad_sync_call_inter"] == pytest.approx(0.004 / unit)
    assert cal["grad_sync_call_intra"] == pytest.approx(0.001 / unit)
    assert cal["grad_sync_inter"] == pytest.approx((0.05 - 0.004) / unit)
    assert cal["grad_sync_intra"] == pytest.approx((0.05 - 0.004) / 4 / unit)
    earlier = {"grad_sync_intra": 0.07, "grad_sync_call_intra": 0.02, "grad_sync_inter": 9.0}
    cal, _ = reduce_calibration(samples, pipelines, 2, unit, earlier)
    assert cal is not None and cal["grad_sync_inter"] == pytest.approx(0.46)  # measured wins
    assert (cal["grad_sync_intra"], cal["grad_sync_call_intra"]) == (0.07, 0.02)
    bare = [CostSample(**{**vars(s), "probe_intra_peer": -1}) for s in samples]
    cal, _ = reduce_calibration(bare, pipelines, 2, unit)  # no ratio, no earlier: 0
    assert cal is not None and cal["grad_sync_intra"] == 0 == cal["grad_sync_call_intra"]
