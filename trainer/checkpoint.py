"""Plan-independent checkpoints: the set of pieces, their Adam state, the step, the RNG.

Layout on disk (one directory per checkpoint, written atomically):

    DIR/step-00000020/manifest.json   step, job shape, and which file holds each piece
    DIR/step-00000020/rank-00003.pt   the pieces rank 3 owns: params, exp_avg, exp_avg_sq, step
    DIR/step-00000020/rng.pt          the CPU RNG state of rank 0
    DIR/latest                        "step-00000020"

Every piece is written once, by its owner, as its full logical tensor, so the content does not
depend on the plan: a job can stop under one plan and resume under any other (each rank reads
the pieces it holds now, wherever they were written). Ranks write into a temporary directory
that rank 0 renames after a barrier, then `latest` is replaced: a crash leaves either the old
or the new checkpoint, never half of one. Across nodes DIR must be one shared volume
(a ReadWriteMany claim): every rank writes into it, rank 0 publishes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.job import ResolvedJob

from .parallel.optim import AdamState

__all__ = [
    "FORMAT",
    "CheckpointError",
    "LoadedPieces",
    "latest",
    "load_pieces",
    "read_manifest",
    "save",
]

FORMAT = 1
LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def _identity(job: ResolvedJob) -> dict[str, Any]:
    """What must match for a resume to continue the same training (the plan need not): the
    model's sizes and its logical shards (tp), the seed, the data and the batch."""
    training = job.spec.training
    return {
        "model": asdict(job.model) | {"tp": job.tp},
        "seed": training.seed,
        "dataset": training.dataset,
        "global_batch": training.global_batch_size,
        "micro_batch": training.micro_batch_size,
    }


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(
    directory: str | Path,
    step: int,
    job: ResolvedJob,
    rank: int,
    owners: Mapping[str, int],
    params: Mapping[str, Tensor],
    state: Mapping[str, AdamState],
    generation: int = 0,
) -> Path:
    """Collective: every rank writes the pieces it owns; rank 0 publishes. Returns the path."""
    directory = Path(directory)
    final = _step_dir(directory, step)
    tmp = directory / f".{final.name}.tmp"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    mine = sorted(name for name, owner in owners.items() if owner == rank)
    if mine:
        tmp.mkdir(parents=True, exist_ok=True)  # made by rank 0 already on a shared volume
        torch.save(
            {
                "params": {n: params[n].detach().cpu() for n in mine},
                "exp_avg": {n: state[n].exp_avg.cpu() for n in mine},
                "exp_avg_sq": {n: state[n].exp_avg_sq.cpu() for n in mine},
                "step": {n: state[n].step for n in mine},
            },
            tmp / f"rank-{rank:05d}.pt",
        )
    if rank == 0:
        torch.save(torch.get_rng_state(), tmp / "rng.pt")
    dist.barrier()
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "job": job.name,
            "step": step,
            "plan_generation": generation,
            "saved_at": time.time(),
            **_identity(job),
            "pieces": {name: f"rank-{owner:05d}.pt" for name, owner in sorted(owners.items())},
        }
        _write_text_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(directory / LATEST, final.name)
    dist.barrier()
    return final


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory`, if any."""
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path if (path / "manifest.json").exists() else None


def read_manifest(path: str | Path, job: ResolvedJob | None = None) -> dict[str, Any]:
    """The manifest of a checkpoint; with `job`, checks it continues the same training."""
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')}, expected {FORMAT}")
    if job is not None:
        want = _identity(job)
        diff = [k for k, v in want.items() if manifest.get(k) != v]
        if diff:
            details = ", ".join(f"{k}: checkpoint {manifest.get(k)} vs job {want[k]}" for k in diff)
            raise CheckpointError(f"{path} belongs to a different training ({details})")
    return manifest


class LoadedPieces:
    """Pieces read back from a checkpoint: parameters and Adam state by piece name."""

    def __init__(self, params: dict[str, Tensor], state: dict[str, AdamState], step: int) -> None:
        self.params, self.state, self.step = params, state, step


def load_pieces(
    path: str | Path, names: Iterable[str], job: ResolvedJob | None = None
) -> LoadedPieces:
    """Read the named pieces (and restore the RNG), touching only the files that hold them."""
    path = Path(path)
    manifest = read_manifest(path, job)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in manifest["pieces"]:
            raise CheckpointError(f"{path} has no piece {name!r}")
        by_file.setdefault(manifest["pieces"][name], []).append(name)
    params: dict[str, Tensor] = {}
    state: dict[str, AdamState] = {}
    for file, wanted in sorted(by_file.items()):
        data = torch.load(path / file, map_location="cpu", weights_only=True, mmap=True)
        for n in wanted:
            params[n] = data["params"][n].clone()
            state[n] = AdamState(
                data["exp_avg"][n].clone(), data["exp_avg_sq"][n].clone(), int(data["step"][n])
            )
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return LoadedPieces(params, state, int(manifest["step"]))
