"""A Trainer's state in and out, whatever its plan: checkpoints and the full model.

Pieces are the unit (trainer/model.py): a checkpoint holds each piece once, written by its
owner, and the full model is joined from every piece's owner in canonical order, so both are
the same under any layout and a job can stop under one plan and continue under another.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from . import checkpoint
from .model import join_pieces, pieces
from .worker import Trainer

__all__ = ["gather_full", "load_checkpoint", "save_atomic", "save_checkpoint"]


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
    )


def load_checkpoint(trainer: Trainer, path: str | Path) -> None:
    """Load this rank's pieces (and their Adam state) from a checkpoint of any plan."""
    loaded = checkpoint.load_pieces(path, list(trainer.params), trainer.job)
    with torch.no_grad():
        for name, p in trainer.params.items():
            p.copy_(loaded.params[name])
            st = trainer.optim.state[name]
            st.exp_avg.copy_(loaded.state[name].exp_avg)
            st.exp_avg_sq.copy_(loaded.state[name].exp_avg_sq)
            st.step = loaded.state[name].step
    trainer.step = loaded.step


def gather_full(trainer: Trainer, dst: int = 0) -> dict[str, Tensor] | None:
    """Collective: the full model (canonical names and tensors) on `dst`, None elsewhere.

    Each piece comes from its owner, in canonical order, so the result is the same
    plan-independent state dict whatever the layout.
    """
    parts: dict[str, Tensor] = {}
    model, tp, rank = trainer.model, trainer.job.tp, trainer.rank
    for piece in pieces(model, tp):
        owner = trainer.layout.roles[piece.name].owner
        if rank == dst:
            if owner == dst:
                parts[piece.name] = trainer.params[piece.name].detach().cpu().clone()
            else:
                buf = torch.empty(piece.shape(tp), device=trainer.device)
                dist.recv(buf, src=owner)
                parts[piece.name] = buf.cpu()
        elif rank == owner:
            dist.send(trainer.params[piece.name].detach().contiguous(), dst=dst)
    return join_pieces(model, tp, parts) if rank == dst else None


def save_atomic(obj: object, path: str | Path) -> None:
    """torch.save to `path` through a temporary file: a reader never sees half a model."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
