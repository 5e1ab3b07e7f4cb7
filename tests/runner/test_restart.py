"""`--mode restart`: the same decisions, carried out by checkpoint, stop and relaunch.

Two emulated GPUs; rank 1 slows 4x at step 4, and the controller's plan leaves it out. The
trainers must stop at a step boundary with a checkpoint, come back under the new plan from that
step, and still end with the model a single process trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import manifest, write_job

ROOT = Path(__file__).resolve().parents[2]


def test_a_replan_restarts_every_process_and_resumes_exactly(tmp_path: Path) -> None:
    job = write_job(
        tmp_path / "job.yaml",
        manifest(
            gpus=2,
            layers=2,
            global_batch=2,
            steps=12,
            schedule=[{"step": 4, "rank": 1, "factor": 4.0}],
            policy={"windowSteps": 3, "cooldownSeconds": 2},
        ),
    )
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "malleus.cli", "run", job, "--mode", "restart"]
    cmd += ["--workdir", str(work), "--report", str(tmp_path / "r.json")]
    cmd += ["--save-model", str(tmp_path / "model.pt"), "--progress", "none"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mode"] == "restart" and report["steps"] == 12
    (change,) = report["plan_changes"]
    assert change["plan"]["excluded"] == [1]
    assert 4 < change["step_applied"] <= 4 + 3 + 1
    assert change["migration_seconds"] > 0  # the downtime between the two launches
    assert change["migration_bytes"] > 0  # the checkpoint written and read back
    resumed = (work / "logs" / "launch-2" / "rank-0.log").read_text()
    assert f"at step {change['step_applied']}" in resumed  # "resumed from ... at step N"
    assert sorted(p.name for p in (work / "logs").iterdir()) == ["launch-1", "launch-2"]

    ref = tmp_path / "reference.pt"
    reference = [sys.executable, "-m", "malleus.cli", "train", job, "--reference", "--quiet"]
    subprocess.run([*reference, "--save-model", str(ref)], cwd=ROOT, check=True, timeout=300)
    import torch

    got, want = torch.load(tmp_path / "model.pt"), torch.load(ref)
    assert got.keys() == want.keys()
    assert (
        max(float((got[k] - want[k]).abs().max() / (1 + want[k].abs().max())) for k in want) <= 1e-4
    )
