"""The cost model's calibration from every rank's figures (torch-free; the window, the probe and
the exchange are trainer/engine/calibrator.py's).

`CostSample` is one rank's figures for what the rest of a step costs (TP collectives inside
layer calls, embedding and head per micro-batch, pipeline transfers and the transfer probe,
gradient sync inside and across nodes and the all-reduce probe of its groups, the optimizer per
byte held, the rest of the step, the host it runs on); `reduce_calibration` turns the job's
samples, alike on every rank, into the cost model's `calibration` terms (layer-time units) and
a link rate per node (`link_rates`: its collectives over the healthy figure for the same kind);
trainer/measure/calibration_merge.py combines the steps' reductions and an earlier plan's calibration.
Waiting on a slower peer is not counted: a group's TP figure is its layer calls' wall time less
its slowest member's compute, a transfer's the shortest call.

The gradient sync is a cost per all-reduce call plus one per MiB (`grad_sync_fit`): the call
figure is the probe's small all-reduce (healthy over ranks), the per-MiB figure what the
critical rank's sync took beyond its calls at that figure, per MiB it synced (never below 0).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any, NamedTuple

from .calibration_merge import fill_unmeasured
from .profiling import healthy_reference

__all__ = [
    "MIB",
    "CostSample",
    "GradCallProbe",
    "grad_sync_fit",
    "link_rates",
    "reduce_calibration",
    "shared_host",
]

MIB = float(1 << 20)


class GradCallProbe(NamedTuple):
    """One rank's all-reduce probe (trainer/engine/calibrator.py `probe_grad_calls`): per kind of
    gradient-sync group (members in one node / across nodes), the sum of its groups' median
    small all-reduce seconds and the number of groups."""

    intra_s: float = 0.0
    intra_groups: int = 0
    inter_s: float = 0.0
    inter_groups: int = 0


@dataclass
class CostSample:
    """One rank's figures over a calibration window (sums over its steps unless said).

    Seconds are wall seconds; `tp_best` and `p2p_best` are the shortest single call (0 when
    none). `group`: the rank's TP group size (0: excluded). `run_s`: its 1F1B schedule;
    `end_s`: when the schedule ended, from the step's start. `probe_*`: the transfer probe
    (trainer/engine/calibrator.py) with the partner inside the node / in the paired node (`*_peer`,
    -1: none), its median round trip (0 on the pair's answering side), so that p2p is measured
    whether or not the plan has stage boundaries. `grad_*_calls`: the step's gradient-sync
    all-reduces; `call_*`: the all-reduce probe (`GradCallProbe`). `host`: an id of the
    machine the rank runs on (alike for processes under one kernel); `cpus`: the CPUs the rank
    may use (trainer/engine/calibrator.py `host_identity`).
    """

    steps: int = 0
    step_s: float = 0.0
    units: int = 0
    compute_s: float = 0.0
    calls: int = 0
    tp_s: float = 0.0
    tp_best: float = 0.0
    group: int = 0
    emb_s: float = 0.0
    emb_mb: int = 0
    emb_comm_s: float = 0.0
    head_s: float = 0.0
    head_mb: int = 0
    head_comm_s: float = 0.0
    p2p_best: float = 0.0
    p2p_calls: int = 0
    grad_intra_s: float = 0.0
    grad_intra_bytes: float = 0.0
    grad_intra_calls: int = 0
    grad_inter_s: float = 0.0
    grad_inter_bytes: float = 0.0
    grad_inter_calls: int = 0
    opt_s: float = 0.0
    opt_bytes: float = 0.0
    run_s: float = 0.0
    end_s: float = 0.0
    probe_intra_s: float = 0.0
    probe_intra_peer: int = -1
    probe_inter_s: float = 0.0
    probe_inter_peer: int = -1
    call_intra_s: float = 0.0
    call_intra_groups: int = 0
    call_inter_s: float = 0.0
    call_inter_groups: int = 0
    host: int = 0
    cpus: int = 0

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))

    def values(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def of(cls, values: Sequence[float]) -> CostSample:
        kinds = [f.type for f in fields(cls)]
        return cls(
            *(int(v) if k == "int" else float(v) for v, k in zip(values, kinds, strict=True))
        )

    def add(self, other: CostSample) -> None:
        """Fold another step in: sums add, shortest calls take the minimum."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in _BEST:
                v = min(x for x in (a, b) if x > 0) if a > 0 or b > 0 else 0.0
            elif f.name in _LATEST:
                v = b
            else:
                v = a + b
            setattr(self, f.name, v)


_BEST = ("tp_best", "p2p_best", "probe_intra_s", "probe_inter_s")
_LATEST = ("group", "probe_intra_peer", "probe_inter_peer", "host", "cpus")


def _healthy(xs: Iterable[float]) -> float | None:
    values = [x for x in xs if math.isfinite(x) and x > 0]
    return healthy_reference(values) if values else None


def reduce_calibration(
    samples: Sequence[CostSample],
    pipelines: Sequence[Sequence[Sequence[int]]],
    gpus_per_node: int,
    unit_s: float | None = None,
    previous: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, dict[int, float]]:
    """The job's `calibration` terms (layer-time units) and per-node link rates.

    `samples[r]`: rank r's window. `pipelines`: the plan in force, each pipeline's stages' TP
    groups in order. `unit_s`: seconds of one layer-time unit (one layer, forward + backward,
    one micro-batch, a healthy full group: twice the profiler's reference); None: from the
    samples' layer compute. None for the calibration when nothing ran.

    The terms are a healthy link's: a figure measured across a slow link is divided by that
    link's rate (the cost model multiplies it back where a group touches the node).

    A gradient-sync kind (in-node / cross-node groups) the plan has none of is not measured: it
    takes `previous`'s figure (the calibration before, at this plan's contention) or, without
    one, the other kind's scaled by the transfer probe's cross-node over in-node round trip;
    0 only when neither is known. (Published as 0, a plan with only cross-node groups would
    price every in-node group's sync as free.)
    """
    if unit_s is None:
        per_unit = [s.compute_s / s.units for s in samples if s.units]
        if not per_unit:
            return None, {}
        unit_s = 2 * healthy_reference(per_unit)
    L, gpn = unit_s, gpus_per_node
    stages = [(tuple(g), j == 0, j == len(p) - 1) for p in pipelines for j, g in enumerate(p)]

    def fastest(ranks: Sequence[int], value: Callable[[CostSample], float | None]) -> float | None:
        xs = [v for r in ranks if (v := value(samples[r])) is not None and v > 0]
        return min(xs) if xs else None

    best: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for ranks, _, _ in stages:
        if len(ranks) > 1 and (b := fastest(ranks, lambda s: s.tp_best)) is not None:
            best.setdefault(len(ranks), []).append((ranks, b))
    links = link_rates(samples, best, gpn)

    def link(ranks: Iterable[int]) -> float:
        return max((links.get(r // gpn, 1.0) for r in ranks), default=1.0)

    def group_tp(ranks: Sequence[int]) -> float | None:
        """The group's layer calls' wall time (its slowest member's) less its slowest member's
        compute, per layer and micro-batch: the TP collectives' cost to the group's pace. A
        member faster than its peers waits in them, which is not counted; equal members' wake-up
        jitter, which the group does pay, is."""
        xs = [samples[r] for r in ranks if samples[r].calls]
        if not xs:
            return None
        calls = max(s.calls for s in xs)
        wall = max(s.compute_s + s.tp_s for s in xs)
        return 2 * max(0.0, wall - max(s.compute_s for s in xs)) / calls

    tp_comm: dict[int, float] = {1: 0.0}
    by_size: dict[int, list[float]] = {}
    for ranks, _, _ in stages:
        if len(ranks) > 1 and (v := group_tp(ranks)) is not None and v > 0:
            by_size.setdefault(len(ranks), []).append(v / link(ranks))
    for g, vs in sorted(by_size.items()):
        if (h := _healthy(vs)) is not None:
            tp_comm[g] = h / L

    def end(first: bool, seconds: str, count: str, comm: str) -> tuple[float, dict[int, float]]:
        """An end's compute per micro-batch (its time less its own TP collectives, the
        fastest member's) and, by group size, those collectives (a healthy link's): they are
        latency-bound, so a group of one pays none and a bigger one pays them whatever its
        compute pace."""

        def compute(s: CostSample) -> float | None:
            n = getattr(s, count)
            return (getattr(s, seconds) - getattr(s, comm)) / n if n else None

        def collectives(s: CostSample) -> float | None:
            n = getattr(s, count)
            return getattr(s, comm) / n if n else None

        ends = [(ranks, f if first else la) for ranks, f, la in stages]
        h = _healthy(v for ranks, on in ends if on and (v := fastest(ranks, compute)) is not None)
        by_size: dict[int, list[float]] = {}
        for ranks, on in ends:
            if on and len(ranks) > 1 and (v := fastest(ranks, collectives)) is not None:
                by_size.setdefault(len(ranks), []).append(v / link(ranks))
        sizes = {g: x / L for g, vs in sorted(by_size.items()) if (x := _healthy(vs)) is not None}
        return (h / L if h is not None else 0.0), sizes

    neighbours: dict[int, set[int]] = {}  # rank -> ranks of its stage and the adjacent ones
    for p in pipelines:
        for j, g in enumerate(p):
            near = {r for k in (j - 1, j, j + 1) if 0 <= k < len(p) for r in p[k]}
            for r in g:
                neighbours[r] = near
    # The probe (trainer/engine/calibrator.py: a round trip of one activation, each hop to a rank
    # waiting for it, in and across nodes) is the figure whenever it ran, so that every plan in
    # force measures p2p alike; the pipeline's shortest exchange (which can be a lone send;
    # twice, for the two directions) only without it.
    probes = [
        (inter, trip / link((r, peer)))
        for r, s in enumerate(samples)
        for inter, trip, peer in (
            (False, s.probe_intra_s, s.probe_intra_peer),
            (True, s.probe_inter_s, s.probe_inter_peer),
        )
        if trip > 0 and peer >= 0
    ]
    p2p = _healthy(trip for _, trip in probes)
    if p2p is None:
        p2p = _healthy(
            2 * s.p2p_best / link(neighbours.get(r, ()))
            for r, s in enumerate(samples)
            if s.p2p_calls
        )
    ran = [r for r, s in enumerate(samples) if s.steps and s.run_s > 0]
    critical = max(ran, key=lambda r: samples[r].end_s) if ran else None
    serving = [r for p in pipelines for g in p for r in g]

    # Per call: a rank's in-node groups are on its own node; its cross-node ones are divided
    # by the job's slowest link, as the per-MiB cross-node figure is.
    call_intra = _healthy(
        s.call_intra_s / s.call_intra_groups / link([r])
        for r, s in enumerate(samples)
        if s.call_intra_groups
    )
    call_inter = _healthy(
        s.call_inter_s / s.call_inter_groups / link(serving) for s in samples if s.call_inter_groups
    )
    critical_link = link([critical] if critical is not None else [])
    sync_intra = grad_sync_fit(samples, critical, "intra", call_intra or 0.0, critical_link, L)
    sync_inter = grad_sync_fit(samples, critical, "inter", call_inter or 0.0, link(serving), L)
    trips = [_healthy(trip for inter, trip in probes if inter is kind) for kind in (False, True)]
    host = shared_host(samples, len(serving))
    sync = fill_unmeasured(
        {
            "grad_sync_intra": sync_intra,
            "grad_sync_inter": sync_inter,
            "grad_sync_call_intra": call_intra / L if call_intra is not None else None,
            "grad_sync_call_inter": call_inter / L if call_inter is not None else None,
        },
        trips[1] / trips[0] if trips[0] and trips[1] else None,
        previous,
        host,
    )

    optimizer = _healthy(s.opt_s / (s.opt_bytes / MIB) for s in samples if s.opt_bytes > 0)
    fixed = 0.0
    if critical is not None:
        c = samples[critical]
        rest = c.step_s - c.run_s - c.grad_intra_s - c.grad_inter_s - c.opt_s
        fixed = max(0.0, rest / c.steps) / L
    embedding, embedding_comm = end(True, "emb_s", "emb_mb", "emb_comm_s")
    head, head_comm = end(False, "head_s", "head_mb", "head_comm_s")
    calibration: dict[str, Any] = {
        "layer_seconds": L,
        "embedding": embedding,
        "embedding_comm": embedding_comm,
        "head": head,
        "head_comm": head_comm,
        "tp_comm": tp_comm,
        "p2p": p2p / L if p2p is not None else 0.0,
        **sync,
        "optimizer": optimizer / L if optimizer is not None else 0.0,
        "fixed": fixed,
        **host,
    }
    return calibration, links


def shared_host(samples: Sequence[CostSample], serving: int) -> dict[str, int | None]:
    """`shared_cpus` and `measured_active` (planner `Calibration`): the CPUs of the one host
    every rank runs on, when the ranks outnumber them, and the serving GPUs; both None when the
    ranks have CPUs of their own (several hosts, or as many CPUs as ranks)."""
    known = [s for s in samples if s.cpus > 0]
    if not known or len(known) < len(samples) or len({s.host for s in known}) != 1:
        return {"shared_cpus": None, "measured_active": None}
    cpus = min(s.cpus for s in known)
    if len(samples) <= cpus or serving <= 0:
        return {"shared_cpus": None, "measured_active": None}
    return {"shared_cpus": cpus, "measured_active": serving}


def grad_sync_fit(
    samples: Sequence[CostSample],
    critical: int | None,
    kind: str,
    call_s: float,
    slow: float,
    unit_s: float,
) -> float | None:
    """The gradient sync's per-MiB term (layer-time units) for `kind` ("intra" / "inter"):
    seconds beyond `call_s` (a healthy link's per-call seconds) per call, per MiB synced, at a
    healthy link (`slow`: the link rate the measured seconds ran at), never below 0. The
    critical rank's, whose sync the step waits for; without one, the lowest over the ranks; None
    when no rank synced any group of that kind."""

    def per_mib(s: CostSample) -> float | None:
        nbytes = getattr(s, f"grad_{kind}_bytes")
        if nbytes <= 0:
            return None
        seconds = getattr(s, f"grad_{kind}_s") / slow
        rest = seconds - getattr(s, f"grad_{kind}_calls") * call_s
        return max(0.0, rest) / (nbytes / MIB) / unit_s

    if critical is not None and (v := per_mib(samples[critical])) is not None:
        return v
    vs = [v for s in samples if (v := per_mib(s)) is not None]
    return min(vs) if vs else None


def link_rates(
    samples: Sequence[CostSample],
    tp_best: Mapping[int, Sequence[tuple[tuple[int, ...], float]]],
    gpus_per_node: int,
) -> dict[int, float]:
    """Per node, its collectives' time over the healthy figure of the same kind (>= 1.0).

    A node's TP groups (their shortest call, over the healthy groups' of that size) speak for
    its links, the fastest of them: every group there crosses the node's links, and one can only
    read slower than them (a straggling member's waits), so a median would let one slow GPU
    slow the node's link. A node without one is judged by its ranks' shortest pipeline transfers
    (their median: a boundary may cross to another node's slow link), and without those by its
    in-node probe exchanges (both ends on the node, the fastest again; a cross-node probe cannot
    tell which end is slow). A node with no evidence is healthy.
    """
    nodes = (len(samples) + gpus_per_node - 1) // gpus_per_node
    ratios: dict[int, list[float]] = {}
    for vs in tp_best.values():
        h = _healthy(v for _, v in vs)
        if h is None:
            continue
        for ranks, v in vs:
            ratios.setdefault(ranks[0] // gpus_per_node, []).append(v / h)
    p2p = _healthy(s.p2p_best for s in samples if s.p2p_calls)
    probe = _healthy(s.probe_intra_s for s in samples if s.probe_intra_peer >= 0)
    out: dict[int, float] = {}
    for n in range(nodes):
        mine = samples[n * gpus_per_node : (n + 1) * gpus_per_node]
        rate = min(ratios[n]) if ratios.get(n) else None
        if rate is None and p2p is not None:
            rs = [s.p2p_best / p2p for s in mine if s.p2p_calls and s.p2p_best > 0]
            rate = statistics.median(rs) if rs else None
        if rate is None and probe is not None:
            rs = [s.probe_intra_s / probe for s in mine if s.probe_intra_s > 0]
            rate = min(rs) if rs else None
        out[n] = max(1.0, rate) if rate is not None else 1.0
    return out
