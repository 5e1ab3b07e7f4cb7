"""`malleus train` and `python -m malleus.trainer`: bad input, bounded joining, checkpoints.

Bad input (exit 2) is refused before any process starts, with `malleus run`'s words. The two
spawned runs stop under one plan and resume under another; the result must equal the reference
trained straight through.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from malleus.job import ResolvedJob
from malleus.planner.cost import stage_memory_mb
from malleus.runner import cli as runner_cli
from malleus.trainer import cli
from malleus.trainer.checkpoint.directory import latest, read_manifest
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.run.reference import train_reference
from malleus.trainer.world.errors import LaunchError
from malleus.trainer.world.world import World

ROOT = Path(__file__).resolve().parents[3]
PY = sys.executable


SMALL_MODEL = {"layers": 4, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}


def job_manifest(
    nodes: int = 1, gpus: int = 4, model: dict | None = None, **resources: int
) -> dict:
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "cli-test"},
        "spec": {
            "image": "malleus:test",
            "nodes": nodes,
            "gpusPerNode": gpus,
            "model": model or SMALL_MODEL,
            "training": {
                "globalBatchSize": 8,
                "microBatchSize": 1,
                "steps": 4,
                "learningRate": 0.003,
                "warmupSteps": 1,
            },
            "parallelism": {"tp": 2},
            **({"resources": resources} if resources else {}),
        },
    }


def write(path: Path, obj: object) -> str:
    path.write_text(yaml.safe_dump(obj) if path.suffix == ".yaml" else json.dumps(obj))
    return str(path)


def stage(ranks: list[int], a: int, b: int) -> dict:
    return {"ranks": ranks, "layers": [a, b]}


def plan(*pipelines: tuple[int, list[dict]], excluded: tuple[int, ...] = ()) -> dict:
    return {
        "tp": 2,
        "pipelines": [{"micro_batches": m, "stages": s} for m, s in pipelines],
        "excluded": list(excluded),
    }


def parse(*argv: str) -> argparse.Namespace:
    """`malleus train` arguments. These jobs time their 1-4 ranks for real, which wants a core
    per rank: the resource check would refuse them on a 2-core machine (it has its own test)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args([*argv, "--no-resource-check"])


PLAN_A = plan((5, [stage([0, 1], 0, 1), stage([2], 1, 4)]), (3, [stage([3], 0, 4)]))
PLAN_B = plan((8, [stage([3, 2], 0, 3), stage([1], 3, 4)]), excluded=(0,))


# ---- bad input ------------------------------------------------------------------------------
BAD = {
    "a rank twice": (
        plan((4, [stage([0, 1], 0, 4)]), (4, [stage([1, 2], 0, 4)]), excluded=(3,)),
        "rank 1 is also in",
    ),
    "a gap in the layers": (
        plan((8, [stage([0, 1], 0, 1), stage([2, 3], 2, 4)])),
        "starts at 2 but the previous stage ends at 1 (a gap)",
    ),
    "a rank beyond the world": (
        plan((8, [stage([0, 1], 0, 2), stage([2, 9], 2, 4)]), excluded=(3,)),
        "rank 9 is beyond the world (0..3)",
    ),
}


@pytest.mark.parametrize("what", list(BAD))
def test_invalid_plan_exits_2_with_the_validator_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    bad, message = BAD[what]
    job = write(tmp_path / "job.yaml", job_manifest())
    t0 = time.monotonic()
    rc = cli.main(parse(job, "--plan", write(tmp_path / "plan.json", bad)))
    assert rc == 2
    assert message in capsys.readouterr().err
    assert time.monotonic() - t0 < 10  # refused before spawning anything


def test_plan_over_the_memory_bound_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Capacity between what the uniform plan needs and what one GPU holding everything needs.
    wide = SMALL_MODEL | {"hidden": 256, "ffn": 1024}  # MBs per layer-shard, not KBs
    job = ResolvedJob.load(write(tmp_path / "probe.yaml", job_manifest(model=wide)))
    problem = job.problem()
    need_uniform = stage_memory_mb(problem, 1, 4, 1, 0, 4)
    need_one = stage_memory_mb(problem, 2, 4, 1, 0, 8)
    capacity = int((need_uniform + need_one) / 2)
    assert need_uniform < capacity < need_one
    job = write(tmp_path / "job.yaml", job_manifest(model=wide, gpuMemoryMiB=capacity))
    one = plan((8, [stage([0], 0, 4)]), excluded=(1, 2, 3))
    assert cli.main(parse(job, "--plan", write(tmp_path / "one.json", one))) == 2
    assert "over the capacity" in capsys.readouterr().err


def test_bad_manifest_and_malformed_plan_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = job_manifest()
    broken["spec"]["parallelism"]["tp"] = 3
    assert cli.main(parse(write(tmp_path / "bad.yaml", broken))) == 2
    assert "tp" in capsys.readouterr().err
    job = write(tmp_path / "job.yaml", job_manifest())
    assert cli.main(parse(job, "--plan", write(tmp_path / "p.json", {"tp": 2}))) == 2
    assert "pipelines" in capsys.readouterr().err


def _bad_files(tmp_path: Path) -> dict[str, str]:
    tp3 = job_manifest()
    tp3["spec"]["parallelism"]["tp"] = 3
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x7fELF\x00\x01")
    prose = tmp_path / "prose.yaml"
    prose.write_text("```bash\nmalleus train\n```\n")
    return {
        "missing": str(tmp_path / "missing.yaml"),
        "binary": str(binary),
        "not YAML": str(prose),
        "tp 3": write(tmp_path / "tp3.yaml", tp3),
    }


