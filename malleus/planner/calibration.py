"""The planning problem's `calibration` section: the cost terms the trainers measure beyond
layer compute (docs/architecture.md, "Cost model"), their bounds and the host contention of
emulated GPUs; `malleus.planner.problem` validates it with the rest of the problem.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BY_SIZE_TERMS",
    "COUNT_TERMS",
    "HOST_TERMS",
    "MAX_TERM",
    "PER_MIB_TERMS",
    "SCALAR_TERMS",
    "Calibration",
    "calibration_faults",
    "contention",
]

SCALAR_TERMS = ("embedding", "head", "p2p", "fixed", "grad_sync_call_intra", "grad_sync_call_inter")
"""Calibration terms that are a time (per micro-batch, call or step): /metrics
`malleus_cost_seconds{term}` (trainer/endpoint/metrics.py, read back by malleus/controller/sources.py)."""
PER_MIB_TERMS = ("grad_sync_intra", "grad_sync_inter", "optimizer")
"""Calibration terms per MiB held: `malleus_cost_seconds_per_mebibyte{term}`."""
BY_SIZE_TERMS = ("tp_comm", "embedding_comm", "head_comm")
"""Calibration terms by TP group size: `malleus_cost_seconds{term, group_size}`."""
COUNT_TERMS = ("shared_cpus", "measured_active")
"""Calibration entries that are counts (the host's sharing): `malleus_calibration_host{term}`."""
HOST_TERMS = tuple(t for t in (*SCALAR_TERMS, *PER_MIB_TERMS) if t not in ("embedding", "head"))
"""Scalar terms that are host work (collectives, transfers, optimizer, the rest of a step), which
`Calibration.contention` scales; the by-size terms (collectives) scale too."""
_CALIBRATION_TERMS = (*SCALAR_TERMS, *PER_MIB_TERMS)
MAX_TERM = 1e6
"""Largest calibrated term in layer-time units (a million layers' time): beyond it a figure is a
unit mistake, and unbounded ones overflow the cost model."""


def calibration_faults(c: Calibration) -> list[str]:
    """Every fault of a calibration section, each naming its field."""
    faults: list[str] = []
    if not (math.isfinite(c.layer_seconds) and 0 < c.layer_seconds <= 1e6):
        faults.append(
            f"calibration.layer_seconds: {c.layer_seconds} is not allowed; need seconds > 0 "
            "(at most 1e6)"
        )
    for name in _CALIBRATION_TERMS:
        v = getattr(c, name)
        if not (math.isfinite(v) and 0 <= v <= MAX_TERM):
            faults.append(
                f"calibration.{name}: {v} is not allowed; need a finite number from 0 to "
                f"{MAX_TERM:g} (layer-time units)"
            )
    for name in BY_SIZE_TERMS:
        unit = "per layer" if name == "tp_comm" else "per micro-batch"
        for size, v in sorted(getattr(c, name).items()):
            if size < 1 or size & (size - 1):
                faults.append(
                    f"calibration.{name}[{size}]: {size} is not a TP group size (a power of "
                    "two: 1, 2, 4, 8, ...)"
                )
            if not (math.isfinite(v) and 0 <= v <= MAX_TERM):
                faults.append(
                    f"calibration.{name}[{size}]: {v} is not allowed; need a finite number from "
                    f"0 to {MAX_TERM:g} (layer-time units {unit})"
                )
    shared = {"shared_cpus": c.shared_cpus, "measured_active": c.measured_active}
    given = [k for k, v in shared.items() if v is not None]
    if len(given) == 1:
        other = next(k for k in shared if k not in given)
        faults.append(
            f"calibration.{given[0]}: given without calibration.{other}; give both (the host's "
            "shared CPUs and the GPUs serving when measured) or neither"
        )
    for name, v in shared.items():
        if v is not None and not 1 <= v <= 1_000_000:
            faults.append(f"calibration.{name}: {v} is not allowed; need a count from 1")
    return faults


def contention(shared_cpus: int | None, measured: int | None, active: int) -> float:
    """Host work with `active` GPUs serving over the same work measured with `measured`, when
    `shared_cpus` CPUs serve them all: max(1, A/C) / max(1, M/C); 1.0 without sharing."""
    c, m = shared_cpus, measured
    if not c or not m or active <= 0:
        return 1.0
    return max(1.0, active / c) / max(1.0, m / c)


class Calibration(BaseModel):
    """Measured cost terms beyond layer compute, in layer-time units (one layer, forward+backward,
    one micro-batch, a healthy full TP group). Absent: layer compute only (the model before).

    docs/architecture.md ("Cost model") states how each term enters the step time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer_seconds: float = Field(
        description="Seconds of one layer-time unit (converts the estimate to seconds); > 0."
    )
    embedding: float = Field(
        default=0.0,
        description="The first stage's extra work per micro-batch (embedding forward+backward), "
        "at a healthy full group's pace.",
    )
    head: float = Field(
        default=0.0,
        description="The last stage's extra work per micro-batch (head and loss "
        "forward+backward), at a healthy full group's pace.",
    )
    tp_comm: dict[int, float] = Field(
        default_factory=dict,
        description="TP collectives per layer per micro-batch, by TP group size (2, 4, 8, ...); "
        "size 1 costs 0; a size not listed takes the nearest listed one, scaled by the ring "
        "all-reduce volume (s-1)/s.",
    )
    embedding_comm: dict[int, float] = Field(
        default_factory=dict,
        description="The embedding's own TP collectives per micro-batch (a vocabulary-parallel "
        "embedding's all-reduce), by TP group size, sizes as in `tp_comm`. Given, `embedding` is "
        "its compute alone; absent, `embedding` counts both (as before this field).",
    )
    head_comm: dict[int, float] = Field(
        default_factory=dict,
        description="The head's and loss's own TP collectives per micro-batch (a vocabulary-"
        "parallel loss's all-reduces), by TP group size, as `embedding_comm`: latency-bound, so "
        "they do not scale with the stage's compute pace as `head` does.",
    )
    p2p: float = Field(
        default=0.0,
        description="One stage boundary's activation and gradient transfer per micro-batch.",
    )
    grad_sync_intra: float = Field(
        default=0.0,
        description="Data-parallel gradient all-reduce per MB of gradient held by one GPU, when "
        "every member of the shard group is in one node.",
    )
    grad_sync_inter: float = Field(
        default=0.0,
        description="The same when the shard group spans nodes.",
    )
    grad_sync_call_intra: float = Field(
        default=0.0,
        description="Data-parallel gradient sync per all-reduce call (one per distinct holder "
        "set of a GPU's gradients), when every member of the group is in one node.",
    )
    grad_sync_call_inter: float = Field(default=0.0, description="The same across nodes.")
    optimizer: float = Field(
        default=0.0,
        description="Optimizer step per MB of master parameters held by one GPU.",
    )
    fixed: float = Field(default=0.0, description="The rest of a step (once per step).")
    shared_cpus: int | None = Field(
        default=None,
        description="CPUs that every GPU process of the job shares, when one host runs them all "
        "and they outnumber its CPUs (emulation: `malleus run` on a laptop); null = no sharing "
        "(a GPU per process, as on a real cluster). With `measured_active`, the terms that are "
        "host work (every term but layer, embedding and head compute) scale with the plan's "
        "GPUs per CPU: see `contention`.",
    )
    measured_active: int | None = Field(
        default=None,
        description="GPUs serving in the plan the terms were measured under (with "
        "`shared_cpus`); null = no sharing.",
    )

    def contention(self, active: int) -> float:
        """How much slower the host-work terms run with `active` GPUs serving than when they
        were measured: processes beyond the shared CPUs queue for them, so max(1, A/C) /
        max(1, M/C); 1.0 without sharing. Measured on 2 CPUs: TP collectives, the fixed part and
        the gradient-sync calls grow 40-50% from 6 to 8 serving processes, layer compute
        (emulated time) not at all (docs/architecture.md, "Cost model")."""
        return contention(self.shared_cpus, self.measured_active, active)

    def at_contention(self, factor: float) -> Calibration:
        """This calibration with every host-work term multiplied by `factor`."""
        if factor == 1.0:
            return self
        update: dict[str, Any] = {t: getattr(self, t) * factor for t in HOST_TERMS}
        for t in BY_SIZE_TERMS:
            update[t] = {g: v * factor for g, v in getattr(self, t).items()}
        return self.model_copy(update=update)

    def tp_comm_at(self, size: int) -> float:
        """TP collectives per layer per micro-batch of a group of `size` GPUs."""
        return _by_size(self.tp_comm, size)

    def embedding_comm_at(self, size: int) -> float:
        """The embedding's TP collectives per micro-batch of a first stage of `size` GPUs."""
        return _by_size(self.embedding_comm, size)

    def head_comm_at(self, size: int) -> float:
        """The head's TP collectives per micro-batch of a last stage of `size` GPUs."""
        return _by_size(self.head_comm, size)


def _by_size(table: dict[int, float], size: int) -> float:
    """A by-TP-size figure: size 1 costs 0; a size not listed takes the nearest listed one,
    scaled by the ring all-reduce volume (s-1)/s."""
    if size <= 1 or not table:
        return 0.0
    if size in table:
        return float(table[size])
    listed = [s for s in table if s > 1]
    if not listed:
        return 0.0
    near = min(listed, key=lambda s: (abs(math.log2(s / size)), s))
    return float(table[near]) * ((size - 1) / size) / ((near - 1) / near)
