"""Plan-independent checkpoints that cannot be silently wrong.

Layout on disk (one directory per checkpoint, written atomically):

    DIR/step-00000020/manifest.json   step, job identity, every file's sha256 and size, every
                                      piece's file, shape, dtypes and finiteness; its own sha256
    DIR/step-00000020/rank-00003.pt   the pieces rank 3 owns (params, exp_avg, exp_avg_sq, Adam
                                      steps) and the step they belong to
    DIR/step-00000020/rng.pt          the CPU RNG state of rank 0, and the step
    DIR/latest                        "step-00000020"

Every piece is written once, by its owner, as its full logical tensor, so the content does not
depend on the plan: a job can stop under one plan and resume under any other (each rank reads
the pieces it holds now, wherever they were written). Ranks write into a temporary directory
that rank 0 renames after every rank reported its files; then `latest` is replaced (temp file,
fsync, rename, fsync of DIR): a crash leaves either the old or the new checkpoint, never half
of one. Across nodes DIR must be one shared volume (a ReadWriteMany claim).

Nothing is trusted on load. `latest` must name a `step-N` directory inside DIR (its absence
while checkpoints exist is an error, not a fresh start); the manifest must match its own sha256
and the step its directory and every payload name; each file read must match its sha256 and
size; each piece must have its recorded and the model's shape, its recorded dtypes, and finite
values. Every refusal is a `CheckpointError` naming the file and the piece. Files are loaded
with `weights_only=True` and only from inside the checkpoint's directory, and only regular files
are read (`latest` and the manifest up to a size bound): a `latest` linked to `/dev/zero` is a
CheckpointError, not a MemoryError.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.job import ResolvedJob
from malleus.trainer.model.decoder import pieces
from malleus.trainer.parallel.optim import AdamState
from malleus.trainer.world.exchange import PayloadError, decode_json, encode_json, gather_bytes
from malleus.trainer.world.faults import fault_point, pause_point
from malleus.trainer.world.world import World

from . import files
from .files import KINDS, MANIFEST, CheckpointError

__all__ = [
    "FORMAT",
    "CheckpointError",
    "LoadedPieces",
    "checkpoints",
    "latest",
    "load_pieces",
    "read_manifest",
    "save",
    "verify",
]

log = logging.getLogger(__name__)

FORMAT = 2
LATEST, RNG = "latest", "rng.pt"
_STEP_NAME = re.compile(r"step-(\d{8})")


def _identity(job: ResolvedJob) -> dict[str, Any]:
    """What must match for a resume to continue the same training (the plan need not): the
    model's sizes and its logical shards (tp), the seed, the data and the batch."""
    training = job.spec.training
    return {
        "model": asdict(job.model) | {"tp": job.tp},
        "seed": training.seed,
        "dataset": training.dataset,
        "data": training.data.model_dump(mode="json") if training.data is not None else None,
        "global_batch": training.global_batch_size,
        "micro_batch": training.micro_batch_size,
    }


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoint directories under `directory`, oldest step first (temporary
    ones, `.step-N.tmp`, are not checkpoints)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


# ---- writing --------------------------------------------------------------------------------
def save(
    directory: str | Path,
    step: int,
    job: ResolvedJob,
    rank: int,
    owners: Mapping[str, int],
    params: Mapping[str, Tensor],
    state: Mapping[str, AdamState],
    generation: int = 0,
    *,
    world: World,
    device: torch.device | None = None,
    plan: Mapping[str, Any] | None = None,
) -> Path:
    """Collective: every rank writes the pieces it owns; the coordinator of `world` (rank 0
    until a recovery moves it) publishes and prunes (keeping `spec.checkpoint.keep`). Returns
    the path. `rank` is this rank's GPU id; `device` where its collectives run (default: its
    tensors', else the CPU); `plan` the plan in force (JSON), kept in the manifest so that a
    run continued from this checkpoint goes on under it, whoever made it (a recovery's plan
    is never published anywhere else)."""
    directory = Path(directory)
    final = _step_dir(directory, step)
    tmp = directory / f".{final.name}.tmp"
    lead = world.coordinator()
    if rank == lead:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    world.wait(dist.barrier(async_op=True))
    pause_point("checkpoint", rank, step)  # tests: a slow write is not a hang
    written: dict[str, Any] = {}  # file name -> {sha256, bytes}
    described: dict[str, Any] = {}  # piece name -> {file, shape, dtypes, finite}
    mine = sorted(name for name, owner in owners.items() if owner == rank)
    if mine:
        tmp.mkdir(parents=True, exist_ok=True)  # made by rank 0 already on a shared volume
        name = _rank_file(rank)
        payload: dict[str, Any] = {
            "step": step,
            "params": {n: params[n].detach().cpu() for n in mine},
            "exp_avg": {n: state[n].exp_avg.cpu() for n in mine},
            "exp_avg_sq": {n: state[n].exp_avg_sq.cpu() for n in mine},
            "adam_step": {n: state[n].step for n in mine},
        }
        written[name] = files.save_hashed(payload, tmp / name)
        for n in mine:
            described[n] = {"file": name, **files.describe({k: payload[k][n] for k in KINDS})}
    fault_point("checkpoint", rank, step, store=world.store)
    if rank == lead:
        written[RNG] = files.save_hashed({"step": step, "rng": torch.get_rng_state()}, tmp / RNG)
    where = device if device is not None else _device_of(params)
    reports = _gather_reports(written, described, lead, owners, world, where)
    if reports is not None:
        for their_files, their_pieces in reports:
            written.update(their_files)
            described.update(their_pieces)
        if set(described) != set(owners):
            raise CheckpointError(
                f"{tmp}: pieces not written: {sorted(set(owners) - set(described))[:4]}"
            )
        manifest = {
            "format": FORMAT,
            "job": job.name,
            "step": step,
            "plan_generation": generation,
            "plan": dict(plan) if plan is not None else None,
            "saved_at": time.time(),
            **_identity(job),
            "files": dict(sorted(written.items())),
            "pieces": dict(sorted(described.items())),
        }
        manifest["sha256"] = files.digest(manifest)
        files.write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        _publish(directory, tmp, final)
        if all(p["finite"] for p in described.values()):  # a diverged run keeps the good ones
            _prune(directory, step, job.spec.checkpoint.keep)
        else:
            log.warning("checkpoint %s holds non-finite values: older ones are kept", final)
    world.wait(dist.barrier(async_op=True))
    return final


