"""`Trainer`: one rank's part of a Plan (its pieces, optimizer state and layout) and its step.

A step: set the clock, run this stage's 1F1B schedule (or, for an excluded rank, a one-layer
benchmark), sum gradients per piece across their holders, one world all-reduce carrying the
gradient norm, the loss, every rank's compute figures and the coordinator's control words, clip,
AdamW, report; then, at the step boundary, switch to a new plan or stop if rank 0 said so
(trainer/switch.py). Every rank, excluded ones included, takes part in the world collectives, in
the same order. Its state in and out (checkpoints, the full model) is trainer/state.py, the run
around the steps (resume, logs, checkpoints, the final model) trainer/loop.py.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.job import ResolvedJob
from malleus.job.control import MigrationRecord
from malleus.planner import Plan, check_plan

from .data import make_source, micro_batch
from .hf import initial_pieces
from .model import init_piece, pieces
from .parallel import migrate
from .parallel.grad_sync import owned_square_norm, sync_gradients
from .parallel.groups import GroupCache
from .parallel.layout import Layout, Place
from .parallel.optim import AdamState, PieceAdamW, clip_coefficient, lr_at
from .parallel.pipeline import LayerTimer, PipelineStage
from .parallel.stage import StageModel
from .parallel.tensor import CommMeter, TPGroup
from .precision import ComputeCopies, Precision
from .profiling import healthy_reference
from .services import Services
from .switch import (
    CONTROL_WORDS,
    MIGRATION_TIMEOUT_S,
    Boundary,
    Coordinator,
    Migration,
    MigrationError,
    broadcast_payload,
    fault_point,
    settle,
)

__all__ = ["CALIBRATE_STEP", "StepReport", "Trainer"]

log = logging.getLogger(__name__)

CALIBRATE_STEP = 2
"""With real timings, the healthy reference is fixed from the ranks' timings of this step
(the first steps pay one-off allocation and warm-up costs)."""


@dataclass(frozen=True)
class StepReport:
    """The figures of one completed step (the same on every rank, but `rate` is this rank's)."""

    step: int  # index of the step just run (0-based)
    loss: float  # mean over the step's micro-batches
    grad_norm: float  # before clipping
    lr: float
    seconds: float
    tokens_per_second: float
    compute_seconds: float  # this rank's layer compute, communication excluded
    rates: dict[int, float | None]  # every rank's straggling rate (None: not yet calibrated)


class Trainer:
    """One rank's model pieces, optimizer and layout, and the step that trains them."""

    def __init__(
        self,
        job: ResolvedJob,
        plan: Plan,
        *,
        rank: int,
        world: int,
        device: torch.device,
        steps: int | None = None,
        services: Services | None = None,
        groups: GroupCache | None = None,
        migration_timeout_s: float = MIGRATION_TIMEOUT_S,
        precision: Precision | None = None,
    ) -> None:
        if world != job.world:
            raise ValueError(
                f"world size {world} != nodes({job.nodes}) * gpusPerNode({job.gpus_per_node})"
            )
        check_plan(job.problem(), plan)
        self.job, self.plan, self.rank, self.world, self.device = job, plan, rank, world, device
        self.model, self.training = job.model, job.spec.training
        self.steps = steps if steps is not None else job.steps  # the LR schedule's length
        if services is None:
            services = Services.null(job, rank, steps=self.steps)
        self.services = services
        self.groups = groups if groups is not None else GroupCache()
        self.meter = CommMeter(cuda=device.type == "cuda")
        self.timer = LayerTimer(self.services.clock, self.services.profiler, self.meter, device)
        tr = self.training
        self.source = make_source(tr.dataset, job.model.sequence, job.model.vocab, tr.seed, tr.data)
        self.step = 0
        self.layout = Layout.from_plan(plan, job.model, rank, world)
        self.groups.ensure(self.layout.member_sets())  # collective: all ranks, same order
        held = self.layout.held()
        # the job's precision unless a test asks for float64 (RunOptions.float64)
        self.precision = precision if precision is not None else Precision.of(tr.precision)
        master = self.precision.master
        start = initial_pieces(job, held)  # seeded, or read slice by slice from safetensors
        self.params: dict[str, Tensor] = {  # master pieces: what is updated, saved, migrated
            p.name: start[p.name].to(device, master).requires_grad_() for p in held
        }
        self.compute = ComputeCopies(self.params, self.precision)  # what the layers read
        self.optim = PieceAdamW(self.params, {p.name: p.spec.decay for p in held}, tr.weight_decay)
        self.act_shape = (tr.micro_batch_size, job.model.sequence, job.model.hidden)
        self.pipeline = self._pipeline(self.layout.place) if self.layout.place else None
        self._bench: StageModel | None = None
        self.migration_timeout_s = migration_timeout_s
        self.boundary = Boundary()  # what the last step boundary announced
        self.last_migration: Migration | None = None
        svc = self.services
        self.coordinator = (
            Coordinator(svc.inbox, svc.stop)
            if rank == 0 and svc.inbox is not None and svc.stop is not None
            else None
        )
        if svc.inbox is not None:
            svc.inbox.applied(plan.generation)
        svc.state.update(generation=plan.generation)
        if svc.metrics is not None:
            svc.metrics.observe_plan(plan.generation)

    # ---- construction -----------------------------------------------------------------------
    def _pipeline(self, place: Place) -> PipelineStage:
        group = self.groups.get(place.group) if len(place.group) > 1 else None
        tp = TPGroup(group, place.group, place.index, self.meter)
        model = StageModel(
            self.model,
            self.job.tp,
            place,
            self.compute.tensors,
            tp,
            self.device,
            self.precision.compute,
        )
        return PipelineStage(
            model,
            place,
            self._batch,
            self.layout.total_micro_batches,
            self.timer,
            self.act_shape,
            self.device,
            dtype=self.precision.compute,
            recompute=self.training.activation_checkpointing,
        )

    def _batch(self, micro: int) -> tuple[Tensor, Tensor]:
        tr = self.training
        x, y = micro_batch(self.source, self.step, micro, tr.global_batch_size, tr.micro_batch_size)
        return x.to(self.device), y.to(self.device)

    # ---- the step ---------------------------------------------------------------------------
    def train_step(self) -> StepReport:
        tr, svc = self.training, self.services
        t0 = time.perf_counter()
        svc.clock.set_step(self.step)
        if svc.emulated:
            self._exchange_injections()
        self.optim.zero_grad()
        self.timer.reset()
        loss_sum = self.pipeline.run() if self.pipeline is not None else self._benchmark()
        svc.profiler.end_step()
        sync_gradients(self.layout, self.params, self.groups, self.meter)

        # One world all-reduce: [owned grad^2, loss sum, seconds/unit per rank, compute per rank,
        # the coordinator's control words].
        W = self.world
        vec = torch.zeros(2 + 2 * W + CONTROL_WORDS, dtype=torch.float64, device=self.device)
        vec[0] = owned_square_norm(self.layout, self.params, self.device)
        place = self.layout.place
        if place is not None and place.last and place.index == 0:
            vec[1] = loss_sum  # each pipeline's losses, once
        if self.timer.units:
            vec[2 + self.rank] = self.timer.seconds / self.timer.units
        vec[2 + W + self.rank] = self.timer.seconds
        payload = b""
        if self.coordinator is not None:  # a plan posted after this line waits a step
            announce, payload = self.coordinator.take()
            vec[2 + 2 * W :] = torch.tensor(announce.words(), dtype=torch.float64)
        with self.meter.timed():
            dist.all_reduce(vec)
        stats = vec.tolist()
        norm = math.sqrt(stats[0])
        lr = lr_at(self.step, tr.learning_rate, tr.warmup_steps, self.steps)
        self.optim.step(lr, clip_coefficient(norm, tr.grad_clip))
        self.compute.refresh()

        seconds = time.perf_counter() - t0
        report = StepReport(
            step=self.step,
            loss=stats[1] / self.layout.total_micro_batches,
            grad_norm=norm,
            lr=lr,
            seconds=seconds,
            tokens_per_second=self.job.tokens_per_step / seconds,
            compute_seconds=self.timer.seconds,
            rates=self._rates(stats[2 : 2 + W]),
        )
        self.step += 1
        self._publish(report, stats[2 + W : 2 + 2 * W])
        self._at_boundary(Boundary.decode(stats[2 + 2 * W :]), payload)
        return report

    # ---- the step boundary: switch, stop ----------------------------------------------------
    def _at_boundary(self, boundary: Boundary, payload: bytes) -> None:
        self.boundary = boundary
        if not boundary.plan_bytes:
            return
        data = broadcast_payload(payload, boundary.plan_bytes, self.rank, self.device)
        plan = Plan.from_json(data)  # validated by rank 0's inbox before it was taken
        try:
            self.switch(plan)
        except Exception as e:
            if self.services.inbox is not None:
                self.services.inbox.failed(plan.generation, str(e))
            raise

    def switch(self, plan: Plan) -> Migration:
        """Collective: put `plan` in force now, moving every piece and its Adam state to its
        new holders (DESIGN §6), then rebuilding the TP, pipeline and gradient-sync groups.

        Raises MigrationError naming this rank, the generation and the step; every wait is
        bounded by `migration_timeout_s`.
        """
        t0 = time.perf_counter()
        doing = f"the switch to plan generation {plan.generation} at step {self.step}"
        if self.rank == 0 and self.services.note is not None:
            self.services.note(doing)
        try:
            new = Layout.from_plan(plan, self.model, self.rank, self.world)
            width = self.precision.master_bytes  # masters and Adam state move, never copies
            moves = migrate.plan_transfers(
                self.layout.roles, new.roles, self.model, self.job.tp, self.job.gpus_per_node, width
            )
            minimal = migrate.minimal_bytes(self.model, self.plan, plan, width)
            exchange = migrate.post(
                moves, self.rank, self.params, self.optim.state, self.device, self.precision.master
            )
            fault_point("migration", self.rank)
            received = exchange.wait(self.migration_timeout_s)
            settle(self.migration_timeout_s)
            self.groups.ensure(new.member_sets())  # collective: all ranks, same order
            self._adopt(plan, new, received)
            # Measured, not derived: the bytes that went over the wire, the slowest rank's time.
            totals = torch.tensor(
                [float(exchange.sent_bytes), time.perf_counter() - t0], dtype=torch.float64
            ).to(self.device)
            dist.all_reduce(totals[:1])
            dist.all_reduce(totals[1:], op=dist.ReduceOp.MAX)
        except Exception as e:
            raise MigrationError(f"rank {self.rank}: {doing} failed: {e}") from e
        moved, seconds = totals.tolist()
        record = Migration(
            generation=plan.generation,
            step=self.step,
            seconds=seconds,
            bytes=int(moved),
            minimal_bytes=minimal,
            transfers=len(moves.transfers),
        )
        self._record(record)
        return record

    def _adopt(
        self, plan: Plan, new: Layout, received: dict[str, tuple[Tensor, AdamState]]
    ) -> None:
        """Switch the local state to `new`: keep what stays, take what arrived, drop the rest."""
        params: dict[str, Tensor] = {}
        state: dict[str, AdamState] = {}
        for piece in new.held():
            name = piece.name
            if name in self.params:  # already here: no copy
                params[name], state[name] = self.params[name], self.optim.state[name]
            else:
                value, state[name] = received.pop(name)
                params[name] = value.to(self.device).requires_grad_()
        if received:
            raise RuntimeError(f"received pieces this rank does not hold: {sorted(received)[:4]}")
        self.params = params
        self.compute = ComputeCopies(params, self.precision)  # copies derived anew, never moved
        self.optim.rebind(params, {p.name: p.spec.decay for p in new.held()}, state)
        self.plan, self.layout = plan, new
        self.pipeline = self._pipeline(new.place) if new.place else None

    def _record(self, m: Migration) -> None:
        svc = self.services
        if svc.inbox is not None:
            svc.inbox.applied(m.generation)
        if self.rank == 0 and svc.note is not None:
            svc.note("")
        record = MigrationRecord(
            generation=m.generation, step=m.step, seconds=m.seconds, bytes=m.bytes
        )
        svc.state.update(generation=m.generation, migration=record)
        if svc.metrics is not None:
            svc.metrics.observe_plan(m.generation)
            svc.metrics.observe_migration(m.seconds, m.bytes)
        self.last_migration = m
        log.info(
            "switched to plan generation %d at step %d: %s bytes (minimal %s) in %.3fs",
            m.generation,
            m.step,
            f"{m.bytes:,}",
            f"{m.minimal_bytes:,}",
            m.seconds,
        )

    def _benchmark(self) -> float:
        """An excluded rank's step: one layer-shard forward and backward of its own, timed like
        any layer (and charged to its emulated clock), so it keeps a rate to be re-admitted."""
        if self._bench is None:
            place = Place(-1, 0, 1, 0, (self.rank,), range(1), range(1), 1, 0)
            tp, seed = self.job.tp, self.training.seed
            dtype = self.precision.compute  # benchmarked in the dtype it would serve in
            params = {
                p.name: init_piece(p, tp, seed).to(self.device, dtype).requires_grad_()
                for p in pieces(self.model, tp)
                if p.spec.layer == 0 and p.shard in (None, 0)
            }
            self._bench = StageModel(
                self.model,
                tp,
                place,
                params,
                TPGroup(None, (self.rank,), 0, self.meter),
                self.device,
                dtype,
            )
        bench = self._bench
        x = torch.ones(
            self.act_shape, dtype=self.precision.compute, device=self.device, requires_grad=True
        )
        y = self.timer("forward", 1, lambda: bench.layer(0, x))
        self.timer("backward", 1, lambda: _backward_ones(y, x))
        for p in bench.params.values():
            p.grad = None
        return 0.0

    def _rates(self, per_unit: list[float]) -> dict[int, float | None]:
        prof = self.services.profiler
        if prof.reference_s is None and self.step >= CALIBRATE_STEP:
            prof.calibrate(healthy_reference([s for s in per_unit if s > 0]))
        ref = prof.reference_s
        if ref is None:
            return {r: None for r in range(self.world)}
        return {r: (max(1.0, s / ref) if s > 0 else None) for r, s in enumerate(per_unit)}

    def _exchange_injections(self) -> None:
        """Slowdowns posted to any control endpoint reach their rank at the step boundary."""
        vec = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        if self.services.injections is not None:
            for rank, factor in self.services.injections.drain().items():
                if 0 <= rank < self.world:
                    vec[rank] = factor
        with self.meter.timed():
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        factor = float(vec[self.rank])
        if factor > 0:
            self.services.clock.inject(factor)

    def _publish(self, report: StepReport, compute: list[float]) -> None:
        svc = self.services
        svc.state.update(
            step=self.step,
            step_seconds=report.seconds,
            tokens_per_second=report.tokens_per_second,
            rates=report.rates,
        )
        if svc.metrics is not None:
            rates: dict[int, float | None] = dict(report.rates)
            if svc.profiler.reference_s is not None:  # calibrated: a rank without a figure
                rates = {r: math.nan if v is None else v for r, v in rates.items()}  # failed
            svc.metrics.observe_step(
                self.step,
                report.seconds,
                report.tokens_per_second,
                rates.get(self.rank),
                report.compute_seconds,
                loss=report.loss,
            )
            if svc.server is not None:  # an endpoint publishes every rank's figures
                gpn = self.job.gpus_per_node
                svc.metrics.observe_rates(
                    rates,
                    {r: r // gpn for r in range(self.world)},
                    dict(enumerate(compute)),
                )


def _backward_ones(y: Tensor, x: Tensor) -> Tensor:
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    return x.grad
