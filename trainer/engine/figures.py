"""What a step measures and publishes, beside the step itself (trainer/engine/trainer.py).

An excluded rank has no stage to run, so its step is a `Benchmark`: one layer of its own, timed
like any layer, to keep a rate by which a later plan may re-admit it. From the ranks' timings in
the world vector come the straggling rates (`rates_of`, the healthy reference fixed at
`CALIBRATE_STEP`), which `publish` hands to the status and the metrics; `exchange_injections`
brings slowdowns posted to any control endpoint to their rank. Apart from the Trainer so that
the step reads as the schedule, the gradient sync, the vector and the update.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.control import MigrationRecord
from malleus.notation import size
from malleus.trainer.endpoint.body import MAX_FACTOR
from malleus.trainer.measure.profiling import healthy_reference
from malleus.trainer.model.decoder import init_piece, pieces
from malleus.trainer.parallel.layout import Place
from malleus.trainer.parallel.stage import StageModel
from malleus.trainer.parallel.tensor import TPGroup
from malleus.trainer.switching.protocol import Migration

from .services import Services
from .step import StepReport, TrainerView

__all__ = [
    "CALIBRATE_STEP",
    "Benchmark",
    "exchange_injections",
    "publish",
    "publish_migration",
    "rates_of",
]

log = logging.getLogger(__name__)

CALIBRATE_STEP = 2
"""With real timings, the healthy reference is fixed from the ranks' timings of this step
(the first steps pay one-off allocation and warm-up costs)."""


class Benchmark:
    """An excluded rank's step: one layer-shard forward and backward of its own, timed like
    any layer (and charged to its emulated clock), so it keeps a rate to be re-admitted. The
    layer is built at the first such step and kept."""

    def __init__(self) -> None:
        self.stage: StageModel | None = None

    def run(self, trainer: TrainerView) -> float:
        """One benchmark step; its loss contribution is 0."""
        if self.stage is None:
            self.stage = self._build(trainer)
        bench = self.stage
        x = torch.ones(
            trainer.act_shape,
            dtype=trainer.precision.compute,
            device=trainer.device,
            requires_grad=True,
        )
        y = trainer.timer("forward", 1, lambda: bench.layer(0, x))
        trainer.timer("backward", 1, lambda: _backward_ones(y, x))
        for p in bench.params.values():
            p.grad = None
        return 0.0

    @staticmethod
    def _build(trainer: TrainerView) -> StageModel:
        place = Place(-1, 0, 1, 0, (trainer.rank,), range(1), range(1), 1, 0)
        tp, seed = trainer.job.tp, trainer.training.seed
        dtype = trainer.precision.compute  # benchmarked in the dtype it would serve in
        params = {
            p.name: init_piece(p, tp, seed).to(trainer.device, dtype).requires_grad_()
            for p in pieces(trainer.model, tp)
            if p.spec.layer == 0 and p.shard in (None, 0)
        }
        return StageModel(
            trainer.model,
            tp,
            place,
            params,
            TPGroup(None, (trainer.rank,), 0, trainer.world, trainer.meter),
            trainer.device,
            dtype,
            compiled=trainer.training.compile,  # measured as it would serve
        )


def rates_of(trainer: TrainerView, per_unit: list[float]) -> dict[int, float | None]:
    prof = trainer.services.profiler
    if prof.reference_s is None and trainer.step >= CALIBRATE_STEP:
        prof.calibrate(healthy_reference([s for s in per_unit if s > 0]))
    ref = prof.reference_s
    if ref is None:
        return {r: None for r in range(trainer.world.size)}
    return {r: (max(1.0, s / ref) if s > 0 else None) for r, s in enumerate(per_unit)}


def exchange_injections(trainer: TrainerView) -> None:
    """Slowdowns posted to any control endpoint reach their rank at the step boundary.

    An all-reduce MAX, on purpose, unlike the step's figures (a gather of each rank's own row):
    every serving rank's endpoint (each node's first rank in a pod, docs/reference/trainer.md "Control
    endpoint") legitimately takes `POST /inject` for any rank of the world, behind the job's
    token, so no row can be told to speak for fewer ranks than all. The exchange runs only
    under the emulated clock (a test and demo feature the job turns on; with real timings there
    is no injection and no such collective), where it stretches emulated waits and nothing
    else. What a rank can do through it is therefore what the token allows anyway; the receiver
    still takes only a factor the endpoint itself would take (finite, 1 to `MAX_FACTOR`), so a
    NaN or an absurd factor from a peer is dropped with a warning, never applied."""
    vec = torch.zeros(trainer.world.size, dtype=torch.float64, device=trainer.device)
    if trainer.services.injections is not None:
        for rank, factor in trainer.services.injections.drain().items():
            if 0 <= rank < trainer.world.size:
                vec[rank] = factor
    trainer.world.wait(dist.all_reduce(vec, op=dist.ReduceOp.MAX, async_op=True))
    factor = float(vec[trainer.rank])
    if 1.0 <= factor <= MAX_FACTOR:
        trainer.services.clock.inject(factor)
    elif factor != 0.0:  # NaN included
        log.warning("rank %d: slowdown factor %r from a peer refused", trainer.rank, factor)


def publish(trainer: TrainerView, report: StepReport, compute: list[float]) -> None:
    svc = trainer.services
    svc.state.update(
        step=trainer.step,
        step_seconds=report.seconds,
        tokens_per_second=report.tokens_per_second,
        rates=report.rates,
    )
    if svc.metrics is not None:
        rates: dict[int, float | None] = dict(report.rates)
        if svc.profiler.reference_s is not None:  # calibrated: a rank without a figure
            rates = {r: math.nan if v is None else v for r, v in rates.items()}  # failed
        svc.metrics.observe_step(
            trainer.step,
            report.seconds,
            report.tokens_per_second,
            rates.get(trainer.rank),
            report.compute_seconds,
            loss=report.loss,
        )
        if svc.server is not None:  # an endpoint publishes every rank's figures
            gpn = trainer.job.gpus_per_node
            svc.metrics.observe_rates(
                rates,
                {r: r // gpn for r in range(trainer.world.size)},
                dict(enumerate(compute)),
            )


def publish_migration(services: Services, rank: int, m: Migration) -> None:
    """A switch just completed: the inbox, the status and the metrics learn of it."""
    svc = services
    if svc.inbox is not None:
        svc.inbox.applied(m.generation)
    if rank == 0 and svc.note is not None:
        svc.note("")
    record = MigrationRecord(generation=m.generation, step=m.step, seconds=m.seconds, bytes=m.bytes)
    svc.state.update(generation=m.generation, migration=record)
    if svc.metrics is not None:
        svc.metrics.observe_plan(m.generation)
        svc.metrics.observe_migration(m.seconds, m.bytes)
    log.info(
        "switched to plan generation %d from step %d: moved %s (minimal %s) in %.3f s",
        m.generation,
        m.step,
        size(m.bytes),
        size(m.minimal_bytes),
        m.seconds,
    )


def _backward_ones(y: Tensor, x: Tensor) -> Tensor:
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    return x.grad
