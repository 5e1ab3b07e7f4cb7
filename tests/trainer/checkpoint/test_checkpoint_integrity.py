"""Checkpoints cannot be silently wrong: every corruption is refused, naming the file and piece.

One spawned 2-rank run (real gloo processes) leaves a good checkpoint; each corruption is made
on a copy of it, on disk, and `malleus train --resume` must exit 2 with the file (and piece)
named before any process starts. A second spawned run resumes the good checkpoint under
another plan and must equal, bit for bit, a run that switched plans without stopping; the
pod path (`python -m malleus.trainer`, one process per rank) must refuse a file only one rank
reads with every rank exiting 2, naming that file, never a gloo error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import Tensor

from malleus.job import ResolvedJob
from malleus.trainer import cli
from malleus.trainer.checkpoint import directory as checkpoint
from malleus.trainer.checkpoint import files as checkpoint_files
from malleus.trainer.engine.state import save_checkpoint
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.world.world import World

PY = sys.executable
MODEL = {"layers": 2, "hidden": 16, "heads": 2, "ffn": 32, "vocab": 256, "sequence": 8}
STEPS = 4


def manifest(keep: int = 2) -> dict:
    """A tiny job: one node of 2 GPUs, tp 2, 4 steps, checkpoints kept: `keep`."""
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "ckpt-test"},
        "spec": {
            "image": "malleus:test",
            "nodes": 1,
            "gpusPerNode": 2,
            "model": MODEL,
            "training": {
                "globalBatchSize": 4,
                "microBatchSize": 1,
                "steps": STEPS,
                "learningRate": 0.003,
                "warmupSteps": 1,
            },
            "parallelism": {"tp": 2},
            "checkpoint": {"keep": keep},
        },
    }


def plan_json(*pipelines: tuple[int, list[tuple[list[int], int, int]]]) -> str:
    return json.dumps(
        {
            "tp": 2,
            "pipelines": [
                {"micro_batches": m, "stages": [{"ranks": r, "layers": [a, b]} for r, a, b in s]}
                for m, s in pipelines
            ],
            "excluded": [],
        }
    )


PLAN_A = plan_json((4, [([0, 1], 0, 2)]))  # one TP group: each rank owns half the shards
PLAN_B = plan_json((2, [([1], 0, 2)]), (2, [([0], 0, 2)]))  # two pipelines of one GPU


def train(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args([*argv, "--quiet", "--no-resource-check"]))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """job.yaml, a.json, b.json and good/: the checkpoints of steps 1 and 2 under plan A."""
    root = tmp_path_factory.mktemp("ckpt")
    (root / "job.yaml").write_text(yaml.safe_dump(manifest()))
    (root / "a.json").write_text(PLAN_A)
    (root / "b.json").write_text(PLAN_B)
    rc = train(str(root / "job.yaml"), "--plan", str(root / "a.json"), "--until", "2",
               "--checkpoint-dir", str(root / "good"), "--checkpoint-every", "1")  # fmt: skip
    assert rc == 0
    return root


def resume(work: Path, ckpt: Path, *extra: str) -> int:
    job, plan = str(work / "job.yaml"), str(work / "b.json")
    return train(job, "--plan", plan, "--resume", "--checkpoint-dir", str(ckpt), *extra)


# ---- corruptions, made on disk --------------------------------------------------------------
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rewrite_manifest(step_dir: Path, edit: Callable[[dict], None], *, reseal: bool) -> None:
    """Edit the manifest; `reseal`: recompute its own sha256, as a careful forger would."""
    path = step_dir / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    if reseal:
        data["sha256"] = checkpoint_files.digest(data)
    path.write_text(json.dumps(data))


def _rewrite_piece(step_dir: Path, change: Callable[[Tensor], Tensor], *, reseal: bool) -> str:
    """Replace the first parameter of rank 1's file; `reseal`: record the new file's sha256
    and size in the manifest (and its sha256), so that only the piece checks stand between
    the damage and the resume. Returns the piece's name."""
    file = step_dir / "rank-00001.pt"
    data = torch.load(file, weights_only=True)
    name = sorted(data["params"])[0]
    data["params"][name] = change(data["params"][name])
    torch.save(data, file)
    if reseal:
        entry = {"sha256": _sha(file), "bytes": file.stat().st_size}
        _rewrite_manifest(step_dir, lambda m: m["files"].__setitem__(file.name, entry), reseal=True)
    return name


def flip_256_bytes(d: Path) -> tuple[str, ...]:
    file = d / "rank-00001.pt"
    raw = bytearray(file.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 256):
        raw[i] ^= 0xFF
    file.write_bytes(bytes(raw))
    return "rank-00001.pt: sha256 ", "the manifest recorded "


def zero_byte_file(d: Path) -> str:
    (d / "rank-00001.pt").write_bytes(b"")
    return "rank-00001.pt: 0 bytes, the manifest recorded"