def _device_of(params: Mapping[str, Tensor]) -> torch.device:
    """Where this rank's tensors are (the CPU when it holds none)."""
    return next(iter(params.values())).device if params else torch.device("cpu")


def _rank_file(gpu: int) -> str:
    return f"rank-{gpu:05d}.pt"


def _gather_reports(
    written: dict[str, Any],
    described: dict[str, Any],
    lead: int,
    owners: Mapping[str, int],
    world: World,
    device: torch.device,
) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    """Collective: the other ranks' (files, pieces) on the coordinator `lead`, None elsewhere;
    JSON bytes, never a pickle (trainer/world/exchange.py). Each rank speaks for itself only: a
    report that is not two JSON objects, lists a file but the sender's own `rank-GPU.pt`, or
    describes a piece the sender does not own is a CheckpointError naming the GPU (a rank
    cannot put its tensors in the manifest as another's)."""
    what = "the checkpoint's file reports"
    try:
        got = gather_bytes(
            encode_json([written, described]), lead, world=world, device=device, what=what
        )
        if got is None:
            return None
        out = []
        for gpu, data in sorted(got.items()):
            if gpu == lead:  # its own, already in `written` and `described`
                continue
            report = decode_json(data, gpu, what)
            if not (
                isinstance(report, list)
                and len(report) == 2
                and all(isinstance(part, dict) for part in report)
            ):
                raise PayloadError(
                    f"{what}: GPU {gpu} sent {str(report)[:200]}, not [files, pieces]"
                )
            their_files, their_pieces = report
            own = _rank_file(gpu)
            stray = [f for f in their_files if f != own]
            stray += [p for p in their_pieces if owners.get(p) != gpu]
            stray += [
                p
                for p, e in their_pieces.items()
                if not isinstance(e, dict) or e.get("file") != own
            ]
            if stray:
                raise PayloadError(f"{what}: GPU {gpu} reported {stray[0]!r:.120}, not its own")
            out.append((their_files, their_pieces))
        return out
    except PayloadError as e:
        raise CheckpointError(str(e)) from None


def _publish(directory: Path, tmp: Path, final: Path) -> None:
    """Move the complete `tmp` into place as `final` and point `latest` at it. The new
    `latest` is written and fsync'd first, so between the directory's rename and the
    pointer's there is nothing but a rename; a step saved again (a resumed run's last step)
    replaces the old directory only once the new one is complete."""
    pointer = files.stage_text(directory / LATEST, final.name)
    old = directory / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    os.replace(pointer, directory / LATEST)
    files.fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)


