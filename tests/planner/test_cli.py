"""`malleus plan`: a readable summary, a plan file that round-trips, exit 2 on bad input."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from malleus.cli import main
from malleus.planner import Plan, PlanningProblem, validate_plan
from malleus.planner.cli import format_ranks, plan_main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "problems"


def run(problem: Path, output: Path | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(problem=str(problem), output=str(output) if output else None)
    code = plan_main(args, out, err)
    return code, out.getvalue(), err.getvalue()


def test_summary_and_plan_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, out, err = run(EXAMPLES / "small.json", target)
    assert code == 0, err
    for needle in (
        "2 nodes x 4 GPUs, tp 2",
        "pipeline micro-b stage",
        "excluded ranks:",
        "predicted step time: 40.0",
        "uniform layout: 96.0 -> speedup 2.40x",
        "recovery: 0.873",
        "efficiency: 0.873",
        "migration: none",
        "planning:",
        f"plan written to {target}",
    ):
        assert needle in out, needle
    result = Plan.from_json(target.read_text())
    problem = PlanningProblem.load((EXAMPLES / "small.json").read_text())
    assert validate_plan(problem, result) == []
    assert Plan.from_json(result.to_json()) == result
    assert result.estimate is not None and result.estimate.step_time == 40.0


def test_through_the_malleus_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.json"
    assert main(["plan", str(EXAMPLES / "70b.json"), "-o", str(target)]) == 0
    assert "speedup" in capsys.readouterr().out
    assert Plan.from_json(target.read_text()).tp == 8


def test_failed_gpu_says_why_uniform_cannot_run(tmp_path: Path) -> None:
    data = json.loads((EXAMPLES / "small.json").read_text())
    data["rates"] = {"5": None}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code, out, _ = run(path)
    assert code == 0
    assert "uniform cannot run: rank 5 unusable" in out
    assert "use -o PLAN.json" in out


def test_previous_plan_reports_migration(tmp_path: Path) -> None:
    first = tmp_path / "first.json"
    assert run(EXAMPLES / "small.json", first)[0] == 0
    data = json.loads((EXAMPLES / "small.json").read_text())
    data["previous_plan"] = json.loads(first.read_text())
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code, out, _ = run(path)
    assert code == 0
    assert "migration: 0 layer-shards from generation 0" in out
    assert "(generation 1)" in out


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ('{"nodes": 2,\n  "gpus_per_node" 4}', "invalid JSON at line 2, column 19"),
        ("[1, 2]", "a PlanningProblem is a JSON object, not list"),
        (
            '{"nodes": 1, "gpus_per_node": 4, "model": {"layers": 4, "tp": 3}, "micro_batches": 0}',
            "model.tp: 3 is not a power of two",
        ),
        (
            '{"nodes": 1, "gpus_per_node": 4, "model": {"layers": 4, "tp": 4}, '
            '"micro_batches": 2, "memory": {"capacity_mb": 5, "layer_mb": 10}}',
            "the smallest per-GPU need is",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(tmp_path: Path, text: str, expect: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    code, out, err = run(path)
    assert code == 2
    assert expect in err
    assert "Traceback" not in err + out


def test_several_faults_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        '{"nodes": 1, "gpus_per_node": 4, "rates": {"7": 0.5}, '
        '"model": {"layers": 4, "tp": 3}, "micro_batches": 0}'
    )
    _, _, err = run(path)
    lines = [x for x in err.splitlines() if x.startswith("  ")]
    assert len(lines) == 4, err


def test_missing_file_and_unwritable_output(tmp_path: Path) -> None:
    code, _, err = run(tmp_path / "nope.json")
    assert code == 2 and "No such file or directory" in err
    code, _, err = run(EXAMPLES / "small.json", tmp_path / "no-such-dir" / "plan.json")
    assert code == 2 and "no-such-dir" in err


def test_no_traceback_from_the_process(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{")
    proc = subprocess.run(
        [sys.executable, "-m", "malleus.cli", "plan", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "invalid JSON at line 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_format_ranks() -> None:
    assert format_ranks([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert format_ranks([5]) == "5"
    assert format_ranks([]) == ""
