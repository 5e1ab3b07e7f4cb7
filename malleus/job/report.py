"""The run report's shared parts: its per-step rows, per-generation segments and JSON writing.

`malleus run` (malleus/runner/report/) and `malleus train --report` (trainer/run/report.py) write
the same JSON report, so that one script reads either; the parts both need live here, since the
trainer may not import the runner. Torch-free.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["generation_segments", "step_row", "write_json"]


def step_row(
    step: int,
    *,
    time: float | None,
    seconds: float | None,
    tokens_per_second: float | None,
    loss: float | None,
    generation: int,
    rates: Mapping[int, float | None],
) -> dict[str, Any]:
    """One `per_step` record. `step` is 0-based (like the emulation schedule), `time` seconds
    since the run started when the step was done, `generation` the plan it ran under."""
    return {
        "step": step,
        "time": time,
        "seconds": seconds,
        "tokens_per_second": tokens_per_second,
        "loss": loss,
        "generation": generation,
        "rates": {str(r): v for r, v in sorted(rates.items())},
    }


def generation_segments(rows: Sequence[Mapping[str, Any]], tokens_per_step: int) -> list[dict]:
    """Per plan generation: its steps, mean tokens/s (tokens over summed step time), median step."""
    by_gen: dict[int, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_gen.setdefault(int(row["generation"]), []).append(row)
    out = []
    for gen, steps in sorted(by_gen.items()):
        secs = [r["seconds"] for r in steps if r.get("seconds")]
        out.append(
            {
                "generation": gen,
                "first_step": min(r["step"] for r in steps),
                "last_step": max(r["step"] for r in steps),
                "steps": len(steps),
                "mean_tokens_per_second": tokens_per_step * len(secs) / sum(secs) if secs else None,
                "median_step_seconds": statistics.median(secs) if secs else None,
            }
        )
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(obj: Any, path: str | Path) -> Path:
    """Strict JSON (no NaN or Infinity: null instead), the parent folder made if missing."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(obj), indent=1, allow_nan=False) + "\n")
    return out
