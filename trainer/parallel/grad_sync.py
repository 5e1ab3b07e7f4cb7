"""Data-parallel gradient sync per piece, and the exact global gradient norm.

A piece's gradient is summed over its contributors (per logical shard, across the
pipelines that hold it; a tied embedding also across its first and last stage). Pieces with the
same holder set travel in one flat all-reduce (a bucket); buckets run in the layout's global
order, which every rank derives from the plan alone. Replicated norm weights have the same
gradient on every GPU of a TP group: only the group's first GPU contributes, the others add
zeros, so each pipeline is counted once. Each bucket's all-reduce is filed with the meter as
`grad_intra` or `grad_inter` (members in one node or not), with its bytes, for calibration.

The gradients here are the master pieces' (float32 under `precision: bf16`: trainer/model/precision.py
adds each micro-batch's bf16 gradient into them), so data-parallel sums and the norm are float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import GroupCache
from .layout import Layout
from .tensor import CommMeter

__all__ = ["owned_square_norm", "sync_gradients"]


def sync_gradients(
    layout: Layout, params: Mapping[str, Tensor], groups: GroupCache, meter: CommMeter
) -> None:
    """Sum every held piece's gradient over its contributors, on every holder (each
    all-reduce bounded by the step's deadline of the groups' `World`)."""
    for bucket in layout.my_buckets():
        grads = []
        for name in bucket.pieces:
            p = params[name]
            g = p.grad if p.grad is not None and layout.contributes(name) else torch.zeros_like(p)
            grads.append(g.reshape(-1))
        flat = torch.cat(grads)
        group = groups.get(bucket.members)
        groups.world.bound(group)  # ends at the step's deadline
        with meter.timed("grad", bucket.members, flat.numel() * flat.element_size()):
            groups.world.wait(dist.all_reduce(flat, group=group, async_op=True))
        offset = 0
        for name in bucket.pieces:
            p = params[name]
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


def owned_square_norm(layout: Layout, params: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """Sum of squared gradients of the pieces this rank owns (float64 scalar).

    After `sync_gradients` every holder has a piece's full gradient; counting it only at its
    owner and summing over the world (excluded ranks add zeros) gives the exact global norm.
    """
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for name in layout.owned():
        g = params[name].grad
        if g is not None:
            sq += g.detach().double().pow(2).sum()
    return sq
