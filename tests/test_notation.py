"""One notation everywhere: the formatters of `malleus.notation`, and the printers that use them.

Layer ranges inclusive (`0-19`), speedups `x` and time saved `%` each named, bytes in binary
units, failed ranks said to be failed, rates only for GPUs, steps by their 0-based index.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from malleus.notation import (
    STEP_LINE,
    layer_range,
    layer_split,
    parse_size,
    rank_list,
    rate,
    size,
    size_mib,
    speedup,
    step_progress,
    time_saved,
)

REPO = Path(__file__).resolve().parent.parent


def test_layer_ranges_are_inclusive() -> None:
    assert layer_range((0, 20)) == "0-19"
    assert layer_range([5, 6]) == "5"
    assert layer_split([(0, 2), (2, 3), (3, 4)]) == "0-1 / 2 / 3"


def test_rank_lists_compress_runs() -> None:
    assert rank_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert rank_list([17]) == "17"
    assert rank_list([]) == "-"


def test_speedup_is_x_and_time_saved_is_percent() -> None:
    assert speedup(2.2727) == "2.27x"
    assert time_saved(0.559) == "55.9%"
    assert speedup(None) == time_saved(None) == "-"


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (512, "512 B"),
        (2048, "2.0 KiB"),
        (1_179_768, "1.1 MiB"),
        (3 * 2**30, "3.0 GiB"),
        (2_090_439 * 2**20, "2.0 TiB"),  # the planner's `2090439 MB` of the issue
        (None, "-"),
    ],
)
def test_sizes_are_binary_units(n: float | None, text: str) -> None:
    assert size(n) == text


def test_sizes_read_back_and_planner_mib() -> None:
    assert size_mib(2.5) == "2.5 MiB"
    assert parse_size("1.1 MiB") == pytest.approx(1.1 * 2**20)
    assert parse_size(size(512)) == 512


def test_rates_belong_to_gpus() -> None:
    assert rate(1.0) == "1.00" and rate(4.0) == "4.00" and rate(None) == "failed"


def test_a_step_is_its_index_and_the_step_line_parses_back() -> None:
    """`train` printed `step 1/20` for the step the report calls step 0: now both say 0."""
    assert step_progress(0, 20) == "step 0 (1/20)"
    line = f"[malleus] {step_progress(9, 30)} loss 4.2036 norm 1.765 lr 3.00e-03 0.952s 1,075 tok/s"
    m = STEP_LINE.search(line)
    assert m is not None and (m["index"], m["done"], m["total"]) == ("9", "10", "30")
    from malleus.runner.record import parse_step_line

    got = parse_step_line(line)
    assert got is not None and got.index == 9 and got.tokens_per_second == 1075.0


# ---- the printers use it ------------------------------------------------------------------

PRINTERS = [
    "malleus/planner/cli.py",  # `malleus plan` / `malleus check`: the plan table
    "malleus/runner/changes.py",  # what a re-plan changed (summary, progress, plot)
    "malleus/runner/report/text.py",  # the run summary
    "malleus/runner/failures.py",  # failures and recoveries
    "malleus/runner/supervise_restart.py",  # restart mode's recovery line
    "malleus/runner/record.py",  # reads the trainers' step line
    "malleus/controller/decision.py",  # Replanned / ReplanSkipped reasons
    "malleus/controller/switching.py",  # Migrated
    "trainer/run/loop.py",  # the trainers' step and switch lines
    "trainer/parallel/layout.py",  # the rank matrix
    "trainer/recovery/restore.py",  # the trainers' recovery line
    "trainer/cli.py",  # the reference run's step line
]


@pytest.mark.parametrize("path", PRINTERS)
def test_every_printer_formats_through_the_notation(path: str) -> None:
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    found = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "malleus.notation" in found


def test_the_plan_table_shows_failed_ranks_inclusive_layers_and_gpu_rates() -> None:
    """`malleus plan ... --rates 17=failed` printed `excluded ranks: 3` and nothing of 17;
    `layers 0-20` half-open; `rate 8.00` for a healthy GPU running all of a layer's shards."""
    from malleus.job import ResolvedJob
    from malleus.planner.cli import summary
    from malleus.planner.search import plan

    job = ResolvedJob.load(REPO / "examples" / "quickstart.yaml")
    initial = job.initial_plan(time_limit=5.0)
    problem = job.problem({1: 4.0, 6: None}, previous_plan=initial)
    text = summary(problem, plan(problem, time_limit=5.0))
    assert "failed ranks: 6" in text
    assert "layer-shards" not in text and " MB " not in text
    assert "migration: " in text and "iB from generation" in text
    rows = [ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit() and "  " in ln]
    table = [r for r in rows if len(r) >= 6]
    assert table, text
    for cells in table:
        # ... ranks layers shards rate time/mb
        first, last = cells[-4].split("-") if "-" in cells[-4] else (cells[-4], cells[-4])
        assert 0 <= int(first) <= int(last) <= 3  # 4 layers: inclusive 0-3 at most
        assert float(cells[-2]) in (1.0, 4.0)  # a GPU's own rate, never a group's pace
    assert "6" not in [c for cells in table for c in cells[-5].split(",")]  # in no stage


def test_a_recovery_is_said_once_with_one_size_and_the_step_it_hit() -> None:
    """Restart mode said `at step 5` for a rank killed at step 8 (5: where it went on from)."""
    from malleus.runner.failures import Recovery, recovered_text, summary_lines

    restart = Recovery(
        {3: "killed"}, step=5, steps_lost=3, bytes_restored=2_446_745, mode="restart"
    )
    text = recovered_text(restart)
    assert text.startswith("step 8: ") and "steps 5-7 trained again" in text
    assert "2.3 MiB restored" in text and "bytes" not in text and "KiB" not in text
    lines = summary_lines(
        {"failures": [], "recoveries": [{**restart.__dict__, "failed": {"3": "killed"}}]}
    )
    header = next(ln for ln in lines if "failed at" in ln)
    row = lines[lines.index(header) + 1].split()
    assert row[:4] == ["r3", "8", "5", "restart"] and row[-2:] == ["2.3", "MiB"]


def test_decisions_name_time_saved_and_speedup() -> None:
    """`predicted gain 55.9%` and `pred x 2.27x` were the same re-plan: now each is named."""
    from malleus.controller import MigrationModel, decide
    from malleus.job import ResolvedJob, StragglerPolicy
    from malleus.planner.search import plan

    job = ResolvedJob.load(REPO / "examples" / "quickstart.yaml")
    current = job.initial_plan(time_limit=5.0)
    slow = job.problem({1: 4.0}, previous_plan=current)
    new = plan(slow, time_limit=5.0)
    d = decide(
        slow,
        current,
        new,
        policy=StragglerPolicy(),
        seconds_per_unit=0.01,
        planning_seconds=0.1,
        migration=MigrationModel(5e9),
    )
    x = d.old_units / d.new_units
    assert f"predicted time saved {1 - 1 / x:.1%} (speedup {x:.2f}x)" in d.reason
    assert "gain" not in d.reason
