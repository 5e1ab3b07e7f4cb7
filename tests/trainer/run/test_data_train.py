"""`malleus train` on the user's own data: two plans (a live switch), a stop and a resume under
a third layout, every step in the `--report`, and the same losses as the one-process reference;
then the README's "Train your own model" example end to end."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from malleus.cli import main as malleus
from malleus.job.data import SAMPLE_TOKENS, sample_spans
from malleus.runner.record import StepRecord
from malleus.runner.report import RunFacts, build_report
from malleus.trainer import cli
from malleus.trainer.data.samples import TokenStream, WindowSource
from tests.trainer.data_cases import corpus_tokens, data_job, write_tokens

ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    """Two ranks timed for real want two cores; the resource check has tests of its own."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args([*argv, "--no-resource-check", "--quiet"])


def write(path: Path, obj: Any) -> str:
    path.write_text(yaml.safe_dump(obj) if path.suffix == ".yaml" else json.dumps(obj))
    return str(path)


def one_group(m: int) -> dict[str, Any]:
    return {
        "tp": 2,
        "pipelines": [{"micro_batches": m, "stages": [{"ranks": [0, 1], "layers": [0, 2]}]}],
    }


# Two pipelines of one GPU each (2 shards per GPU), unequal micro-batches.
TWO_PIPELINES = {
    "tp": 2,
    "pipelines": [
        {"micro_batches": 3, "stages": [{"ranks": [1], "layers": [0, 2]}]},
        {"micro_batches": 1, "stages": [{"ranks": [0], "layers": [0, 2]}]},
    ],
}
# One pipeline of two stages, one GPU each.
TWO_STAGES = {
    "tp": 2,
    "pipelines": [
        {
            "micro_batches": 4,
            "stages": [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 2]}],
        }
    ],
}


def test_own_tokens_two_plans_resume_and_report_equal_the_reference(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "train.bin", corpus_tokens(3000))
    job = write(tmp_path / "job.yaml", data_job({"format": "tokens", "path": str(tokens)}))
    ckpt = str(tmp_path / "ckpt")
    first = tmp_path / "first.json"
    argv = ("--plan", write(tmp_path / "a.json", one_group(4)), "--until", "3")
    switch = ("--switch", f"2:{write(tmp_path / 'b.json', TWO_PIPELINES)}")
    assert (
        cli.main(parse(job, *argv, *switch, "--checkpoint-dir", ckpt, "--report", str(first))) == 0
    )
    second = tmp_path / "second.json"
    resume = (
        "--plan",
        write(tmp_path / "c.json", TWO_STAGES),
        "--resume",
        "--checkpoint-dir",
        ckpt,
    )
    assert cli.main(parse(job, *resume, "--report", str(second))) == 0
    ref = tmp_path / "ref.json"
    assert cli.main(parse(job, "--reference", "--report", str(ref))) == 0

    a, b, r = (json.loads(p.read_text()) for p in (first, second, ref))
    assert [row["step"] for row in a["per_step"]] == [0, 1, 2]
    assert [row["step"] for row in b["per_step"]] == [3]
    assert (a["exit"], b["exit"]) == (
        {"code": 0, "reason": "stopped after step 3 of 4"},
        {"code": 0, "reason": "done"},
    )
    # A --plan file without a generation is generation 0; the switch, numbered 1, is in force
    # from step 2 on (two steps done), after a migration that moved bytes.
    assert [row["generation"] for row in a["per_step"]] == [0, 0, 1]
    assert [(s["generation"], s["step"]) for s in a["switches"]] == [(0, 0), (1, 2)]
    assert a["switches"][1]["migration_bytes"] > 0
    assert [g["generation"] for g in a["generations"]] == [0, 1]
    # Same samples at the same step under every layout: the losses are the reference's.
    losses = [row["loss"] for row in a["per_step"] + b["per_step"]]
    want = [row["loss"] for row in r["per_step"]]
    assert r["mode"] == "reference" and len(want) == 4
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(losses, want, strict=True)), (
        losses,
        want,
    )
    assert b["final_loss"] == losses[-1] < losses[0]
    # The shape `malleus run` writes, key for key.
    facts = RunFacts("j", "live", 1, 2, 2, 64, 5, 4, "now", 1.0, 0, "done")
    # `windows`, `static_baseline` (and why none applies: `static_baseline_skipped`),
    # `calibration` (the static baseline's, from /status) and `calibrations` (every
    # generation's) need the runner's measured rates, cost model and observations: only
    # `malleus run`'s report has them; every other key is shared.
    runner_only = {
        "windows",
        "static_baseline",
        "static_baseline_skipped",
        "calibration",
        "calibrations",
    }
    assert set(a) == set(build_report(facts, [], [], [])) - runner_only
    assert set(a["per_step"][0]) == set(StepRecord(0).to_dict(1))
    assert set(a["per_step"][0]["rates"]) == {"0", "1"}


def test_own_model_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README "Train your own model": the script, `malleus check`, `malleus train --report`."""
    monkeypatch.chdir(tmp_path)  # the example's paths are relative to the working directory
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_llama.py"), "own-model"],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "own-model" / "llama" / "config.json").is_file()
    example = str(ROOT / "examples" / "own-model.yaml")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert malleus(["check", example]) == 0
    assert out.getvalue().startswith("job own-model: valid")
    report = tmp_path / "report.json"
    assert cli.main(parse(example, "--steps", "3", "--report", str(report))) == 0
    steps = json.loads(report.read_text())["per_step"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_an_id_the_sample_missed_stops_the_run_and_the_report_says_why(tmp_path: Path) -> None:
    """The file check reads a sample; the trainer refuses the id when a step reads it, and rank
    0's report keeps the steps done and the reason."""
    ids = np.zeros(4 * SAMPLE_TOKENS + 1, np.int64)
    stream = TokenStream([ids], "probe")
    source = WindowSource(stream, 16, 256, seed=1234)  # the job's sequence and seed
    sampled = [range(a, a + n) for a, n in sample_spans(len(ids))]
    step1 = [source.window(i) * 16 for i in range(4, 8)]  # the windows of step 1 (batch 4)
    bad = next(s + 8 for s in step1 if not any(s + 8 in span for span in sampled))
    ids[bad] = 999
    tokens = write_tokens(tmp_path / "train.bin", ids)
    job = write(tmp_path / "job.yaml", data_job({"format": "tokens", "path": str(tokens)}))
    report = tmp_path / "report.json"
    assert (
        cli.main(
            parse(job, "--plan", write(tmp_path / "a.json", one_group(4)), "--report", str(report))
        )
        == 1
    )
    got = json.loads(report.read_text())
    assert [row["step"] for row in got["per_step"]] == [0]
    assert got["exit"]["code"] == 1
    assert (
        f"token id 999 at token {bad:,} is >= the model's vocabulary (256)" in got["exit"]["reason"]
    )
