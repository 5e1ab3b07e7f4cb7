"""`malleus plan`: a readable summary, a plan file that round-trips, exit 2 on bad input."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from malleus.cli import main
from malleus.planner import Plan, PlanningProblem, validate_plan
from malleus.planner.cli import format_ranks, parse_rates

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "problems"


def run(problem: Path, output: Path | None = None, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["plan", str(problem), *(["-o", str(output)] if output else []), *extra]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
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
        ('{"nodes": 2,\n  "gpus_per_node" 4}', "not valid JSON at line 2, column 19"),
        ("[1, 2]", "expected a MalleusJob manifest or a PlanningProblem JSON object"),
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
    assert code == 2 and err.endswith("nope.json (1 fault):\n  - <input>: no such file\n")
    code, _, err = run(EXAMPLES / "small.json", tmp_path / "no-such-dir" / "plan.json")
    assert code == 2 and "  - --output: " in err and "no-such-dir" in err


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
    assert "not valid JSON at line 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_format_ranks() -> None:
    assert format_ranks([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert format_ranks([5]) == "5"
    assert format_ranks([]) == ""


def test_a_job_manifest_gets_the_operators_initial_plan() -> None:
    code, out, err = run(ROOT / "examples" / "tiny-cpu.yaml")
    assert code == 0, err
    assert out.startswith("2 nodes x 4 GPUs, tp 2, 8 layers, 8 micro-batches -> ")
    assert "(generation 1)" in out and "migration: none (no previous plan)" in out


def test_what_if_rates_replan_a_job_from_its_initial_plan(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, out, err = run(ROOT / "examples" / "tiny-cpu.yaml", target, "--rates", "3=2.5,5=failed")
    assert code == 0, err
    assert "(generation 2)" in out and "from generation 1" in out
    result = Plan.from_json(target.read_text())
    used = {r for p in result.pipelines for s in p.stages for r in s.ranks}
    assert 5 not in used and 5 not in result.excluded  # unusable: neither used nor excluded
    assert result.failed == [5]  # ... and said so in the JSON, as the table says it


def test_a_plan_cannot_call_a_usable_rank_failed() -> None:
    from malleus.job import ResolvedJob
    from malleus.planner.validate import validate_plan

    job = ResolvedJob.load(ROOT / "examples" / "tiny-cpu.yaml")
    first = job.initial_plan()
    problem = job.problem({5: None})
    assert validate_plan(job.problem(), first) == []
    wrong = first.model_copy(update={"failed": [2]})
    assert "failed: rank 2 is usable in the problem (rate 1.0)" in validate_plan(
        job.problem(), wrong
    )
    assert any("rank 5 is unusable" in f for f in validate_plan(problem, first))


def test_what_if_rates_lay_over_a_problems_own(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, _, err = run(EXAMPLES / "small.json", target, "--rates", "0=failed")
    assert code == 0, err
    result = Plan.from_json(target.read_text())
    assert 0 not in {r for p in result.pipelines for s in p.stages for r in s.ranks}


def test_rates_parse_ranks_rates_and_failures() -> None:
    assert parse_rates("3=2.5, 17=failed,4=null,5=1") == {3: 2.5, 17: None, 4: None, 5: 1.0}


@pytest.mark.parametrize(
    ("rates", "expect"),
    [
        ("3", "'3': expected RANK=RATE"),
        ("x=2", "'x=2': expected RANK=RATE"),
        ("3=0.5", "'3=0.5': a rate is a slowdown >= 1.0"),
        ("3=inf", "'3=inf': a rate is a slowdown >= 1.0"),
        ("8=2,9=1", "ranks 8-9 beyond the 8 GPUs (ranks 0-7)"),
    ],
)
def test_bad_rates_exit_2_naming_the_option(rates: str, expect: str) -> None:
    for source in (ROOT / "examples" / "tiny-cpu.yaml", EXAMPLES / "small.json"):
        code, out, err = run(source, None, "--rates", rates)
        assert (code, out) == (2, "")
        assert err.startswith("invalid arguments (1 fault):\n  - --rates: ") and expect in err


def test_time_limit_bounds_the_search(tmp_path: Path) -> None:
    """A 4096-GPU problem takes ~25 s with the default budget; --time-limit stops it early."""
    import time

    problem = {
        "nodes": 512,
        "gpus_per_node": 8,
        "rates": {"3": 2.5, "900": 4.0, "2000": None},
        "model": {"layers": 80, "tp": 8},
        "micro_batches": 512,
    }
    path = tmp_path / "big.json"
    path.write_text(json.dumps(problem))
    started = time.monotonic()
    code, out, err = run(path, None, "--time-limit", "1")
    elapsed = time.monotonic() - started
    assert code == 0, err
    assert elapsed < 10, elapsed  # a second of search, plus building and evaluating the result
    assert "excluded ranks:" in out


@pytest.mark.parametrize("limit", ["0", "-3", "nan", "5000"])
def test_bad_time_limit_exits_2(limit: str) -> None:
    code, _, err = run(EXAMPLES / "70b.json", None, "--time-limit", limit)
    assert code == 2 and "--time-limit:" in err


def test_json_nested_100k_deep_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(path)
    assert code == 2 and "nested too deeply" in err
