"""The cost model's calibration, measured by the trainers (the planner's `calibration` section).

In the first steps under a plan (after the start and after each switch) every rank files what
its steps cost besides layer compute (`calibration_terms.CostSample`: TP collectives inside
layer calls, embedding and head per micro-batch, pipeline transfers and the transfer probe,
gradient sync per byte inside and across nodes, the optimizer per byte held, the rest of the
step); at the window's last step one world all-gather carries every rank's samples (each in
its own row: no rank can write another's), and every rank reduces them alike, step by step
(`calibration_terms.reduce_calibration`), to the terms in layer-time units and a link rate per
node, then takes each term's median over the steps (a loaded host's one slow step does not make
the figures). The coordinator's control endpoint publishes both (GET /status `calibration` and
`link_rates`; /metrics `malleus_cost_seconds`, `malleus_link_rate`), where the controller reads
them into the PlanningProblem.

The window is the same on every rank: it follows the plan generation in force and the step
counter, which every rank shares.

A plan without stage boundaries (one-stage pipelines) has no pipeline transfer to time, yet the
planner's next plan may have several stages: so after each measured step every rank also probes
one (`probe`): a ping-pong of one micro-batch's activation (micro-batch x sequence x hidden, the
compute dtype: what a stage boundary carries each way, the activation forward and its gradient
back) with a partner inside its node, then with one in the paired node (nodes 0-1, 2-3, ...),
through the same `CommMeter` (an emulated slow link charges it as it charges the pipeline's
transfers). Pairs are disjoint and every rank runs the inside-node probe before the cross-node
one, so no rank waits on one that is busy elsewhere; the probe runs between steps (outside every
step's time) on its own buffers and tag, so the training math is untouched. It is the p2p
figure under every plan, so one-stage and multi-stage calibrations measure it alike.

Gloo all-reduces of small gradient buckets are latency-bound, and a mixed plan splits a GPU's
gradients into more buckets (one per holder set) than the uniform plan, so the gradient sync is
fitted as a cost per call plus one per byte: after the transfer probe every rank also times a
small all-reduce on each of its gradient-sync groups (`probe_grad_calls`: the buckets in
the layout's global order, which every member of a group follows alike), and the per-byte
figure is what the step's sync took beyond its calls.
"""

from __future__ import annotations

import logging
import math
import socket
import statistics
import zlib
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from malleus.job.resources import usable_cpus
from malleus.trainer.measure.calibration_merge import keep_sizes, median_calibration
from malleus.trainer.measure.calibration_terms import CostSample, GradCallProbe, reduce_calibration
from malleus.trainer.world.exchange import rows

from .step import TrainerView

__all__ = [
    "CAL_STEPS",
    "CAL_WARMUP",
    "PROBE_CALLS",
    "Calibrator",
    "host_identity",
    "probe",
    "probe_grad_calls",
    "probe_peers",
]

log = logging.getLogger(__name__)

CAL_WARMUP = 1
"""Steps under a new plan left out: they pay one-off costs (allocations, new groups)."""
CAL_STEPS = 4
"""Steps measured after them; the exchange runs after the last."""
PROBE_CALLS = 3
"""Timed probe round trips per partner and measured step, after one untimed one that lines the
pair up (so a partner's late arrival is not counted); their median is the figure: each hop's
wake-up of a waiting rank is what a pipeline boundary costs, and a lucky one is not typical."""
PROBE_TAG = 3  # apart from the pipeline's ACT_TAG / GRAD_TAG (trainer/parallel/pipeline.py)
PROBE_ELEMENTS = 1024
"""Most elements of an all-reduce probe (4 KiB of float32: latency-bound on any link). Fewer
would not time a bucket's call: a ring all-reduce skips its empty chunks, so gloo's of one
element takes a fifth of one of 16 or more among 16 processes (measured on this 2-core host).
So a probe carries its bucket's elements, up to this or to its member count if larger."""


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

    def restart(self) -> None:
        """Start the window again at the next step (every member of a re-formed group does,
        at the same step: trainer/recovery/)."""
        self._generation = None

    def end_step(
        self, trainer: TrainerView, step: int, started: float, seconds: float, optimizer_s: float
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
            # The step's gradient sync is read (with CUDA events, after the schedule's read):
            # free on a GPU, which has drained its queue for the world vector's read.
            trainer.timer.settle()
            probes = probe(trainer)
            calls = probe_grad_calls(trainer)
            self.window.append(_sample(trainer, started, seconds, optimizer_s, probes, calls))
            if k < CAL_WARMUP + CAL_STEPS - 1:
                return False
            self._close(trainer)
            return True
        finally:
            meter.reset_stats()

    def _close(self, trainer: TrainerView) -> None:
        width, world, rank = CostSample.width() * CAL_STEPS, trainer.world.size, trainer.rank
        mine = [v for sample in self.window for v in sample.values()]
        # A gather, not a sum: slot r comes from GPU r's own row (no rank writes another's).
        got = rows(torch.tensor(mine, dtype=torch.float64, device=trainer.device), trainer.world)
        table = dict(zip(got, torch.stack(list(got.values())).tolist(), strict=True))
        values = [v for r in range(world) for v in table.get(r, [0.0] * width)]
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
                    samples,
                    pipelines,
                    trainer.job.gpus_per_node,
                    2 * ref if ref else None,
                    self.calibration,
                )
            )
        calibration, links = median_calibration(per_step)
        calibration = keep_sizes(calibration, self.calibration)
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


