"""Straggling rates as input, not truth: the one place measured figures are bounded.

Rates come from trainers' `/metrics`, from Prometheus, or from a person (`malleus plan --rates`);
before the controller smooths them or the planner sees them they are cut to the job's ranks,
made finite (NaN or infinity: unusable) and capped at `MAX_RATE`, since a figure of 1e307
overflows the cost model and means nothing a GPU can do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from malleus.planner.problem import MAX_RATE

__all__ = ["bounded_rates", "clean_rates"]


def bounded_rates(rates: Mapping[int, float | None], world: int) -> dict[int, float | None]:
    """Rates fit to smooth: ranks of the job only, at most `MAX_RATE`, None when not finite.

    A figure of zero or below means nothing (no sample) and is dropped; below 1.0 is kept, since
    a GPU a little faster than the reference is what a recovered one looks like.
    """
    out: dict[int, float | None] = {}
    for rank, rate in rates.items():
        if not 0 <= rank < world:
            continue
        if rate is None or not math.isfinite(rate):
            out[rank] = None
        elif rate > 0:
            out[rank] = min(float(rate), MAX_RATE)
    return out


def clean_rates(rates: Mapping[int, float | None], world: int) -> dict[int, float | None]:
    """Rates the planner takes: `bounded_rates`, with healthy figures (<= 1.0) left out (a rank
    absent from a PlanningProblem's rates is healthy)."""
    return {
        rank: rate
        for rank, rate in bounded_rates(rates, world).items()
        if rate is None or rate > 1.0
    }
