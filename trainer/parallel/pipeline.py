"""The 1F1B schedule of one stage, over non-uniform stages and a per-pipeline micro-batch count.

Stage j of S with m micro-batches runs min(S-j-1, m) warm-up forwards, then alternates one
forward and one backward, then drains the warm-up backwards (Megatron's non-interleaved
schedule). Sends and receives that meet in the steady state are batched (isend/irecv issued
together, then waited on), so no two neighbours block on each other. Every layer's forward and
backward is timed separately from communication and charged to the (optionally emulated) clock
(`LayerTimer`, trainer/parallel/timing.py); the times are read when the schedule ends.

For the cost model's calibration the timer also keeps, per step, the TP communication inside
layer calls, the embedding's and the head's time per micro-batch (their math, collectives and
backward) and when this rank's schedule began and ended; pipeline transfers are filed with the
`CommMeter` as `p2p` (their shortest call is the transfer without the bubble's wait).

Activations travel in the compute dtype (bf16 under `precision: bf16`). With activation
checkpointing each layer keeps only its input between forward and backward and recomputes the
rest (`torch.utils.checkpoint`, non-reentrant); the recomputation runs the layer's TP
collectives again, which stays in step because every GPU of a TP group runs the same schedule.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from malleus.trainer.world.world import World

from .layout import Place
from .stage import StageModel
from .timing import LayerTimer

__all__ = ["ACT_TAG", "GRAD_TAG", "PipelineStage"]

ACT_TAG, GRAD_TAG = 1, 2
Batch = Callable[[int], tuple[Tensor, Tensor]]  # global micro-batch index -> (inputs, targets)


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
        world: World,
        dtype: torch.dtype = torch.float32,
        recompute: bool = False,
        finished: Callable[[int | str], None] | None = None,
    ) -> None:
        self.model, self.place, self.batch, self.world = model, place, batch, world
        self.total = total_micro_batches
        self.timer = timer
        self.act_shape, self.device, self.dtype = act_shape, device, dtype
        self.recompute = recompute  # activation checkpointing, per layer
        self.shards = len(place.shards)
        self.loss_sum: Tensor | float = 0.0
        # Told, during the step's last backward, of each unit whose gradients are then final: a
        # layer (its index), "head", "embedding" (the gradient sync posts them: grad_sync.py).
        self.finished = finished or (lambda unit: None)
        self._backwards = 0  # this step's backwards so far

    def run(self) -> Tensor | float:
        """This rank's part of the step; the sum of its micro-batches' losses (a float64 tensor
        on the device, summed there: reading each loss would wait for the device), 0.0 when it
        computes none (not the last stage)."""
        self.timer.started = time.perf_counter()
        out = self._run()
        self.timer.settle()  # the schedule's times read (one host sync with CUDA events)
        self.timer.ended = time.perf_counter()  # after the device finished the schedule
        return out

    def _run(self) -> Tensor | float:
        p = self.place
        warmup = min(p.num_stages - p.stage - 1, p.micro_batches)
        steady = p.micro_batches - warmup
        self.loss_sum, self._backwards = 0.0, 0
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
        ops, buf, peers = [], None, []
        if recv is not None and recv[0] is not None:
            peers.append(recv[0])
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self.world.pg(recv[0]), tag=recv[1]))
        if send is not None and send[0] is not None:
            ops += [
                dist.P2POp(dist.isend, send[0], self.world.pg(dst), tag=send[2]) for dst in send[1]
            ]
            peers += send[1]
        if ops:
            nbytes = math.prod(self.act_shape) * self.dtype.itemsize * len(ops)
            members = (self.place.group[self.place.index], *sorted(set(peers)))
            self.world.bound()  # point-to-point goes over the job's group
            with self.timer.meter.timed("p2p", members, nbytes):
                self.world.wait_p2p(dist.batch_isend_irecv(ops))
        return buf

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, micro: int, received: Tensor | None) -> tuple[Tensor | None, _InFlight]:
        st, model = _InFlight(micro), self.model
        if self.place.first:
            tokens, _ = self.batch(micro)
            st.embedded = self.timer.end("embedding", lambda: model.embed(tokens), 1)  # (b, T, C)
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
        st.head_input, st.loss = x, self.timer.end("head", lambda: model.loss(x, targets), 1)
        self.loss_sum = self.loss_sum + st.loss.detach().double()  # float64, as Python sums
        return None, st

    def _layer(self, layer: int, x: Tensor) -> Tensor:
        if not self.recompute:
            return self.model.layer(layer, x)
        out: Tensor = checkpoint(self.model.layer, layer, x, use_reentrant=False)
        return out

    def _backward(self, st: _InFlight, grad: Tensor | None) -> Tensor | None:
        self._backwards += 1
        last = self._backwards == self.place.micro_batches  # the step's gradients end here
        if self.place.last:
            assert st.loss is not None and st.head_input is not None
            loss = st.loss / self.total  # every micro-batch weighs 1/(step's total)
            self.timer.end("head", loss.backward)
            grad = st.head_input.grad
            if last:
                self.finished("head")
        for layer, (x, y) in zip(reversed(self.place.layers), reversed(st.layer_io), strict=True):
            grad = self.timer("backward", self.shards, lambda x=x, y=y, g=grad: _backprop(x, y, g))
            if last:
                self.finished(layer)
        if self.place.first:
            assert st.embedded is not None
            embedded = st.embedded
            self.timer.end("embedding", lambda: embedded.backward(grad))
            if last:
                self.finished("embedding")
            return None
        return grad


def _backprop(x: Tensor, y: Tensor, grad: Tensor | None) -> Tensor:
    """Backward through one layer; the gradient of its input."""
    y.backward(grad)
    assert x.grad is not None
    return x.grad
