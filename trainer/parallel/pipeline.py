"""The 1F1B schedule of one stage, over non-uniform stages and a per-pipeline micro-batch count.

Stage j of S with m micro-batches runs min(S-j-1, m) warm-up forwards, then alternates one
forward and one backward, then drains the warm-up backwards (Megatron's non-interleaved
schedule). Sends and receives that meet in the steady state are batched (isend/irecv issued
together, then waited on), so no two neighbours block on each other. Every layer's forward and
backward is timed separately from communication and charged to the (optionally emulated) clock.

Activations travel in the compute dtype (bf16 under `precision: bf16`). With activation
checkpointing each layer keeps only its input between forward and backward and recomputes the
rest (`torch.utils.checkpoint`, non-reentrant); the recomputation runs the layer's TP
collectives again, which stays in step because every GPU of a TP group runs the same schedule.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .layout import Place
from .stage import StageModel
from .tensor import CommMeter

__all__ = ["ACT_TAG", "GRAD_TAG", "Clock", "LayerTimer", "PipelineStage", "Profiler"]

ACT_TAG, GRAD_TAG = 1, 2
Batch = Callable[[int], tuple[Tensor, Tensor]]  # global micro-batch index -> (inputs, targets)


class Clock(Protocol):
    def compute(self, kind: str, shards: int, started: float) -> None: ...


class Profiler(Protocol):
    def record(self, units: int, seconds: float) -> None: ...


class LayerTimer:
    """Times layer math apart from communication, charges the clock, feeds the profiler.

    A layer's compute time is its wall time minus the time its TP collectives spent (the
    `CommMeter` delta); the emulated clock then waits until `start + comm + budget`, so a GPU
    that waited for a slow peer inside a layer is still charged its own full budget.
    """

    def __init__(
        self, clock: Clock, profiler: Profiler, meter: CommMeter, device: torch.device
    ) -> None:
        self.clock, self.profiler, self.meter = clock, profiler, meter
        self._sync: Callable[[], None] = (
            torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        )
        self.seconds = 0.0  # summed since the last reset
        self.units = 0  # layer-shard passes (forward or backward, one micro-batch) since then

    def reset(self) -> None:
        self.seconds, self.units = 0.0, 0

    def __call__(self, kind: str, shards: int, fn: Callable[[], Tensor]) -> Tensor:
        self._sync()
        t0, c0 = time.perf_counter(), self.meter.seconds
        out = fn()
        self._sync()
        comm = self.meter.seconds - c0
        self.clock.compute(kind, shards, t0 + comm)
        seconds = time.perf_counter() - t0 - comm
        self.profiler.record(shards, seconds)
        self.seconds += seconds
        self.units += shards
        return out


@dataclass
class _InFlight:
    """What one micro-batch keeps between its forward and its backward."""

    micro: int
    embedded: Tensor | None = None  # first stage: embedding output (graph to the embedding)
    layer_io: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (input leaf, output)
    head_input: Tensor | None = None  # last stage
    loss: Tensor | None = None


class PipelineStage:
    """Runs one step's micro-batches on this GPU's stage; returns the summed micro-batch losses."""

    def __init__(
        self,
        model: StageModel,
        place: Place,
        batch: Batch,
        total_micro_batches: int,
        timer: LayerTimer,
        act_shape: tuple[int, ...],
        device: torch.device,
        *,
        dtype: torch.dtype = torch.float32,
        recompute: bool = False,
    ) -> None:
        self.model, self.place, self.batch = model, place, batch
        self.total = total_micro_batches
        self.timer = timer
        self.act_shape, self.device, self.dtype = act_shape, device, dtype
        self.recompute = recompute  # activation checkpointing, per layer
        self.shards = len(place.shards)
        self.loss_sum = 0.0

    def run(self) -> float:
        p = self.place
        warmup = min(p.num_stages - p.stage - 1, p.micro_batches)
        steady = p.micro_batches - warmup
        self.loss_sum = 0.0
        queue: deque[_InFlight] = deque()
        micros = iter(range(p.micro_offset, p.micro_offset + p.micro_batches))
        for _ in range(warmup):
            out, st = self._forward(next(micros), self._exchange(recv=(p.fwd_src, ACT_TAG)))
            queue.append(st)
            self._exchange(send=(out, p.fwd_dsts, ACT_TAG))
        x = self._exchange(recv=(p.fwd_src, ACT_TAG)) if steady else None
        for i in range(steady):
            out, st = self._forward(next(micros), x)
            queue.append(st)
            grad = self._exchange(send=(out, p.fwd_dsts, ACT_TAG), recv=(p.bwd_src, GRAD_TAG))
            dx = self._backward(queue.popleft(), grad)
            more = i < steady - 1
            x = self._exchange(
                send=(dx, p.bwd_dsts, GRAD_TAG), recv=(p.fwd_src, ACT_TAG) if more else None
            )
        for _ in range(warmup):
            grad = self._exchange(recv=(p.bwd_src, GRAD_TAG))
            self._exchange(send=(self._backward(queue.popleft(), grad), p.bwd_dsts, GRAD_TAG))
        return self.loss_sum

    # ---- point-to-point ---------------------------------------------------------------------
    def _exchange(
        self,
        send: tuple[Tensor | None, tuple[int, ...], int] | None = None,
        recv: tuple[int | None, int] | None = None,
    ) -> Tensor | None:
        """Post a receive and sends together and wait for all of them."""
        ops, buf = [], None
        if recv is not None and recv[0] is not None:
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, recv[0], tag=recv[1]))
        if send is not None and send[0] is not None:
            ops += [dist.P2POp(dist.isend, send[0], dst, tag=send[2]) for dst in send[1]]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return buf

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, micro: int, received: Tensor | None) -> tuple[Tensor | None, _InFlight]:
        st, model = _InFlight(micro), self.model
        if self.place.first:
            tokens, _ = self.batch(micro)
            st.embedded = model.embed(tokens)  # (b, T, C)
            x = st.embedded.detach().requires_grad_()
        else:
            assert received is not None
            x = received.requires_grad_()
        for layer in self.place.layers:
            y = self.timer("forward", self.shards, lambda x=x, layer=layer: self._layer(layer, x))
            st.layer_io.append((x, y))
            x = y.detach().requires_grad_()
        if not self.place.last:
            return x.detach(), st
        _, targets = self.batch(micro)
        st.head_input, st.loss = x, model.loss(x, targets)
        self.loss_sum += float(st.loss.detach())
        return None, st

    def _layer(self, layer: int, x: Tensor) -> Tensor:
        if not self.recompute:
            return self.model.layer(layer, x)
        out: Tensor = checkpoint(self.model.layer, layer, x, use_reentrant=False)
        return out

    def _backward(self, st: _InFlight, grad: Tensor | None) -> Tensor | None:
        if self.place.last:
            assert st.loss is not None and st.head_input is not None
            (st.loss / self.total).backward()  # every micro-batch weighs 1/(step's total)
            grad = st.head_input.grad
        for x, y in reversed(st.layer_io):
            grad = self.timer("backward", self.shards, lambda x=x, y=y, g=grad: _backprop(x, y, g))
        if self.place.first:
            assert st.embedded is not None
            st.embedded.backward(grad)
            return None
        return grad


def _backprop(x: Tensor, y: Tensor, grad: Tensor | None) -> Tensor:
    """Backward through one layer; the gradient of its input."""
    y.backward(grad)
    assert x.grad is not None
    return x.grad
