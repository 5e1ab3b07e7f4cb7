"""Calibrations combined: over a window's steps (`median_calibration`) and with the one an
earlier plan measured (`keep_sizes`, `fill_unmeasured`), at the new plan's host contention
(`contention_scale`). Torch-free, like trainer/measure/calibration_terms.py, whose reduction of one
step's samples these take.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from malleus.planner.calibration import BY_SIZE_TERMS, COUNT_TERMS, contention

__all__ = ["contention_scale", "fill_unmeasured", "keep_sizes", "median_calibration"]

_GRAD_TWINS = (
    ("grad_sync_intra", "grad_sync_inter"),
    ("grad_sync_call_intra", "grad_sync_call_inter"),
)
"""Each gradient-sync term inside a node beside its cross-node twin."""


def contention_scale(previous: Mapping[str, Any], now: Mapping[str, Any]) -> float:
    """What a host-work figure measured under `previous`'s sharing costs under `now`'s
    (planner `calibration.contention`): 1.0 when either shares nothing."""
    if not (previous.get("shared_cpus") and now.get("shared_cpus")):
        return 1.0
    return contention(
        now["shared_cpus"], previous.get("measured_active"), now.get("measured_active") or 0
    )


def fill_unmeasured(
    sync: dict[str, float | None],
    trip_ratio: float | None,
    previous: Mapping[str, Any] | None,
    host: Mapping[str, Any],
) -> dict[str, float]:
    """The gradient-sync terms with the unmeasured ones (None) filled: `previous`'s figure (at
    this contention), else the other kind's times `trip_ratio` (cross-node over in-node round
    trip), else 0."""
    scale = contention_scale(previous, host) if previous is not None else 1.0
    by_twin: dict[str, float | None] = {}
    if trip_ratio is not None:
        for intra, inter in _GRAD_TWINS:
            by_twin[intra] = sync[inter] / trip_ratio if sync[inter] is not None else None
            by_twin[inter] = sync[intra] * trip_ratio if sync[intra] is not None else None
    out: dict[str, float] = {}
    for term, v in sync.items():
        if v is None and previous is not None and previous.get(term) is not None:
            v = float(previous[term]) * scale
        if v is None:
            v = by_twin.get(term)
        out[term] = v if v is not None else 0.0
    return out


def median_calibration(
    per_step: Sequence[tuple[dict[str, Any] | None, dict[int, float]]],
) -> tuple[dict[str, Any] | None, dict[int, float]]:
    """Each term's (and each node's link rate's) median over the steps' reductions."""
    cals = [c for c, _ in per_step if c is not None]
    nodes = sorted({n for _, links in per_step for n in links})
    links = {n: statistics.median(lk[n] for _, lk in per_step if n in lk) for n in nodes}
    if not cals:
        return None, links
    out: dict[str, Any] = {}
    for term, value in cals[0].items():
        if term in COUNT_TERMS:  # alike in every step's reduction
            out[term] = cals[-1][term]
        elif isinstance(value, dict):
            sizes = sorted({g for c in cals for g in c[term]})
            out[term] = {
                g: statistics.median(c[term][g] for c in cals if g in c[term]) for g in sizes
            }
        else:
            out[term] = statistics.median(c[term] for c in cals)
    return out, links


def keep_sizes(
    new: dict[str, Any] | None, previous: dict[str, Any] | None
) -> dict[str, Any] | None:
    """`new` with the group sizes only `previous` measured kept: a plan measures the sizes it
    runs (a plan whose last stages are single GPUs measures no head collectives of a pair), and
    the next candidate may use the others again, at the figure measured when they ran rather
    than one scaled from another size (at the new plan's contention, `contention_scale`)."""
    if new is None or previous is None:
        return new
    out = dict(new)
    scale = contention_scale(previous, new)
    for term in BY_SIZE_TERMS:
        kept = {int(g): v * scale for g, v in (previous.get(term) or {}).items()}
        out[term] = {**kept, **{int(g): v for g, v in (new.get(term) or {}).items()}}
    return out
