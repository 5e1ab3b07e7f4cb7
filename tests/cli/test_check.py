"""`malleus check`: the resolved job and its initial plan, exactly what the operator decides."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

from malleus.cli import main
from malleus.job import INITIAL_GENERATION, PRESETS, ResolvedJob
from malleus.job.memory import decoder_parameters, model_parameters
from malleus.planner import Plan, validate_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"


def check(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", *argv])
    return code, out.getvalue(), err.getvalue()


def test_a_valid_job_shows_its_resolved_sizes_plan_and_step_time() -> None:
    code, out, err = check(str(TINY))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "job tiny-cpu: valid"
    assert lines[1] == "world: 2 nodes x 4 GPUs = 8 ranks"
    assert lines[2].startswith("model: preset tiny: 8 layers, hidden 64, heads 4, ffn 128, ")
    assert "; 361,536 parameters" in lines[2]  # exactly the trainer's model's
    assert "training: 8 micro-batches of 1 per step, 512 tokens per step, 30 steps" in out
    assert "emulation: on, one layer-shard 5 ms forward + 10 ms backward" in out
    assert "straggler policy: threshold 1.2, hysteresis 0.3, windowSteps 5" in out
    assert "-> 4 pipelines (generation 1)" in out and "pipeline micro-b stage" in out
    assert "predicted step time: 16.0 (layer-time units" in out
    assert lines[-1] == "predicted step time: 0.240 s on the emulated clock"  # 16 x 15 ms


def test_json_verdict_is_the_plan_every_entry_point_starts_with() -> None:
    code, out, _ = check(str(TINY), "--json")
    assert code == 0
    verdict = json.loads(out)
    assert verdict["valid"] is True
    job = ResolvedJob.load(TINY)
    described = verdict["job"]
    assert (described["world"], described["tp"], described["micro_batches"]) == (8, 2, 8)
    assert described["parameters"] == decoder_parameters(job.model)
    assert described["tokens_per_step"] == job.tokens_per_step
    plan = Plan.model_validate(verdict["plan"])
    assert plan.generation == INITIAL_GENERATION
    assert validate_plan(job.problem(), plan) == []
    assert plan.pipelines == job.initial_plan().pipelines
    assert plan.estimate is not None and job.unit_seconds is not None
    assert verdict["predicted_step_seconds"] == plan.estimate.step_time * job.unit_seconds


def test_the_parameter_count_is_the_trainers_model_exactly() -> None:
    """`check` prints `decoder_parameters`, which must count what the trainer's decoder holds
    (the memory model's `model_parameters` is an estimate on the safe side)."""
    import dataclasses
    import math

    from malleus.trainer.model.decoder import param_specs

    for preset in PRESETS.values():
        gqa = dataclasses.replace(
            preset, kv_heads=max(1, preset.heads // 4), tied_embeddings=True, attention_bias=True
        )
        for cfg in (preset, gqa):
            held = sum(math.prod(spec.shape) for spec in param_specs(cfg))
            assert decoder_parameters(cfg) == held, cfg
            assert model_parameters(cfg) >= held


def test_a_job_without_emulation_has_no_seconds() -> None:
    code, out, _ = check(str(ROOT / "examples" / "llama-70b.yaml"), "--json")
    assert code == 0
    verdict = json.loads(out)
    assert verdict["job"]["world"] == 64 and verdict["job"]["emulation"] is None
    assert verdict["predicted_step_seconds"] is None


def test_every_fault_is_listed_with_its_path_and_json_says_so_too(tmp_path: Path) -> None:
    text = TINY.read_text().replace("tp: 2", "tp: 3").replace("steps: 30", "steps: 0")
    job = tmp_path / "bad.yaml"
    job.write_text(text)
    code, out, err = check(str(job))
    assert (code, out) == (2, "")
    assert err.startswith(f"invalid MalleusJob in {job} (")
    faults = [line for line in err.splitlines() if line.startswith("  - ")]
    assert any(f.startswith("  - spec.training.steps: ") for f in faults)
    assert any(f.startswith("  - spec.parallelism.tp: ") for f in faults)
    code, out, json_err = check(str(job), "--json")
    assert code == 2 and json_err == err
    verdict = json.loads(out)
    assert verdict["valid"] is False
    assert [f"  - {f['path']}: {f['message']}" for f in verdict["faults"]] == faults


def test_a_job_no_layout_fits_is_the_planners_verdict(tmp_path: Path) -> None:
    job = tmp_path / "small-gpus.yaml"
    job.write_text(TINY.read_text().replace("memory: 4Gi", "memory: 4Gi\n    gpuMemoryMiB: 1"))
    code, out, err = check(str(job))
    assert (code, out) == (2, "")
    assert "no parallel layout of this job fits its GPUs" in err and "capacity 1 MB" in err


def test_check_and_plan_never_import_torch() -> None:
    """The operator's image has no torch: `check` and `plan` must not need it."""
    code = (
        "import contextlib, io, sys\n"
        "from malleus.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['check', {str(TINY)!r}]) == 0\n"
        f"    assert main(['plan', {str(TINY)!r}, '--rates', '1=3']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
