"""`malleus run` end to end: real trainer processes, emulated GPUs, the controller re-planning live.

The scenario (4 emulated GPUs, tp 2, 28 steps): rank 1 becomes 4x slower at step 6 and recovers
at step 18. The run must re-plan within the policy's window after each change, leave the slow
GPU out of healthy TP groups and take it back after, deliver at least 85% of the throughput the
cost model predicted for each new plan, and end with exactly the model a single process trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from malleus.job import INITIAL_GENERATION, ResolvedJob

from .conftest import manifest, write_job

ROOT = Path(__file__).resolve().parents[2]
ONSET, RECOVERY, RANK = 6, 18, 1
WINDOW = 3
STEPS = 28


def groups_of(plan: dict[str, Any], rank: int) -> list[list[int]]:
    """The TP groups (stage rank lists) that hold `rank`."""
    return [s["ranks"] for p in plan["pipelines"] for s in p["stages"] if rank in s["ranks"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("e2e")
    job = write_job(
        tmp / "job.yaml",
        manifest(
            steps=STEPS,
            schedule=[
                {"step": ONSET, "rank": RANK, "factor": 4.0},
                {"step": RECOVERY, "rank": RANK, "factor": 1.0},
            ],
            policy={"windowSteps": WINDOW, "cooldownSeconds": 2},
        ),
    )
    cmd = [sys.executable, "-m", "malleus.cli", "run", job, "--workdir", str(tmp / "work")]
    cmd += ["--report", str(tmp / "report.json"), "--plot", str(tmp / "run.png")]
    cmd += ["--save-model", str(tmp / "model.pt"), "--progress", "lines"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The reference in this process: `malleus train --reference` saves exactly this state
    # (tests/trainer/run/test_cli.py checks it), without another interpreter and torch to start.
    import torch

    from malleus.trainer.run.reference import train_reference

    torch.save(train_reference(ResolvedJob.load(job)).full_state(), tmp / "reference.pt")
    report = json.loads((tmp / "report.json").read_text())
    return {"report": report, "dir": tmp, "stdout": proc.stdout}


def test_it_trains_every_step_and_says_so(run: dict[str, Any]) -> None:
    report = run["report"]
    assert report["exit"] == {"code": 0, "reason": "completed"}
    assert report["steps"] == STEPS and report["final_loss"] is not None
    assert [r["step"] for r in report["per_step"]] == list(range(STEPS))
    rated = [r for r in report["per_step"] if r["rates"]]
    assert len(rated) >= STEPS - 3  # the scrape saw nearly every step
    assert "re-plans: 2" in run["stdout"]
    assert (run["dir"] / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_replans_follow_each_change_within_the_window(run: dict[str, Any]) -> None:
    changes = run["report"]["plan_changes"]
    first = INITIAL_GENERATION  # the runner starts where the operator does
    assert [c["generation"] for c in changes] == [first + 1, first + 2], changes
    slowed, recovered = changes
    assert f"rank {RANK} slowed" in slowed["reason"]
    assert f"rank {RANK} recovered" in recovered["reason"]
    # Seen within the window (a median needs most of it), planned during the next step.
    assert ONSET < slowed["step_applied"] <= ONSET + WINDOW + 1
    assert RECOVERY < recovered["step_applied"] <= RECOVERY + WINDOW + 1
    for c in changes:
        assert c["migration_bytes"] > 0 and c["migration_seconds"] is not None


def test_the_slow_gpu_is_set_apart_then_readmitted(run: dict[str, Any]) -> None:
    slowed, recovered = run["report"]["plan_changes"]
    initial = run["report"]["initial_plan"]
    assert groups_of(initial, RANK) == [[0, 1]]
    # While slow: excluded, or in a TP group of stragglers only (here: alone).
    apart = slowed["plan"]
    assert RANK in apart["excluded"] or all(g == [RANK] for g in groups_of(apart, RANK))
    # Recovered: re-admitted, serving in exactly one TP group (with the calibrated cost model a
    # group of one can be the faster layout on these CPUs, so its size is the planner's call).
    back = groups_of(recovered["plan"], RANK)
    assert RANK not in recovered["plan"]["excluded"] and len(back) == 1


def test_the_static_baseline_is_the_calibrated_prediction(run: dict[str, Any]) -> None:
    """The trainers calibrated under the first plan (/status): the baseline is its calibrated
    time, and the summary says so."""
    base = run["report"]["static_baseline"]
    report = run["report"]
    assert report["calibration"]["generation"] == INITIAL_GENERATION
    # every generation's own terms are kept (each re-plan's prediction used the latest before it)
    gens = [c["generation"] for c in report["calibrations"]]
    assert gens[0] == INITIAL_GENERATION and gens == sorted(set(gens)), gens
    assert report["calibrations"][0] == report["calibration"]
    assert all(c["calibration"]["layer_seconds"] > 0 for c in report["calibrations"])
    assert base["calibrated"] and "calibrated cost model" in base["label"], base
    assert "static baseline (predicted, calibrated): " in run["stdout"]


def test_each_new_plan_delivers_most_of_its_predicted_throughput(run: dict[str, Any]) -> None:
    for c in run["report"]["plan_changes"]:
        assert c["measured_steps"] >= 3, c
        assert c["predicted_speedup"] > 1.3
        assert c["throughput_vs_predicted"] >= 0.85, c


def test_the_final_model_equals_the_single_process_reference(run: dict[str, Any]) -> None:
    import torch

    got = torch.load(run["dir"] / "model.pt")
    ref = torch.load(run["dir"] / "reference.pt")
    assert got.keys() == ref.keys()
    worst = max(float((got[k] - ref[k]).abs().max() / (1 + ref[k].abs().max())) for k in ref)
    assert worst <= 1e-4