def probe_peers(
    gpu: int, members: Sequence[int], gpus_per_node: int
) -> tuple[int | None, int | None]:
    """`gpu`'s probe partners among the job's live GPUs `members`: inside its node (its live
    GPUs paired in order: 1st-2nd, 3rd-4th, ...) and in the paired node (node n ^ 1, the GPU of
    the same position among that node's live ones). Symmetric, so every pair agrees; None
    where there is no partner (an odd one out, an unpaired last node)."""
    node = gpu // gpus_per_node

    def live(n: int) -> list[int]:
        return sorted(g for g in members if g // gpus_per_node == n)

    mine = live(node)
    i = mine.index(gpu)
    intra = mine[i ^ 1] if (i ^ 1) < len(mine) else None
    theirs = live(node ^ 1)
    inter = theirs[i] if i < len(theirs) else None
    return intra, inter


def probe(trainer: TrainerView) -> tuple[tuple[int, float] | None, tuple[int, float] | None]:
    """Time one stage boundary's transfers with each partner (`probe_peers`): a ping-pong, the
    lower GPU of the pair sending one activation and waiting for one back, the other waiting for
    it and answering, so that each message reaches a rank blocked on it, as the pipeline's do.
    Returns (partner, seconds) inside the node and across: the median of the lower GPU's timed
    round trips (the higher GPU's seconds are 0: it waited for each ping, which is not a cost).
    Collective over the pairs: every live rank calls it at the same step."""
    now = trainer.world.current
    members = now.members if now is not None else tuple(range(trainer.world.size))
    peers = probe_peers(trainer.rank, members, trainer.job.gpus_per_node)
    send = torch.zeros(trainer.act_shape, dtype=trainer.precision.compute, device=trainer.device)
    recv = torch.empty_like(send)
    nbytes = 2 * send.numel() * send.element_size()  # one each way, as the pipeline counts
    out: list[tuple[int, float] | None] = []
    for kind, peer in zip(("probe_intra", "probe_inter"), peers, strict=True):
        if peer is None:
            out.append(None)
            continue
        dst, lead = trainer.world.pg(peer), trainer.rank < peer
        trips = []
        for i in range(1 + PROBE_CALLS):
            if not lead:
                dist.recv(recv, dst, tag=PROBE_TAG)
                dist.send(send, dst, tag=PROBE_TAG)
                continue
            # The first round trip lines the pair up (the partner may still be finishing its
            # step): not counted. The meter charges an emulated slow link inside the timing.
            with trainer.meter.timed(
                kind if i else "probe_lineup", (trainer.rank, peer), nbytes
            ) as trip:
                dist.send(send, dst, tag=PROBE_TAG)
                dist.recv(recv, dst, tag=PROBE_TAG)
            if i:
                trips.append(trip)
        # read on the stopwatch of the step's own figures
        out.append((peer, statistics.median(trainer.meter.seconds_of(trips)) if trips else 0.0))
    return out[0], out[1]


def probe_grad_calls(trainer: TrainerView) -> GradCallProbe:
    """Time one all-reduce call on each of this rank's gradient-sync groups: a small float32
    tensor (its bucket's size up to PROBE_ELEMENTS: the call's latency, not its bytes), one
    untimed call that lines the group up, then PROBE_CALLS timed ones, their median per group.
    Returns, inside a node and across nodes, the sum of the groups' medians and the number of
    groups. Collective over each group: the buckets run in the layout's global order, the same
    on every rank."""
    sums, counts = [0.0, 0.0], [0, 0]
    gpn = trainer.job.gpus_per_node
    for bucket in trainer.layout.my_buckets():
        group = trainer.groups.get(bucket.members)
        inter = int(len({r // gpn for r in bucket.members}) > 1)
        size = sum(trainer.params[name].numel() for name in bucket.pieces)
        n = min(size, max(PROBE_ELEMENTS, len(bucket.members)))
        x = torch.zeros(n, dtype=torch.float32, device=trainer.device)
        calls = []
        for i in range(1 + PROBE_CALLS):
            # Through the meter, so an emulated slow link charges these as the sync's.
            kind = "call_probe" if i else "probe_lineup"
            with trainer.meter.timed(kind, bucket.members, 4 * n) as call:
                dist.all_reduce(x, group=group)
            if i:
                calls.append(call)
        sums[inter] += statistics.median(trainer.meter.seconds_of(calls))
        counts[inter] += 1
    return GradCallProbe(sums[0], counts[0], sums[1], counts[1])


@cache
def host_identity() -> tuple[int, int]:
    """(an id of this machine, the CPUs this process may use): ranks with one id share the
    host's CPUs, which is what makes the host-work terms grow with the serving GPUs when a
    laptop emulates many (planner `Calibration.contention`). The id is the kernel's boot id
    (alike in every container under one kernel; a pod's hostname is its own), else the
    hostname's; 48 bits, exact in the float64 exchange. The CPUs: the affinity mask, bounded by
    the cgroup's quota (cpu.max) where one is set."""
    try:
        host = int(Path("/proc/sys/kernel/random/boot_id").read_text().replace("-", "")[:12], 16)
    except (OSError, ValueError):
        host = zlib.crc32(socket.gethostname().encode())
    cpus = usable_cpus()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return host, cpus


def _sample(
    trainer: TrainerView,
    started: float,
    seconds: float,
    optimizer_s: float,
    probes: tuple[tuple[int, float] | None, tuple[int, float] | None] = (None, None),
    calls: GradCallProbe | None = None,
) -> CostSample:
    calls = calls or GradCallProbe()
    t, m = trainer.timer, trainer.meter
    pi, px = probes[0] or (-1, 0.0), probes[1] or (-1, 0.0)
    place = trainer.layout.place
    emb = t.ends.get("embedding", [0.0, 0, 0.0])
    head = t.ends.get("head", [0.0, 0, 0.0])
    tp, p2p = m.stat("tp"), m.stat("p2p")
    intra, inter = m.stat("grad_intra"), m.stat("grad_inter")
    ran = t.started is not None and t.ended is not None
    host, cpus = host_identity()
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
        emb_comm_s=emb[2],
        head_s=head[0],
        head_mb=int(head[1]),
        head_comm_s=head[2],
        p2p_best=p2p.best if p2p.calls else 0.0,
        p2p_calls=p2p.calls,
        grad_intra_s=intra.seconds,
        grad_intra_bytes=float(intra.bytes),
        grad_intra_calls=intra.calls,
        grad_inter_s=inter.seconds,
        grad_inter_bytes=float(inter.bytes),
        grad_inter_calls=inter.calls,
        call_intra_s=calls.intra_s,
        call_intra_groups=calls.intra_groups,
        call_inter_s=calls.inter_s,
        call_inter_groups=calls.inter_groups,
        opt_s=optimizer_s,
        opt_bytes=float(sum(p.numel() * p.element_size() for p in trainer.params.values())),
        run_s=(t.ended - t.started) if ran else 0.0,  # type: ignore[operator]
        end_s=(t.ended - started) if ran else 0.0,  # type: ignore[operator]
        probe_intra_s=pi[1],
        probe_intra_peer=pi[0],
        probe_inter_s=px[1],
        probe_inter_peer=px[0],
        host=host,
        cpus=cpus,
    )
