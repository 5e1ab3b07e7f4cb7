"""A Trainer's state in and out, whatever its plan: checkpoints and the full model.

Pieces are the unit (trainer/model/decoder.py): a checkpoint holds each piece once, written by its
owner, and the full model is joined from every piece's owner in canonical order, so both are
the same under any layout and a job can stop under one plan and continue under another.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.trainer.checkpoint import directory as checkpoint
from malleus.trainer.model.decoder import join_pieces, pieces
from malleus.trainer.world.exchange import PayloadError, all_gather_bytes, decode_json, encode_json

from .step import TrainerView
from .trainer import Trainer

__all__ = ["exchange_verdicts", "gather_full", "resume", "save_atomic", "save_checkpoint"]


def save_checkpoint(trainer: Trainer, directory: str | Path) -> Path:
    """Collective: write a plan-independent checkpoint of the current step."""
    owners = {name: roles.owner for name, roles in trainer.layout.roles.items()}
    return checkpoint.save(
        directory,
        trainer.step,
        trainer.job,
        trainer.rank,
        owners,
        trainer.params,
        trainer.optim.state,
        trainer.plan.generation,
        world=trainer.world,
        device=trainer.device,
        plan=json.loads(trainer.plan.to_json()),
    )


def resume(trainer: Trainer, directory: str | Path) -> Path | None:
    """Collective: continue from the latest checkpoint in `directory`; None when it holds none.

    Each rank checks on its own what it is about to read (`latest`, the manifest, the sha256
    of its files, the shape, dtype and finiteness of its pieces, and that they fit its
    tensors), before anything is copied; one all-gather of JSON (`exchange_verdicts`) then
    hands every rank every verdict, so all refuse together with the first fault
    (`CheckpointError`) instead of one rank dying and the others reporting their peer's lost
    connection.
    """
    fault, path, loaded = None, None, None
    try:
        path = checkpoint.latest(directory)
        if path is not None:
            loaded = checkpoint.load_pieces(path, list(trainer.params), trainer.job)
            _check_fit(trainer, path, loaded)
    except checkpoint.CheckpointError as e:
        fault = str(e)
    verdicts = exchange_verdicts(trainer, fault, None if path is None else path.name)
    faults = [(rank, f) for rank, f, _ in verdicts if f is not None]
    if faults:
        rank, first = faults[0]
        more = f" (and {len(faults) - 1} more ranks refused)" if len(faults) > 1 else ""
        raise checkpoint.CheckpointError(f"rank {rank}: {first}{more}")
    seen = {name for _, _, name in verdicts}
    if len(seen) > 1:  # DIR is not one shared volume
        raise checkpoint.CheckpointError(
            f"the ranks see different checkpoints in {directory}: {seen}"
        )
    if loaded is None:
        return None
    with torch.no_grad():
        for name, p in trainer.params.items():
            p.copy_(loaded.params[name])
            st = trainer.optim.state[name]
            st.exp_avg.copy_(loaded.state[name].exp_avg)
            st.exp_avg_sq.copy_(loaded.state[name].exp_avg_sq)
            st.step = loaded.state[name].step
    trainer.compute.refresh()  # the layers' copies follow the loaded masters
    torch.set_rng_state(loaded.rng)
    trainer.compute.refresh()  # bf16 copies follow the loaded float32 masters
    trainer.step = loaded.step
    return path


MAX_FAULT_CHARS = 500
"""A verdict's fault travels this long at most (its start names the file and the piece), so
that every rank's verdict fits the exchange's bound whatever the job's size."""


def exchange_verdicts(
    trainer: TrainerView, fault: str | None, name: str | None
) -> list[tuple[int, str | None, str | None]]:
    """Collective: every rank's (GPU, fault, checkpoint name) in GPU order, as JSON bytes
    (trainer/world/exchange.py: never a pickle). A verdict that is not one (a peer's bytes that
    are not JSON of this shape) refuses the resume with `CheckpointError` naming that GPU."""
    mine = {"fault": None if fault is None else fault[:MAX_FAULT_CHARS], "name": name}
    what = "the checkpoint verdicts of a resume"
    out: list[tuple[int, str | None, str | None]] = []
    try:
        got = all_gather_bytes(
            encode_json(mine), world=trainer.world, device=trainer.device, what=what
        )
        verdicts = [(gpu, decode_json(data, gpu, what)) for gpu, data in sorted(got.items())]
    except PayloadError as e:  # every honest rank saw the same bytes: all refuse alike
        raise checkpoint.CheckpointError(str(e)) from None
    for gpu, verdict in verdicts:
        their_fault = verdict.get("fault") if isinstance(verdict, dict) else 0
        their_name = verdict.get("name") if isinstance(verdict, dict) else 0
        if not all(v is None or isinstance(v, str) for v in (their_fault, their_name)):
            raise checkpoint.CheckpointError(f"{what}: GPU {gpu} sent {verdict!r:.200}")
        out.append((gpu, their_fault, their_name))
    return out


def _check_fit(trainer: Trainer, path: Path, loaded: checkpoint.LoadedPieces) -> None:
    """Every loaded tensor has its destination's shape and dtype: `copy_` would broadcast a
    smaller tensor and convert another dtype without a word."""
    for name, p in trainer.params.items():
        st = trainer.optim.state[name]
        pairs = {
            "params": (loaded.params[name], p),
            "exp_avg": (loaded.state[name].exp_avg, st.exp_avg),
            "exp_avg_sq": (loaded.state[name].exp_avg_sq, st.exp_avg_sq),
        }
        for kind, (got, want) in pairs.items():
            if got.shape != want.shape or got.dtype != want.dtype:
                raise checkpoint.CheckpointError(
                    f"{path}: piece {name} ({kind}) is {got.dtype} {tuple(got.shape)}, "
                    f"this training holds {want.dtype} {tuple(want.shape)}"
                )


def gather_full(trainer: Trainer, dst: int = 0) -> dict[str, Tensor] | None:
    """Collective: the full model (canonical names and tensors) on `dst`, None elsewhere.

    Each piece comes from its owner, in canonical order, so the result is the same
    plan-independent state dict whatever the layout; it holds the master weights (float32
    under `precision: bf16`, never the bf16 copies).
    """
    parts: dict[str, Tensor] = {}
    model, tp, rank, world = trainer.model, trainer.job.tp, trainer.rank, trainer.world
    for piece in pieces(model, tp):
        owner = trainer.layout.roles[piece.name].owner
        # Waited for through the World: a peer stopped meanwhile ends the wait in seconds.
        if rank == dst:
            if owner == dst:
                parts[piece.name] = trainer.params[piece.name].detach().cpu().clone()
            else:
                buf = torch.empty(
                    piece.shape(tp), dtype=trainer.precision.master, device=trainer.device
                )
                world.wait_p2p([dist.irecv(buf, src=world.pg(owner))])
                parts[piece.name] = buf.cpu()
        elif rank == owner:
            held = trainer.params[piece.name].detach().contiguous()
            world.wait_p2p([dist.isend(held, dst=world.pg(dst))])
    return join_pieces(model, tp, parts) if rank == dst else None


def save_atomic(obj: object, path: str | Path) -> None:
    """torch.save to `path` through a temporary file: a reader never sees half a model."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
