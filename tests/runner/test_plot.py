"""The PNG: written from a report alone, with the rate heatmap's matrix built right."""

from __future__ import annotations

import math
import struct
import warnings
from pathlib import Path

from malleus.runner.report.plot import (
    plot_report,
    rate_matrix,
    replan_label,
    throughput_series,
    warmup_steps,
)


def report() -> dict:
    rows = []
    for i in range(30):
        slow = 10 <= i < 20
        rows.append(
            {
                "step": i,
                "seconds": 1.0 if not slow else 2.0,
                "tokens_per_second": 100.0 if not slow else 50.0,
                "generation": 0 if i < 13 else 1,
                "rates": {}
                if i == 29
                else {"0": 1.0, "1": 3.0 if slow else 1.0, "2": 1.0, "3": None},
            }
        )
    return {
        "job": "plot-test",
        "mode": "live",
        "layout": {"nodes": 1, "gpus_per_node": 4, "tp": 2},
        "schedule": [
            {"step": 10, "rank": 1, "factor": 3.0},
            {"step": 20, "rank": 1, "factor": 1.0},
        ],
        "tokens_per_step": 100,
        "plan_changes": [
            {
                "generation": 1,
                "step_applied": 13,
                "changed": {
                    "text": "rank 1 excluded; TP 0,1 -> 0; 1.0 MiB migrated",
                    "labels": ["rank 1 out", "TP regrouped", "1.0 MiB"],
                },
            },
            {"generation": 2, "step_applied": None},
        ],
        "static_baseline": {
            "per_step": [
                {"step": i, "predicted_seconds": 3.0 if 10 <= i < 20 else 1.0} for i in range(1, 30)
            ]
        },
        "per_step": rows,
    }


def test_rate_matrix_is_rank_by_step_with_no_blank_columns() -> None:
    rows = report()["per_step"]
    for i in (14, 15, 16):  # the controller planning: no scrape saw these steps
        rows[i]["rates"] = {}
    steps, m = rate_matrix(rows, world=4)
    assert steps == list(range(30))
    assert len(m) == 4 and all(len(row) == 30 for row in m)
    assert m[1][12] == 3.0 and m[1][9] == 1.0
    # A step no scrape saw shows every GPU's latest rate: no gap in the map (steps 121-125
    # of the quickstart were blank while the controller planned).
    assert [m[1][i] for i in (14, 15, 16)] == [3.0, 3.0, 3.0]
    assert m[0][29] == 1.0  # nor after the last scrape
    assert all(math.isnan(m[3][i]) for i in range(30))  # an unusable rank: no colour, ever


def test_the_launchs_first_step_is_no_stray_point() -> None:
    """Step 0 pays the start-up (the quickstart's showed ~155 tok/s beside ~600): not drawn;
    the first step under a new plan is, as a warm-up marker."""
    r = report()
    r["per_step"][0]["tokens_per_second"] = 15.0
    series = throughput_series(r)
    assert 0 not in [s for s, _ in series["measured"] + series["warm-up"] + series["baseline"]]
    assert [s for s, _ in series["warm-up"]] == [13]
    assert len(series["measured"]) == 28


def test_a_baseline_that_does_not_apply_is_not_drawn(tmp_path: Path) -> None:
    assert throughput_series(report())["baseline"]  # it applies: drawn
    failed = report() | {
        "static_baseline": None,
        "static_baseline_skipped": "rank 3 killed by SIGKILL at step 8: ...",
        "failures": [{"rank": 3, "step": 8, "why": "killed by SIGKILL"}],
    }
    assert throughput_series(failed)["baseline"] == []
    assert plot_report(failed, tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert throughput_series(report() | {"mode": "static"})["baseline"] == []


def test_plot_is_a_png_of_sensible_size(tmp_path: Path) -> None:
    out = plot_report(report(), tmp_path / "sub" / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1210, 770)  # 11 x 7 inches at 110 dpi
    assert len(data) > 20_000  # two panels drawn, not an empty canvas


def test_replan_labels_say_what_changed() -> None:
    change = report()["plan_changes"][0]
    assert replan_label(change) == "gen 1: rank 1 out, TP regrouped, 1.0 MiB"
    assert replan_label(change, sep="\n") == "gen 1\nrank 1 out\nTP regrouped\n1.0 MiB"
    assert replan_label({"generation": 3}) == "gen 3"  # an old report: no description


def test_warmup_steps_are_the_first_each_switch_and_each_join() -> None:
    assert warmup_steps(report()) == [0, 13]
    # failure-demo's replacement joined at step 21 at a rate of 18: a one-off, hatched and out
    # of the colour scale like a switch's first step
    joined = report() | {"replacements": [{"rank": 3, "joined_step": 21}, {"rank": 2}]}
    assert warmup_steps(joined) == [0, 13, 21]


def test_a_short_run_of_a_long_schedule_plots_without_warnings(tmp_path: Path) -> None:
    # `--steps 3` of a job whose slowdowns come later: events past the end are not drawn (they
    # once stretched the layout until matplotlib gave up on it, with a UserWarning).
    short = report()
    short["per_step"] = short["per_step"][:3]
    short["schedule"] = [{"step": 40, "rank": 1, "factor": 3.0}]
    short["plan_changes"] = [{"generation": 2, "step_applied": 50}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (1, 3):
            short["per_step"] = report()["per_step"][:n]
            out = plot_report(short, tmp_path / f"short{n}.png")
            assert out.read_bytes()[:4] == b"\x89PNG"
