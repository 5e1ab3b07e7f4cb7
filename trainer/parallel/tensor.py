"""Tensor-parallel collectives as autograd Functions (nanotron / Megatron style).

A TP group keeps the residual stream replicated on every GPU: `copy_to_group` enters a
sharded region (identity forward, all-reduce of the input gradient backward),
`reduce_from_group` leaves it (all-reduce forward, identity backward), `gather_from_group`
joins hidden-sharded outputs (all-gather forward, own slice backward). A group of one GPU
makes all three the identity. Time spent inside them is timed by the group's `CommMeter`
(trainer/parallel/timing.py), so that layer compute time can exclude waiting on slower peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.trainer.world.world import World

from .timing import CommMeter

__all__ = [
    "TPGroup",
    "copy_to_group",
    "gather_from_group",
    "reduce_from_group",
]


@dataclass(frozen=True)
class TPGroup:
    """This GPU's TP group: process group (None when alone), members in shard order, position,
    and the process's `World` (its collectives end at the step's deadline, `World.bound`).

    The plan orders a group's ranks by shard; the process group orders them by rank. Only the
    all-gather cares, and it puts the slices back in shard order.
    """

    group: Any
    members: tuple[int, ...]
    index: int
    world: World
    meter: CommMeter = field(default_factory=CommMeter)

    @property
    def size(self) -> int:
        return len(self.members)


def _all_reduce(x: Tensor, tp: TPGroup) -> Tensor:
    out = x.contiguous().clone()
    tp.world.bound(tp.group)
    with tp.meter.timed("tp", tp.members, out.numel() * out.element_size()):
        tp.world.wait(dist.all_reduce(out, group=tp.group, async_op=True))
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup) -> Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup) -> Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TPGroup) -> Tensor:
        ctx.tp = tp
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(tp.size)]  # in process-group (rank) order
        tp.world.bound(tp.group)
        with tp.meter.timed("tp", tp.members, x.numel() * x.element_size() * tp.size):
            tp.world.wait(dist.all_gather(parts, x, group=tp.group, async_op=True))
        by_rank = dict(zip(sorted(tp.members), parts, strict=True))
        return torch.cat([by_rank[r] for r in tp.members], dim=-1)  # shard order

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        tp = ctx.tp
        return grad.chunk(tp.size, dim=-1)[tp.index].contiguous(), None


def copy_to_group(x: Tensor, tp: TPGroup) -> Tensor:
    """Identity forward; all-reduce the gradient backward."""
    return x if tp.size == 1 else _CopyToGroup.apply(x, tp)


def reduce_from_group(x: Tensor, tp: TPGroup) -> Tensor:
    """Sum partial results across the group forward; identity backward."""
    return x if tp.size == 1 else _ReduceFromGroup.apply(x, tp)


def gather_from_group(x: Tensor, tp: TPGroup) -> Tensor:
    """Concatenate last-dim slices across the group (in group order); take own slice back."""
    return x if tp.size == 1 else _GatherFromGroup.apply(x, tp)