def test_train_refuses_a_bad_job_with_the_words_of_malleus_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_parser = argparse.ArgumentParser()
    runner_cli.add_arguments(run_parser)
    for what, path in _bad_files(tmp_path).items():
        assert cli.main(parse(path)) == 2, what
        train_err = capsys.readouterr().err
        assert runner_cli.main(run_parser.parse_args([path, "--no-resource-check"])) == 2, what
        run_err = capsys.readouterr().err
        assert train_err == run_err, what
        assert (
            train_err.startswith(f"invalid MalleusJob in {path}") and "Traceback" not in train_err
        )


def test_a_job_too_large_for_this_machine_is_refused_at_once() -> None:
    # 64 ranks of llama-70b: refused by the resource check, as `malleus run` refuses it,
    # before any rank starts (a start would take minutes and all the memory).
    t0 = time.monotonic()
    proc = subprocess.run(
        [PY, "-m", "malleus.cli", "train", str(ROOT / "examples" / "llama-70b.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "machine: too small for 64 ranks" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30


def test_worker_rejects_a_bad_plan_before_joining(tmp_path: Path) -> None:
    # MASTER_PORT points nowhere: exit 2 proves the plan was refused before any connection.
    job = write(tmp_path / "job.yaml", job_manifest())
    bad = write(tmp_path / "plan.json", BAD["a gap in the layers"][0])
    env = dict(os.environ, RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(_closed_port())
    proc = subprocess.run(
        [PY, "-m", "malleus.trainer", job, "--plan", bad, "--init-timeout", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "(a gap)" in proc.stderr


def test_cli_module_imports_without_torch() -> None:
    code = "import sys, malleus.trainer.cli; print('torch' in sys.modules)"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- joining is bounded ---------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_master_fails_fast_naming_it() -> None:
    port = _closed_port()
    env = DistEnv(rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=port)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=f"127.0.0.1:{port}"):
        init_distributed(env, World(2), init_timeout_s=1.0)
    assert time.monotonic() - t0 < 15


def test_missing_rank_fails_fast_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLEUS_EXTERNAL_STORE", raising=False)
    port = _closed_port()
    env = DistEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=port)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=rf"ranks \[1\] of 2 did not join at 127.0.0.1:{port}"):
        init_distributed(env, World(2), init_timeout_s=1.0)
    assert time.monotonic() - t0 < 15


def test_missing_torchrun_environment_is_named() -> None:
    with pytest.raises(LaunchError, match="MASTER_ADDR, MASTER_PORT"):
        DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "2"})


# ---- end to end -----------------------------------------------------------------------------
def test_stop_under_one_plan_resume_under_another(tmp_path: Path) -> None:
    job = write(tmp_path / "job.yaml", job_manifest())
    ckpt, model = tmp_path / "ckpt", tmp_path / "model.pt"
    first = ("--plan", write(tmp_path / "a.json", PLAN_A), "--until", "2")
    rc = cli.main(
        parse(job, *first, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--quiet")
    )
    assert rc == 0
    assert latest(ckpt).name == "step-00000002"
    assert read_manifest(latest(ckpt))["step"] == 2
    assert not list(ckpt.glob(".*tmp"))  # nothing half-written left behind
    second = ("--plan", write(tmp_path / "b.json", PLAN_B), "--resume")
    rc = cli.main(
        parse(job, *second, "--checkpoint-dir", str(ckpt), "--save-model", str(model), "--quiet")
    )
    assert rc == 0
    assert latest(ckpt).name == "step-00000004"

    torch.set_num_threads(1)
    ref = train_reference(ResolvedJob.load(job)).full_state()
    got = torch.load(model)
    assert got.keys() == ref.keys()
    worst = max(float((got[k] - ref[k]).abs().max() / (1 + ref[k].abs().max())) for k in ref)
    assert worst <= 1e-4

    ref_path = tmp_path / "ref.pt"
    assert cli.main(parse(job, "--reference", "--save-model", str(ref_path), "--quiet")) == 0
    assert all(torch.equal(torch.load(ref_path)[k], ref[k]) for k in ref)


def test_resume_refuses_a_different_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    job = write(tmp_path / "job.yaml", job_manifest(nodes=1, gpus=2))
    one = write(tmp_path / "one.json", plan((8, [stage([0, 1], 0, 4)])))
    assert (
        cli.main(
            parse(job, "--plan", one, "--until", "1", "--checkpoint-dir", str(ckpt), "--quiet")
        )
        == 0
    )
    other = job_manifest(nodes=1, gpus=2)
    other["spec"]["training"]["seed"] = 99
    job2 = write(tmp_path / "job2.yaml", other)
    assert (
        cli.main(parse(job2, "--plan", one, "--resume", "--checkpoint-dir", str(ckpt), "--quiet"))
        == 2
    )
    assert "seed: checkpoint 1234 vs job 99" in capsys.readouterr().err


def test_torchrun_entry_trains_two_ranks(tmp_path: Path) -> None:
    """The pod path: rank 0 serves the rendezvous, both join from the environment alone."""
    job = write(tmp_path / "job.yaml", job_manifest(nodes=1, gpus=2))
    one = write(tmp_path / "one.json", plan((8, [stage([1, 0], 0, 4)])))
    port = _closed_port()
    model = tmp_path / "model.pt"
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        env.pop("MALLEUS_EXTERNAL_STORE", None)
        args = [PY, "-m", "malleus.trainer", job, "--plan", one, "--steps", "2", "--quiet"]
        args += ["--save-model", str(model), "--control-port", "0" if rank == 0 else "-1"]
        procs.append(
            subprocess.Popen(
                args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    torch.set_num_threads(1)
    ref = train_reference(ResolvedJob.load(job), steps=2).full_state()
    got = torch.load(model)
    assert max(float((got[k] - ref[k]).abs().max() / (1 + ref[k].abs().max())) for k in ref) <= 1e-4
