"""The cost model's calibration, measured by the trainers (the planner's `calibration` section).

In the first steps under a plan (after the start and after each switch) every rank files what
its steps cost besides layer compute (`profiling.CostSample`: TP collectives inside layer calls,
embedding and head per micro-batch, pipeline transfers, gradient sync per byte inside and across
nodes, the optimizer per byte held, the rest of the step); at the window's last step one world
all-reduce carries every rank's samples (each rank writes its own slot), and every rank reduces
them alike, step by step (`profiling.reduce_calibration`), to the terms in layer-time units and a
link rate per node, then takes each term's median over the steps (a loaded host's one slow step
does not make the figures). The coordinator's control endpoint publishes both (GET /status `calibration` and
`link_rates`; /metrics `malleus_cost_seconds`, `malleus_link_rate`), where the controller reads
them into the PlanningProblem.

The window is the same on every rank: it follows the plan generation in force and the step
counter, which every rank shares.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .profiling import CostSample, median_calibration, reduce_calibration

if TYPE_CHECKING:
    from .worker import Trainer

__all__ = ["CAL_STEPS", "CAL_WARMUP", "Calibrator"]

log = logging.getLogger(__name__)

CAL_WARMUP = 1
"""Steps under a new plan left out: they pay one-off costs (allocations, new groups)."""
CAL_STEPS = 4
"""Steps measured after them; the exchange runs after the last."""


class Calibrator:
    """One rank's calibration window; `calibration` and `link_rates` once one has closed."""

    def __init__(self) -> None:
        self._generation: int | None = None
        self._first = 0
        self.window: list[CostSample] = []  # one sample per measured step
        self.calibration: dict[str, Any] | None = None
        """The latest terms (`layer_seconds` in seconds, every other in layer-time units)."""
        self.link_rates: dict[int, float] = {}
        """Per node: its collectives' time over a healthy node's (1.0 = healthy)."""
        self.generation: int | None = None
        """The plan generation the latest figures were measured under."""

    def end_step(
        self, trainer: Trainer, step: int, started: float, seconds: float, optimizer_s: float
    ) -> bool:
        """After step `step` (which began at `started`): file it, and on the window's last
        step exchange and reduce (collective: every rank calls this after every step). True
        when new figures were published."""
        meter = trainer.meter
        try:
            generation = trainer.plan.generation
            if generation != self._generation:
                self._generation, self._first, self.window = generation, step, []
            k = step - self._first
            if not CAL_WARMUP <= k < CAL_WARMUP + CAL_STEPS:
                return False
            self.window.append(_sample(trainer, started, seconds, optimizer_s))
            if k < CAL_WARMUP + CAL_STEPS - 1:
                return False
            self._close(trainer)
            return True
        finally:
            meter.reset_stats()

    def _close(self, trainer: Trainer) -> None:
        width, world, rank = CostSample.width() * CAL_STEPS, trainer.world, trainer.rank
        mine = [v for sample in self.window for v in sample.values()]
        vec = torch.zeros(world * width, dtype=torch.float64, device=trainer.device)
        vec[rank * width : (rank + 1) * width] = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(vec)
        values = vec.tolist()
        one = CostSample.width()
        pipelines = [[stage.ranks for stage in p.stages] for p in trainer.plan.pipelines]
        ref = trainer.services.profiler.reference_s
        per_step = []
        for k in range(CAL_STEPS):  # reduced step by step, then the median of each term
            samples = [
                CostSample.of(values[r * width + k * one : r * width + (k + 1) * one])
                for r in range(world)
            ]
            per_step.append(
                reduce_calibration(
                    samples, pipelines, trainer.job.gpus_per_node, 2 * ref if ref else None
                )
            )
        calibration, links = median_calibration(per_step)
        self.calibration, self.link_rates = calibration, links
        self.generation = trainer.plan.generation
        svc = trainer.services
        svc.state.update(calibration=calibration, link_rates=links)
        if svc.metrics is not None and calibration is not None:
            svc.metrics.observe_calibration(calibration, links)
        if rank == 0:
            log.info(
                "calibration under plan generation %d: %s; link rates %s",
                self.generation,
                calibration,
                links,
            )


def _sample(trainer: Trainer, started: float, seconds: float, optimizer_s: float) -> CostSample:
    t, m = trainer.timer, trainer.meter
    place = trainer.layout.place
    emb = t.ends.get("embedding", [0.0, 0])
    head = t.ends.get("head", [0.0, 0])
    tp, p2p = m.stat("tp"), m.stat("p2p")
    intra, inter = m.stat("grad_intra"), m.stat("grad_inter")
    ran = t.started is not None and t.ended is not None
    return CostSample(
        steps=1,
        step_s=seconds,
        units=t.units,
        compute_s=t.seconds,
        calls=t.calls,
        tp_s=t.comm,
        tp_best=tp.best if tp.calls else 0.0,
        group=len(place.group) if place is not None else 0,
        emb_s=emb[0],
        emb_mb=int(emb[1]),
        head_s=head[0],
        head_mb=int(head[1]),
        p2p_best=p2p.best if p2p.calls else 0.0,
        p2p_calls=p2p.calls,
        grad_intra_s=intra.seconds,
        grad_intra_bytes=float(intra.bytes),
        grad_inter_s=inter.seconds,
        grad_inter_bytes=float(inter.bytes),
        opt_s=optimizer_s,
        opt_bytes=float(sum(p.numel() * p.element_size() for p in trainer.params.values())),
        run_s=(t.ended - t.started) if ran else 0.0,  # type: ignore[operator]
        end_s=(t.ended - started) if ran else 0.0,  # type: ignore[operator]
    )
