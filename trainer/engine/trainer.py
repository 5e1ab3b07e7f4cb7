"""`Trainer`: one rank's part of a Plan (its pieces, optimizer state and layout) and its step.

A step: set the clock, run this stage's 1F1B schedule (or, for an excluded rank, a one-layer
benchmark), sum gradients per piece across their holders, one world all-gather of each rank's
own row (its part of the gradient norm and the loss, its compute figures, and on the
coordinator the control words), clip,
AdamW, report; then, at the step boundary, switch to a new plan or stop if rank 0 said so
(trainer/switching/protocol.py). Every rank, excluded ones included, takes part in the world collectives, in
the same order. Its state in and out (checkpoints, the full model) is trainer/engine/state.py, the run
around the steps (resume, logs, checkpoints, the final model) trainer/run/loop.py; an excluded
rank's benchmark step and the step's figures (rates, what is published, injected slowdowns)
trainer/engine/figures.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.job import ResolvedJob
from malleus.planner import Plan, check_plan
from malleus.trainer.data.samples import make_source, micro_batch
from malleus.trainer.model.decoder import Piece
from malleus.trainer.model.hf import initial_pieces
from malleus.trainer.model.precision import ComputeCopies, Precision
from malleus.trainer.parallel import migrate
from malleus.trainer.parallel.grad_sync import GradSync, owned_square_norm
from malleus.trainer.parallel.groups import GroupCache
from malleus.trainer.parallel.layout import Layout, Place
from malleus.trainer.parallel.optim import AdamState, PieceAdamW, clip_coefficient, lr_at
from malleus.trainer.parallel.pipeline import PipelineStage
from malleus.trainer.parallel.stage import StageModel
from malleus.trainer.parallel.tensor import TPGroup
from malleus.trainer.parallel.timing import CommMeter, LayerTimer, stopwatch_for
from malleus.trainer.switching.protocol import (
    CONTROL_WORDS,
    MIGRATION_TIMEOUT_S,
    Boundary,
    Coordinator,
    Migration,
    MigrationError,
    settle,
)
from malleus.trainer.world.exchange import broadcast_bytes, rows
from malleus.trainer.world.faults import Faults, fault_point, pause_point
from malleus.trainer.world.world import World

from .calibrator import Calibrator
from .figures import Benchmark, exchange_injections, publish, publish_migration, rates_of
from .services import Services
from .step import OWN_WORDS, StepReport, world_vector

__all__ = ["Trainer"]

log = logging.getLogger(__name__)


class Trainer:
    """One rank's model pieces, optimizer and layout, and the step that trains them."""

    def __init__(
        self,
        job: ResolvedJob,
        plan: Plan,
        *,
        rank: int,
        world: World,
        device: torch.device,
        steps: int | None = None,
        services: Services | None = None,
        groups: GroupCache | None = None,
        migration_timeout_s: float = MIGRATION_TIMEOUT_S,
        precision: Precision | None = None,
        joiners: Callable[[], int] | None = None,
    ) -> None:
        if world.size != job.world:
            raise ValueError(
                f"world size {world.size} != nodes({job.nodes}) * gpusPerNode({job.gpus_per_node})"
            )
        placed = set(plan.active_ranks()) | set(plan.excluded)  # a GPU out of the job: unusable
        check_plan(job.problem({g: None for g in range(job.world) if g not in placed}), plan)
        self.job, self.plan, self.rank, self.world, self.device = job, plan, rank, world, device
        self.model, self.training = job.model, job.spec.training
        self.steps = steps if steps is not None else job.steps  # the LR schedule's length
        if services is None:
            services = Services.null(job, rank, steps=self.steps, coordinator=world.coordinator())
        self.services = services
        self.groups = groups if groups is not None else GroupCache(world)
        self.meter = CommMeter(  # an emulated clock charges slow links (`link_wait`)
            stopwatch_for(device, emulated=self.services.emulated),
            gpus_per_node=job.gpus_per_node,
            link=getattr(self.services.clock, "link_wait", None),
        )
        self.calibrator = (
            Calibrator()
        )  # the cost model's terms, measured (trainer/engine/calibrator.py)
        self.optimizer_seconds = 0.0  # the last step's optimizer update
        self.faults = Faults(job.failures, rank, world.store)  # emulated kill / hang (faults.py)
        clock = self.faults.clock(self.services.clock)
        self.timer = LayerTimer(clock, self.services.profiler, self.meter, world)
        tr = self.training
        self.source = make_source(tr.dataset, job.model.sequence, job.model.vocab, tr.seed, tr.data)
        self.step = 0
        self.layout = Layout.from_plan(plan, job.model, rank, world.size)
        self.groups.ensure(self.layout.member_sets())  # collective: all ranks, same order
        held = self.layout.held()
        # the job's precision unless a test asks for float64 (RunOptions.float64)
        self.precision = precision if precision is not None else Precision.of(tr.precision)
        # master pieces: what is updated, saved, migrated; seeded, or read from safetensors
        self.params: dict[str, Tensor] = self._initial_params(held)
        self.compute = ComputeCopies(self.params, self.precision)  # what the layers read
        self.optim = PieceAdamW(self.params, {p.name: p.spec.decay for p in held}, tr.weight_decay)
        self.act_shape = (tr.micro_batch_size, job.model.sequence, job.model.hidden)
        self.pipeline: PipelineStage | None = None
        self.rebuild_pipeline()
        self.bench = Benchmark()  # an excluded rank's step
        self.migration_timeout_s = migration_timeout_s
        self.boundary = Boundary()  # what the last step boundary announced
        self.last_migration: Migration | None = None
        self.last_vec: tuple[int, list[float]] | None = None  # (step, its world vector)
        # The coordinator's count of replacements waiting to join, before each world vector:
        # recovery's (trainer/recovery/join.py `joiners`), passed in by the rank's loop.
        self.joiners = joiners
        svc = self.services
        self.coordinator = (
            Coordinator(svc.inbox, svc.stop)
            if rank == world.coordinator() and svc.inbox is not None and svc.stop is not None
            else None
        )
        if svc.inbox is not None:
            svc.inbox.applied(plan.generation)
        svc.state.update(generation=plan.generation, plan=plan)
        if svc.metrics is not None:
            svc.metrics.observe_plan(plan.generation)

    # ---- construction -----------------------------------------------------------------------
    def _initial_params(self, held: list[Piece]) -> dict[str, Tensor]:
        start = initial_pieces(self.job, held)  # seeded, or read slice by slice from safetensors
        master = self.precision.master
        return {p.name: start[p.name].to(self.device, master).requires_grad_() for p in held}

    def rebuild_pipeline(self) -> None:
        """The process groups of the layout in force (collective when one is missing: every
        rank, same order) and this rank's pipeline stage over them (None: excluded)."""
        self.groups.ensure(self.layout.member_sets())
        self.world.progress.relayout()  # its first step is measured, not judged
        # Overlapped with the backward on real timings; an emulated link stretches a collective
        # by its own duration, which an overlapped one does not show (grad_sync.py).
        self.grad_sync = GradSync(
            self.layout, self.groups, self.meter, overlap=not self.services.emulated
        )
        place = self.layout.place
        self.pipeline = self._pipeline(place) if place is not None else None

    def drop_groups(self) -> None:
        """Let go of every process group and the stage built on them (their process group
        was lost: trainer/recovery/groups.py)."""
        self.groups.reset()
        self.pipeline = None

    def _pipeline(self, place: Place) -> PipelineStage:
        group = self.groups.get(place.group) if len(place.group) > 1 else None
        tp = TPGroup(group, place.group, place.index, self.world, self.meter)
        model = StageModel(
            self.model,
            self.job.tp,
            place,
            self.compute.tensors,
            tp,
            self.device,
            self.precision.compute,
            compiled=self.training.compile,
        )
        return PipelineStage(
            model,
            place,
            self._batch,
            self.layout.total_micro_batches,
            self.timer,
            self.act_shape,
            self.device,
            world=self.world,
            dtype=self.precision.compute,
            recompute=self.training.activation_checkpointing,
            finished=self.grad_sync.ready,
        )

    def _batch(self, micro: int) -> tuple[Tensor, Tensor]:
        tr = self.training
        with self.world.progress.outside():  # the data source: bounded by the hang timeout
            if micro == 0:
                pause_point("data", self.rank, self.step)
            x, y = micro_batch(
                self.source, self.step, micro, tr.global_batch_size, tr.micro_batch_size
            )
        if self.device.type == "cuda":  # from pinned memory the copy needs no wait for the GPU
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    # ---- the step ---------------------------------------------------------------------------
    def train_step(self) -> StepReport:
        """One step. A failed collective raises the backend's RuntimeError; the rank's loop
        takes it for a peer's failure when failures are survivable (trainer/run/loop.py), and the
        step then commits or is redone after recovery. Replacements announced at this step's
        boundary (`boundary.joins`) are admitted by the loop, after it."""
        with self.world.step_deadline(self.step):  # a hang fails every survivor at once
            stats, payload, t0 = self._train_step()
        self.last_vec = (self.step, stats)  # the step commits: recovery may hand it to others
        report = self.commit(stats, t0)
        self.calibrator.end_step(self, report.step, t0, report.seconds, self.optimizer_seconds)
        self._at_boundary(Boundary.decode(stats[2 + 2 * self.world.size :]), payload)
        return report

    def _train_step(self) -> tuple[list[float], bytes, float]:
        """The step up to its world all-gather (included): the world vector (`world_vector`),
        the coordinator's payload, the start time."""
        svc = self.services
        t0 = time.perf_counter()
        svc.clock.set_step(self.step)
        self.faults.arm(self.step)
        if svc.emulated:
            exchange_injections(self)
        self.optim.zero_grad()
        self.timer.reset()
        self.grad_sync.begin(self.params)
        try:  # the schedule posts the gradient sync's chunks as its last backward ends them
            loss_sum = self.pipeline.run() if self.pipeline is not None else self.bench.run(self)
        except BaseException:
            self.grad_sync.abandon()
            raise
        self.timer.settle()  # the benchmark's (a schedule's are read as it ends)
        svc.profiler.end_step()
        self.grad_sync.finish()

        # One world all-gather of each rank's own row: [owned grad^2, loss part, seconds/unit,
        # compute, control words (the coordinator's row only)]; `world_vector` sums and slots
        # them, each slot from its own GPU's row (a gather, not a sum: no rank speaks for
        # another).
        W = self.world.size
        row = torch.zeros(OWN_WORDS + CONTROL_WORDS, dtype=torch.float64, device=self.device)
        row[0] = owned_square_norm(self.layout, self.params, self.device)
        place = self.layout.place
        if place is not None and place.last and place.index == 0:
            row[1] = loss_sum  # each pipeline's losses, once
        if self.timer.units:
            row[2] = self.timer.seconds / self.timer.units
        row[3] = self.timer.seconds
        payload = b""
        if self.coordinator is not None:  # a plan posted after this line waits a step
            with self.world.progress.outside():  # the inbox and the store: not compute
                announce, payload = self.coordinator.take()
                announce = replace(announce, joins=self.joiners() if self.joiners else 0)
            words = torch.tensor(announce.words(), dtype=torch.float64)
            if self.device.type == "cuda":  # a copy from pageable memory waits for the GPU
                words = words.pin_memory()
            row[OWN_WORDS:] = words.to(self.device, non_blocking=True)
        self.world.bound()
        got = rows(row, self.world)
        table = torch.stack(list(got.values())).tolist()  # one copy off the device
        vec = world_vector(dict(zip(got, table, strict=True)), W, self.world.coordinator())
        return vec, payload, t0

    def commit(self, stats: list[float], t0: float) -> StepReport:
        """Apply the optimizer update of the step whose world vector is `stats` (never before
        that all-gather completed on some rank: trainer/recovery/protocol.py's commit rule)."""
        tr, W = self.training, self.world.size
        norm = math.sqrt(stats[0])
        lr = lr_at(self.step, tr.learning_rate, tr.warmup_steps, self.steps)
        t_opt = time.perf_counter()
        self.optim.step(lr, clip_coefficient(norm, tr.grad_clip))
        self.compute.refresh()
        self.optimizer_seconds = time.perf_counter() - t_opt

        seconds = time.perf_counter() - t0
        report = StepReport(
            step=self.step,
            loss=stats[1] / self.layout.total_micro_batches,
            grad_norm=norm,
            lr=lr,
            seconds=seconds,
            tokens_per_second=self.job.tokens_per_step / seconds,
            compute_seconds=self.timer.seconds,
            rates=rates_of(self, stats[2 : 2 + W]),
        )
        self.step += 1
        publish(self, report, stats[2 + W : 2 + 2 * W])
        return report

    # ---- the step boundary: switch, stop ----------------------------------------------------
    def _at_boundary(self, boundary: Boundary, payload: bytes) -> None:
        self.boundary = boundary
        if boundary.plan_bytes:
            data = broadcast_bytes(
                payload,
                world=self.world,
                device=self.device,
                what=f"the plan announced at step {self.step}",
                length=boundary.plan_bytes,
            )
            plan = Plan.from_json(data)  # validated by the coordinator's inbox when it came in
            try:
                self.switch(plan)
            except Exception as e:
                if self.services.inbox is not None:
                    self.services.inbox.failed(plan.generation, str(e))
                raise

    def switch(self, plan: Plan) -> Migration:
        """Collective: put `plan` in force now, moving every piece and its Adam state to its
        new holders (`parallel/migrate.py`), then rebuilding the TP, pipeline and gradient-sync groups.

        Raises MigrationError naming this rank, the generation and the step; every wait is
        bounded by `migration_timeout_s`.
        """
        t0 = time.perf_counter()
        doing = f"the switch to plan generation {plan.generation} at step {self.step}"
        if self.rank == 0 and self.services.note is not None:
            self.services.note(doing)
        try:
            new = Layout.from_plan(plan, self.model, self.rank, self.world.size)
            width = self.precision.master_bytes  # masters and Adam state move, never copies
            moves = migrate.plan_transfers(
                self.layout.roles, new.roles, self.model, self.job.tp, self.job.gpus_per_node, width
            )
            minimal = migrate.minimal_bytes(self.model, self.plan, plan, width)
            exchange = migrate.post(
                moves,
                self.rank,
                self.params,
                self.optim.state,
                self.device,
                self.precision.master,
                world=self.world,
            )
            fault_point("migration", self.rank, store=self.world.store)
            received = exchange.wait(self.migration_timeout_s)
            settle(self.migration_timeout_s, self.world)
            self.groups.ensure(new.member_sets())  # collective: all ranks, same order
            self.adopt(plan, new, received)
            # Measured, not derived: the bytes that went over the wire, the slowest rank's time.
            totals = torch.tensor(
                [float(exchange.sent_bytes), time.perf_counter() - t0], dtype=torch.float64
            ).to(self.device)
            self.world.wait(dist.all_reduce(totals[:1], async_op=True))
            self.world.wait(dist.all_reduce(totals[1:], op=dist.ReduceOp.MAX, async_op=True))
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
        publish_migration(self.services, self.rank, record)
        self.last_migration = record
        return record

    def adopt(self, plan: Plan, new: Layout, received: dict[str, tuple[Tensor, AdamState]]) -> None:
        """Switch the local state to `new`: keep what stays, take what arrived, drop the rest
        (a switch, and a recovery from surviving replicas). Every piece of `new` this rank
        holds must be here or in `received`."""
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
        self.rebuild_pipeline()
        self.services.state.update(plan=plan)

    # ---- what recovery asks of a Trainer (trainer/recovery/) ------------------------------------
    def close_interrupted_step(self, step: int, vec: list[float] | None) -> None:
        """A recovery goes on from `step`: commit this rank's interrupted step when its world
        vector completed on some rank (`vec`, and this rank is the step before), drop its
        gradients, and keep a stop that vector announced (a switch it announced is superseded)."""
        if vec is not None and self.step == step - 1:
            self.commit(vec, time.perf_counter())
        self.optim.zero_grad()
        if vec is not None:
            self.boundary = Boundary(0, Boundary.decode(vec[2 + 2 * self.world.size :]).stop)

    def start_over(self, plan: Plan, new: Layout) -> None:
        """Put `plan` in force with the initial state (seeded, or the model's own weights) at
        step 0: a rollback, before it reads a checkpoint."""
        held = new.held()
        self.params = self._initial_params(held)
        self.compute = ComputeCopies(self.params, self.precision)
        decay = {p.name: p.spec.decay for p in held}
        self.optim = PieceAdamW(self.params, decay, self.training.weight_decay)
        self.plan, self.layout = plan, new
        self.step = 0
        self.last_vec = None
        self.rebuild_pipeline()

    def enter_at(self, step: int) -> None:
        """A replacement admitted into the running job takes its step (it holds nothing yet)."""
        self.step = step

    def become_coordinator(self, generation: int, can_checkpoint: bool) -> None:
        """Take the coordinator's office (the lowest survivor, after a recovery): the plan inbox
        at `generation`, the stop request and the control endpoint."""
        svc = self.services
        svc.promote(generation)
        assert svc.inbox is not None and svc.stop is not None
        svc.stop.can_checkpoint = can_checkpoint
        self.coordinator = Coordinator(svc.inbox, svc.stop)