def nan_piece(d: Path) -> tuple[str, ...]:
    _rewrite_piece(d, lambda t: torch.full_like(t, float("nan")), reseal=False)
    return "rank-00001.pt: ", "the manifest recorded "  # its size or checksum, before the piece


def nan_piece_resealed(d: Path) -> str:
    name = _rewrite_piece(d, lambda t: torch.full_like(t, float("nan")), reseal=True)
    return f"piece {name} (params): holds NaN or inf (the manifest recorded finite values)"


def shape_1_piece_resealed(d: Path) -> str:
    name = _rewrite_piece(d, lambda t: t.flatten()[:1].clone(), reseal=True)
    return f"piece {name} (params): shape (1,), expected"


def dtype_piece_resealed(d: Path) -> str:
    name = _rewrite_piece(d, lambda t: t.double(), reseal=True)
    return f"piece {name} (params): dtype float64, expected float32"


def shape_in_manifest_too(d: Path) -> str:
    name = _rewrite_piece(d, lambda t: t.flatten()[:1].clone(), reseal=True)
    _rewrite_manifest(d, lambda m: m["pieces"][name].__setitem__("shape", [1]), reseal=True)
    return f"piece {name} has shape [1], the model's is"


def step_edited(d: Path) -> str:
    _rewrite_manifest(d, lambda m: m.__setitem__("step", 1), reseal=False)
    return "manifest.json was changed after it was written"


def step_edited_resealed(d: Path) -> str:
    _rewrite_manifest(d, lambda m: m.__setitem__("step", 1), reseal=True)
    return "manifest.json: step 1, but the directory is step-00000002"


def step_renamed_throughout(d: Path) -> str:
    """Directory, `latest` and manifest all say step 1; the payloads still say 2."""
    _rewrite_manifest(d, lambda m: m.__setitem__("step", 1), reseal=True)
    shutil.rmtree(d.parent / "step-00000001")
    d.rename(d.parent / "step-00000001")
    (d.parent / "latest").write_text("step-00000001")
    return "holds step 2, the manifest says 1"


def manifest_malformed(d: Path) -> str:
    _rewrite_manifest(d, lambda m: m.__setitem__("files", list(m["files"])), reseal=True)
    return "manifest.json: malformed (no files or pieces)"


def manifest_deleted(d: Path) -> str:
    (d / "manifest.json").unlink()
    return "latest names step-00000002, but"


def latest_deleted(d: Path) -> str:
    (d.parent / "latest").unlink()
    return "latest is missing but"


def latest_pointing_nowhere(d: Path) -> str:
    (d.parent / "latest").write_text("step-00000099")
    return "latest names step-00000099, but"


def latest_garbage(d: Path) -> str:
    (d.parent / "latest").write_text("../../etc")
    return "'../../etc' is not a checkpoint name"


def latest_symlinked_outside(d: Path) -> str:
    outside = d.parent.parent / f"outside-{d.parent.name}"
    shutil.copytree(d, outside)
    (d.parent / "step-00000007").symlink_to(outside)
    (d.parent / "latest").write_text("step-00000007")
    return "'step-00000007' points outside"


def piece_path_escapes(d: Path) -> str:
    shutil.copy(d / "rank-00001.pt", d.parent.parent / "evil.pt")

    def edit(m: dict) -> None:
        m["files"]["../../evil.pt"] = m["files"].pop("rank-00001.pt")
        for entry in m["pieces"].values():
            if entry["file"] == "rank-00001.pt":
                entry["file"] = "../../evil.pt"

    _rewrite_manifest(d, edit, reseal=True)
    return "'../../evil.pt' points outside"


def not_weights_only(d: Path) -> str:
    """A payload with a pickled object of any class: weights_only refuses to run it."""
    file = d / "rank-00001.pt"
    data = torch.load(file, weights_only=True)
    data["extra"] = argparse.Namespace(payload="os.system")
    torch.save(data, file)
    entry = {"sha256": _sha(file), "bytes": file.stat().st_size}
    _rewrite_manifest(d, lambda m: m["files"].__setitem__(file.name, entry), reseal=True)
    return "rank-00001.pt: unreadable (UnpicklingError"