def _prune(directory: Path, step: int, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints up to `step` (one from a later step, left by
    another run in this directory, is not older and stays)."""
    older = [p for p in checkpoints(directory) if int(p.name[5:]) < step]
    for path in older[: max(0, len(older) - (keep - 1))]:
        try:
            shutil.rmtree(path)
        except OSError as e:  # a shared volume may refuse; training need not stop for that
            log.warning("could not delete old checkpoint %s: %s", path, e)


# ---- reading --------------------------------------------------------------------------------
def latest(directory: str | Path) -> Path | None:
    """The checkpoint `directory/latest` names; None only when `directory` holds none at all.

    A missing or broken `latest` while checkpoints exist raises: resuming must never turn into
    a silent restart from step 0."""
    directory = Path(directory)
    pointer = directory / LATEST
    saved = checkpoints(directory)
    if not pointer.exists() and not pointer.is_symlink():
        if saved:
            names = ", ".join(p.name for p in saved[-3:])
            raise CheckpointError(
                f"{pointer} is missing but {directory} holds checkpoints ({names}); refusing "
                "to start over from step 0 (restore it, or use another directory)"
            )
        return None
    name = files.read_text_bounded(pointer, files.MAX_POINTER_BYTES).strip()
    if not _STEP_NAME.fullmatch(name):
        raise CheckpointError(f"{pointer}: {name[:80]!r} is not a checkpoint name (step-NNNNNNNN)")
    path = files.inside(directory, name, pointer)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {name}, but {path / MANIFEST} does not exist")
    return path


def read_manifest(path: str | Path, job: ResolvedJob | None = None) -> dict[str, Any]:
    """The manifest of a checkpoint, checked against its own sha256 and its directory's step;
    with `job`, also that it continues the same training and holds every piece of the model
    with the model's shape."""
    path = Path(path)
    file = path / MANIFEST
    text = files.read_text_bounded(file, files.MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{file}: format {found}, expected {FORMAT}")
    if manifest.get("sha256") != files.digest(manifest):
        raise CheckpointError(f"{file} was changed after it was written (its sha256 differs)")
    named = _STEP_NAME.fullmatch(path.name)
    if named is None or manifest.get("step") != int(named[1]):
        raise CheckpointError(
            f"{file}: step {manifest.get('step')!r}, but the directory is {path.name}"
        )
    listed, described = manifest.get("files"), manifest.get("pieces")
    if not isinstance(listed, dict) or not isinstance(described, dict):
        raise CheckpointError(f"{file}: malformed (no files or pieces)")
    for name, entry in listed.items():
        files.inside(path, name, file)
        if not isinstance(entry, dict) or not {"sha256", "bytes"} <= set(entry):
            raise CheckpointError(f"{file}: malformed entry for file {name!r}")
    for piece, entry in described.items():
        if not isinstance(entry, dict) or not {"file", "shape", "dtypes", "finite"} <= set(entry):
            raise CheckpointError(f"{file}: malformed entry for piece {piece}")
        if entry["file"] not in listed:
            raise CheckpointError(f"{file}: piece {piece} is in {entry['file']!r}, not listed")
    if job is not None:
        _check_identity(path, manifest, job)
    return manifest


def _check_identity(path: Path, manifest: dict[str, Any], job: ResolvedJob) -> None:
    want = _identity(job)
    diff = [k for k, v in want.items() if manifest.get(k) != v]
    if diff:
        details = ", ".join(f"{k}: checkpoint {manifest.get(k)} vs job {want[k]}" for k in diff)
        raise CheckpointError(f"{path} belongs to a different training ({details})")
    shapes = {p.name: list(p.shape(job.tp)) for p in pieces(job.model, job.tp)}
    missing = sorted(set(shapes) - set(manifest["pieces"]))
    if missing:
        raise CheckpointError(f"{path / MANIFEST}: no piece {missing[0]} ({len(missing)} missing)")
    for name, entry in manifest["pieces"].items():
        if shapes.get(name) != entry.get("shape"):
            raise CheckpointError(
                f"{path / MANIFEST}: piece {name} has shape {entry.get('shape')}, "
                f"the model's is {shapes.get(name)}"
            )


def _pieces(
    path: Path, manifest: dict[str, Any], names: Iterable[str]
) -> Iterator[tuple[str, dict[str, Tensor], int]]:
    """(name, tensors, Adam step) of the named pieces, each file checked once before use."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in manifest["pieces"]:
            raise CheckpointError(f"{path / MANIFEST} has no piece {name!r}")
        by_file.setdefault(manifest["pieces"][name]["file"], []).append(name)
    for file, wanted in sorted(by_file.items()):
        data = files.load_file(path, file, manifest)
        for n in wanted:
            yield n, *files.checked_piece(path / file, n, data, manifest["pieces"][n])


@dataclass
class LoadedPieces:
    """Pieces read back from a checkpoint: parameters and Adam state by piece name, the step,
    and the RNG state to restore."""

    params: dict[str, Tensor]
    state: dict[str, AdamState]
    step: int
    rng: Tensor


def load_pieces(
    path: str | Path, names: Iterable[str], job: ResolvedJob | None = None
) -> LoadedPieces:
    """Read and check the named pieces (and the RNG file), touching only the files that hold
    them. Raises CheckpointError naming the file and piece at the first fault."""
    path = Path(path)
    manifest = read_manifest(path, job)
    params: dict[str, Tensor] = {}
    state: dict[str, AdamState] = {}
    for name, t, adam in _pieces(path, manifest, names):
        params[name] = t["params"].clone()
        state[name] = AdamState(t["exp_avg"].clone(), t["exp_avg_sq"].clone(), adam)
    rng = files.load_file(path, RNG, manifest).get("rng")
    if not isinstance(rng, Tensor) or rng.dtype != torch.uint8:
        raise CheckpointError(f"{path / RNG}: no RNG state")
    return LoadedPieces(params, state, int(manifest["step"]), rng.clone())


def verify(path: str | Path, job: ResolvedJob) -> None:
    """Check the whole checkpoint (every file and piece) without keeping it: what a launcher
    does before it starts any rank, so a bad checkpoint is refused before any collective."""
    path = Path(path)
    manifest = read_manifest(path, job)
    for _ in _pieces(path, manifest, manifest["pieces"]):
        pass
    files.load_file(path, RNG, manifest)
