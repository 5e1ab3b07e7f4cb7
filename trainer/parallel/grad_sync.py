"""Data-parallel gradient sync per piece, overlapped with the backward, and the exact global norm.

A piece's gradient is summed over its contributors (per logical shard, across the pipelines that
hold it; a tied embedding also across its first and last stage). Pieces with the same holder
set form a bucket (trainer/parallel/layout.py); a bucket is all-reduced in chunks of at most
`CHUNK_BYTES` (torch DDP's default bucket size), each the flat concatenation of whole pieces in
the model's order, cut from the bucket's end: the backward finishes the last pieces first. A
bucket within the cap is one chunk, the flat tensor of all its pieces in the model's order
(members of 3 or more sum each element in an order that depends on its place in the tensor,
so the order is kept). Replicated norm weights have the same gradient on every GPU of a TP group: only the group's
first GPU contributes, the others add zeros, so each pipeline is counted once.

`GradSync` runs one step's sync. With `overlap` (real timings: a GPU's NCCL stream, or a CPU
run without emulation) a chunk's all-reduce is posted as soon as the schedule's last backward
has finished its pieces (`ready`, called by the pipeline), so it runs behind the backward of the
layers before them, and `finish` waits for them all; without it (the emulated clock, whose slow
links charge a collective by its own duration) every chunk is posted and waited for in
`finish`. Either way every rank posts its chunks in one global order (by the model position of
their last piece, descending), so the members of each group post that group's all-reduces in
the same order. Each chunk's wait is filed with the meter as `grad_intra` or `grad_inter`
(members in one node or not), with its bytes, for calibration: with overlap only the part the
backward did not hide, which is what the step pays.

The gradients here are the master pieces' (float32 under `precision: bf16`: trainer/model/precision.py
adds each micro-batch's bf16 gradient into them, in the backward itself, so they are final when
the backward through their layer returns), so data-parallel sums and the norm are float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.trainer.model.decoder import Piece, pieces

from .groups import GroupCache
from .layout import Layout
from .timing import CommMeter

__all__ = ["CHUNK_BYTES", "Chunk", "GradSync", "chunks", "owned_square_norm"]

CHUNK_BYTES = 25 * 2**20
"""At most this many bytes per all-reduce (torch DDP's `bucket_cap_mb` default, 25 MiB): small
enough that the first chunks of a large stage start while the backward is far from done, large
enough that each call moves bytes rather than pays its latency. A piece larger than this is a
chunk of its own."""

Unit = int | str
"""What the backward finishes at once: a layer (its index), "head" (the head, the final norm and,
on a last stage, a tied embedding's use there) or "embedding" (the embedding, on a first stage)."""


@dataclass(frozen=True)
class Chunk:
    """Whole pieces of one bucket, all-reduced together among its members."""

    members: tuple[int, ...]
    pieces: tuple[str, ...]  # in the model's order
    order: int  # the model position of its last piece: chunks are posted by it, descending


def chunks(layout: Layout, cap: int = CHUNK_BYTES) -> list[Chunk]:
    """This rank's chunks, in the order every rank posts them. A bucket's chunks depend on the
    plan and the model alone (every member cuts them alike); a bucket's pieces, taken from its
    end, fill a chunk while it stays within `cap` bytes of float32 (the master's width, or
    float64 in tests: the same cut for every member either way, which is what matters)."""
    every = pieces(layout.model, layout.tp)
    position = {p.name: i for i, p in enumerate(every)}
    size = {p.name: 4 * math.prod(p.shape(layout.tp)) for p in every}
    out: list[Chunk] = []
    for bucket in layout.my_buckets():
        run: list[str] = []  # from the bucket's end backwards
        filled = 0  # its bytes
        for name in reversed(bucket.pieces):
            if run and filled + size[name] > cap:
                out.append(Chunk(bucket.members, tuple(reversed(run)), position[run[0]]))
                run, filled = [], 0
            run.append(name)
            filled += size[name]
        if run:
            out.append(Chunk(bucket.members, tuple(reversed(run)), position[run[0]]))
    return sorted(out, key=lambda c: -c.order)


class GradSync:
    """One layout's gradient sync (built with the pipeline stage, `begin` at every step)."""

    def __init__(
        self,
        layout: Layout,
        groups: GroupCache,
        meter: CommMeter,
        *,
        overlap: bool,
    ) -> None:
        self.layout, self.groups, self.meter, self.overlap = layout, groups, meter, overlap
        self.chunks = chunks(layout, CHUNK_BYTES)  # the module's value when the layout is built
        place = layout.place
        first = place is not None and place.first
        held = {p.name: p for p in layout.held()}
        self._units: list[frozenset[Unit]] = [
            frozenset(_unit(held[name], first) for name in c.pieces) for c in self.chunks
        ]
        self._params: Mapping[str, Tensor] = {}
        self._done: set[Unit] = set()
        self._posted: list[tuple[Chunk, Tensor, Any]] = []
        self.early = 0
        """Chunks the last step posted during its backward (before `finish`)."""

    def begin(self, params: Mapping[str, Tensor]) -> None:
        """A new step over `params` (this rank's master pieces): nothing is final yet."""
        self._params, self._done, self._posted = params, set(), []

    def ready(self, unit: Unit) -> None:
        """The schedule's last backward finished `unit`: post the chunks now complete (with
        `overlap`), in order."""
        self._done.add(unit)
        if not self.overlap:
            return
        while (i := len(self._posted)) < len(self.chunks):
            if not self._units[i] <= self._done:
                break  # a later chunk waits for this one: every rank posts in the same order
            self._post(self.chunks[i])

    def finish(self) -> None:
        """Post what is left, wait for every chunk (each bounded by the step's deadline of the
        groups' `World`) and put the sums in place of every held piece's gradient."""
        world = self.groups.world
        self.early = len(self._posted)
        try:
            if self.overlap:
                for chunk in self.chunks[len(self._posted) :]:
                    self._post(chunk)
                for chunk, flat, work in self._posted:
                    with self.meter.timed("grad", chunk.members, _bytes(flat)):
                        world.wait(work)
            else:  # posted and waited for inside the timing, which an emulated link stretches
                for chunk in self.chunks[len(self._posted) :]:
                    flat = self._flat(chunk)
                    with self.meter.timed("grad", chunk.members, _bytes(flat)):
                        world.wait(self._post(chunk, flat))
        except BaseException:
            self.abandon()
            raise
        for chunk, flat, _ in self._posted:
            offset = 0
            for name in chunk.pieces:
                p = self._params[name]
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self._posted = []

    def abandon(self) -> None:
        """The step failed: hand the all-reduces still pending to the `World`, which keeps their
        groups until they end (trainer/world/world.py `bury`)."""
        self.groups.world.abandon([work for _, _, work in self._posted])
        self._posted = []

    def _flat(self, chunk: Chunk) -> Tensor:
        """The chunk's gradients in one flat tensor (zeros where this rank does not contribute)."""
        grads = []
        for name in chunk.pieces:
            p = self._params[name]
            contributes = p.grad is not None and self.layout.contributes(name)
            grads.append((p.grad if contributes else torch.zeros_like(p)).reshape(-1))
        return torch.cat(grads)

    def _post(self, chunk: Chunk, flat: Tensor | None = None) -> Any:
        """Post the chunk's all-reduce (its flat gradients made now unless given)."""
        flat = self._flat(chunk) if flat is None else flat
        group = self.groups.get(chunk.members)
        self.groups.world.bound(group)  # ends at the step's deadline
        work = dist.all_reduce(flat, group=group, async_op=True)
        self._posted.append((chunk, flat, work))
        return work


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _unit(piece: Piece, first: bool) -> Unit:
    """The backward's point at which this rank's `piece` is final."""
    if piece.spec.layer is not None:
        return piece.spec.layer
    if piece.spec.name == "embed.weight" and first:
        return "embedding"  # a first stage's embedding (tied or not) ends the backward
    return "head"  # the head, the final norm, a last stage's tied embedding


def owned_square_norm(layout: Layout, params: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """Sum of squared gradients of the pieces this rank owns (float64 scalar).

    After `GradSync.finish` every holder has a piece's full gradient; counting it only at its
    owner and summing over the world (excluded ranks add zeros) gives the exact global norm.
    """
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for name in layout.owned():
        g = params[name].grad
        if g is not None:
            sq += g.detach().double().pow(2).sum()
    return sq
