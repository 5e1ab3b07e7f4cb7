"""The plan-diff describer on hand-built plan pairs: every kind of change, alone and together."""

from __future__ import annotations

from malleus.planner.plan import Pipeline, Plan, Stage
from malleus.runner.changes import describe, describe_summaries, layers_text


def plan(*pipelines: tuple[int, list[tuple[list[int], tuple[int, int]]]], excluded=()) -> Plan:
    return Plan(
        tp=2,
        pipelines=[
            Pipeline(micro_batches=m, stages=[Stage(ranks=r, layers=span) for r, span in stages])
            for m, stages in pipelines
        ],
        excluded=list(excluded),
    )


# The quickstart's first plan: two pipelines of two TP-2 stages, two layers each.
TWO_BY_TWO = plan(
    (8, [([0, 1], (0, 2)), ([2, 3], (2, 4))]),
    (8, [([4, 5], (0, 2)), ([6, 7], (2, 4))]),
)


def test_same_layout_says_so() -> None:
    change = describe(TWO_BY_TWO, TWO_BY_TWO.model_copy(update={"generation": 2}))
    assert change.unchanged and change.text() == "same layout"
    assert describe(TWO_BY_TWO, TWO_BY_TWO, 0.0).text() == "same layout; nothing migrated"


def test_micro_batches_resplit_only() -> None:
    new = plan(
        (5, [([0, 1], (0, 2)), ([2, 3], (2, 4))]),
        (11, [([4, 5], (0, 2)), ([6, 7], (2, 4))]),
    )
    change = describe(TWO_BY_TWO, new, 0.0)
    assert change.micro_batches == ((8, 8), (5, 11))
    assert not (change.tp_regrouped or change.layers_moved or change.excluded)
    assert change.text() == "micro-batches 8/8 -> 5/11; nothing migrated"
    assert change.labels() == ["micro-batches re-split"]


def test_exclusion_regroups_tp_and_moves_layers() -> None:
    # rank 1 slow: left out; rank 0 runs both shards alone on one layer, 2,3 take three.
    new = plan(
        (6, [([0], (0, 1)), ([2, 3], (1, 4))]),
        (10, [([4, 5], (0, 2)), ([6, 7], (2, 4))]),
        excluded=[1],
    )
    change = describe(TWO_BY_TWO, new, 1.25 * 2**20)
    assert change.excluded == (1,) and change.readmitted == ()
    assert change.tp_before == ((0, 1),) and change.tp_after == ((0,),)
    assert [p.pipeline for p in change.layers] == [0]
    assert change.text() == (
        "rank 1 excluded; TP 0,1 -> 0; pipeline 0: layers 0-1 / 2-3 -> 0 / 1-3 on 0 > 2,3; "
        "micro-batches 8/8 -> 6/10; 1.2 MiB migrated"
    )
    assert change.labels() == [
        "rank 1 out",
        "TP regrouped",
        "layers moved",
        "micro-batches re-split",
        "1.2 MiB",
    ]


def test_readmission_after_healing() -> None:
    excluded = plan(
        (6, [([0], (0, 1)), ([2, 3], (1, 4))]),
        (10, [([4, 5], (0, 2)), ([6, 7], (2, 4))]),
        excluded=[1],
    )
    change = describe(excluded, TWO_BY_TWO)
    assert change.readmitted == (1,) and change.excluded == ()
    assert change.tp_before == ((0,),) and change.tp_after == ((0, 1),)
    assert change.text().startswith(
        "rank 1 re-admitted; TP 0 -> 0,1; pipeline 0: layers 0 / 1-3 -> 0-1 / 2-3 on 0,1 > 2,3"
    )
    assert "migrated" not in change.text()  # no figure given: nothing said


def test_shard_order_swap_is_a_regroup() -> None:
    new = plan(
        (8, [([1, 0], (0, 2)), ([2, 3], (2, 4))]),
        (8, [([4, 5], (0, 2)), ([6, 7], (2, 4))]),
    )
    change = describe(TWO_BY_TWO, new)
    assert change.tp_regrouped and not change.layers_moved
    assert change.text() == "TP 0,1 -> 1,0"


def test_ranks_trading_places_move_layers_under_the_same_split() -> None:
    # The two stages of pipeline 1 swap: the split is the same, every rank holds other layers.
    new = plan(
        (8, [([0, 1], (0, 2)), ([2, 3], (2, 4))]),
        (8, [([6, 7], (0, 2)), ([4, 5], (2, 4))]),
    )
    change = describe(TWO_BY_TWO, new)
    assert not change.tp_regrouped  # the groups exist as before
    assert change.text() == "pipeline 1: layers 0-1 / 2-3 now on 6,7 > 4,5"


def test_from_one_stage_to_two_and_a_new_pipeline() -> None:
    old = plan((4, [([0, 1], (0, 4))]), (4, [([2, 3], (0, 4))]), excluded=[4, 5])
    new = plan((3, [([0, 1], (0, 2)), ([2, 3], (2, 4))]), (5, [([4, 5], (0, 4))]))
    change = describe(old, new)
    assert change.readmitted == (4, 5)
    assert change.tp_after == ((4, 5),) and change.tp_before == ()
    texts = [p.text() for p in change.layers]
    assert texts == [
        "pipeline 0: layers 0-3 -> 0-1 / 2-3 on 0,1 > 2,3",
        "pipeline 1: new, layers 0-3 on 4,5",
    ]
    assert "ranks 4, 5 re-admitted" in change.text()


def test_layers_text_and_report_summaries() -> None:
    assert layers_text([(0, 1), (1, 4)]) == "0 / 1-3"
    summary = {"generation": 1, "pipelines": [p.model_dump() for p in TWO_BY_TWO.pipelines]}
    summary["excluded"] = []
    new = dict(summary, excluded=[])
    new["pipelines"] = [dict(p) for p in summary["pipelines"]]
    new["pipelines"][0] = {"micro_batches": 7, "stages": summary["pipelines"][0]["stages"]}
    new["pipelines"][1] = {"micro_batches": 9, "stages": summary["pipelines"][1]["stages"]}
    change = describe_summaries(summary, new, tp=2, migrated_bytes=0)
    assert change.text() == "micro-batches 8/8 -> 7/9; nothing migrated"
    assert change.to_dict()["micro_batches"] == {"before": [8, 8], "after": [7, 9]}


def test_a_rank_gone_from_the_layout_and_not_excluded_failed() -> None:
    """A recovery's plan leaves the dead GPU in neither its stages nor its excluded (usable,
    idle) ranks: it is said to have failed, not to be excluded."""
    new = plan(
        (6, [([0], (0, 2)), ([2, 3], (2, 4))]),
        (10, [([4, 5], (0, 2)), ([6, 7], (2, 4))]),
    )
    change = describe(TWO_BY_TWO, new)
    assert change.failed == (1,) and change.excluded == ()
    assert change.text().startswith("rank 1 failed; TP 0,1 -> 0")
    assert change.labels()[0] == "rank 1 failed"
    assert change.to_dict()["failed"] == [1]
