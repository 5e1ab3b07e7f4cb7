"""bench/gpu.sh end to end on CPU: every stage runs, in its dry-run mode, and reports.

On a GPU machine the script measures a ~1.1B Llama; here `MALLEUS_GPU_DRY_RUN=1` runs the same
stages (the CUDA tests, skipped; one rank alone; jobs sharing the device) with a tiny model, so
the script and its Python parts are known to work before a GPU is at hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_gpu_script_dry_run(tmp_path: Path) -> None:
    env = os.environ | {
        "OUT": str(tmp_path),
        "MALLEUS_GPU_DRY_RUN": "1",
        "MALLEUS_GPU_SHARE_RANKS": "2",
        "PYTHON": sys.executable,
    }
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh")], env=env, capture_output=True, text=True
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout + done.stderr
    for stage in ("machine", "cuda-tests", "solo", "share"):
        assert f"{stage}: PASS" in summary, summary
    assert "skipped" in (tmp_path / "cuda-tests.txt").read_text()  # no CUDA here
    solo = json.loads((tmp_path / "gpu-solo.json").read_text())
    assert solo["tokens_per_second"] > 0 and 0 < solo["mfu"] < 1  # --peak-tflops 1 in dry runs
    shared = json.loads((tmp_path / "gpu-share.json").read_text())
    assert len(shared["jobs"]) == 2
    assert shared["tokens_per_second"] == sum(j["tokens_per_second"] for j in shared["jobs"])