CORRUPTIONS = [
    flip_256_bytes,
    zero_byte_file,
    nan_piece,
    nan_piece_resealed,
    shape_1_piece_resealed,
    dtype_piece_resealed,
    shape_in_manifest_too,
    step_edited,
    step_edited_resealed,
    step_renamed_throughout,
    manifest_malformed,
    manifest_deleted,
    latest_deleted,
    latest_pointing_nowhere,
    latest_garbage,
    latest_symlinked_outside,
    piece_path_escapes,
    not_weights_only,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_a_corrupt_checkpoint_is_refused_naming_the_file(
    work: Path,
    tmp_path: Path,
    corrupt: Callable[[Path], str | tuple[str, ...]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(work / "good", ckpt, symlinks=True)
    said = corrupt(ckpt / "step-00000002")
    assert resume(work, ckpt) == 2  # refused by the launcher: no rank started
    err = capsys.readouterr().err
    assert all(part in err for part in ((said,) if isinstance(said, str) else said)), err
    assert "--resume" in err and "Traceback" not in err


# ---- a good checkpoint resumes exactly; retention --------------------------------------------
def test_a_good_checkpoint_resumes_under_another_plan_exactly(work: Path, tmp_path: Path) -> None:
    good = work / "good"
    assert [p.name for p in checkpoint.checkpoints(good)] == ["step-00000001", "step-00000002"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(good, ckpt)
    resumed, straight = tmp_path / "resumed.pt", tmp_path / "straight.pt"
    assert resume(work, ckpt, "--checkpoint-every", "1", "--save-model", str(resumed)) == 0
    # keep: 2 -- step 1 and 2 went once 3 and 4 were complete.
    assert [p.name for p in checkpoint.checkpoints(ckpt)] == ["step-00000003", "step-00000004"]
    assert (ckpt / "latest").read_text() == "step-00000004"
    assert not list(ckpt.glob(".*"))  # no temporary file or directory left behind

    job = str(work / "job.yaml")
    switch = f"2:{work / 'b.json'}"  # plan B in force from step index 2, as in the resumed run
    assert train(job, "--plan", str(work / "a.json"), "--switch", switch,
                 "--save-model", str(straight)) == 0  # fmt: skip
    a, b = torch.load(resumed), torch.load(straight)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resume changed the training"


def test_pod_ranks_refuse_together_naming_the_file_only_one_reads(
    work: Path, tmp_path: Path
) -> None:
    """Under torchrun only the pointer and manifest are checked before joining; each rank checks
    its own files after. Rank 1 alone reads rank-00001.pt under plan A: both exit 2, naming it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(work / "good", ckpt)
    (ckpt / "step-00000002" / "rank-00001.pt").write_bytes(b"")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("MALLEUS_EXTERNAL_STORE", None)
        args = [PY, "-m", "malleus.trainer", str(work / "job.yaml"), "--plan", str(work / "a.json")]
        args += ["--checkpoint-dir", str(ckpt), "--control-port", "-1", "--quiet"]
        procs.append(subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    for err in errs:
        assert "rank 1: " in err and "rank-00001.pt: 0 bytes, the manifest recorded" in err, err
        assert "more ranks refused" not in err  # rank 0 found its files intact, and refused too
        assert "gloo" not in err.lower() and "Traceback" not in err, err


def test_pruning_keeps_the_newest_and_never_a_later_run(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5, 9):
        (tmp_path / f"step-{step:08d}").mkdir()
    (tmp_path / ".step-00000006.tmp").mkdir()
    checkpoint._prune(tmp_path, 5, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [
        "step-00000004",
        "step-00000005",
        "step-00000009",  # not older than the new one: another run's, left alone
    ]
    checkpoint._prune(tmp_path, 5, keep=1)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-00000005", "step-00000009"]


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real gloo group of one rank in this process, for `checkpoint.save` called directly."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_diverged_checkpoint_keeps_the_older_ones(tmp_path: Path, one_rank_group: None) -> None:
    """keep: 1, yet a checkpoint holding NaN leaves the last finite one in place; it is saved
    (for a post-mortem) but refused on load as saved so."""
    spec = manifest(keep=1)
    spec["spec"].update(gpusPerNode=1, parallelism={"tp": 1})
    job = ResolvedJob.load(spec).check()
    trainer = Trainer(job, job.initial_plan(), rank=0, world=World(1), device=torch.device("cpu"))
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        trainer.step = step
        save_checkpoint(trainer, ckpt)
    assert [p.name for p in checkpoint.checkpoints(ckpt)] == ["step-00000002"]
    name = sorted(trainer.params)[0]
    with torch.no_grad():
        trainer.params[name][0] = float("nan")
    trainer.step = 3
    save_checkpoint(trainer, ckpt)
    assert [p.name for p in checkpoint.checkpoints(ckpt)] == ["step-00000002", "step-00000003"]
    assert checkpoint.read_manifest(ckpt / "step-00000003")["pieces"][name]["finite"] is False
    with pytest.raises(checkpoint.CheckpointError, match=rf"piece {name} \(params\): holds NaN"):
        checkpoint.verify(checkpoint.latest(ckpt), job)
    with pytest.raises(checkpoint.CheckpointError, match="it was saved so"):
        checkpoint.verify(checkpoint.latest(ckpt), job)
    checkpoint.verify(ckpt / "step-00000002", job)  # the good one is intact
