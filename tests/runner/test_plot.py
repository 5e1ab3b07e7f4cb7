"""The PNG: written from a report alone, with the rate heatmap's matrix built right."""

from __future__ import annotations

import math
import struct
from pathlib import Path

from malleus.runner.plot import plot_report, rate_matrix


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
        "plan_changes": [
            {"generation": 1, "step_applied": 13},
            {"generation": 2, "step_applied": None},
        ],
        "per_step": rows,
    }


def test_rate_matrix_is_rank_by_step_with_gaps_as_nan() -> None:
    steps, m = rate_matrix(report()["per_step"], world=4)
    assert steps == list(range(30))
    assert len(m) == 4 and all(len(row) == 30 for row in m)
    assert m[1][12] == 3.0 and m[1][9] == 1.0
    assert math.isnan(m[3][0])  # an unusable rank: no colour
    assert math.isnan(m[0][29])  # no scrape of the last step


def test_plot_is_a_png_of_sensible_size(tmp_path: Path) -> None:
    out = plot_report(report(), tmp_path / "sub" / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1210, 770)  # 11 x 7 inches at 110 dpi
    assert len(data) > 20_000  # two panels drawn, not an empty canvas
