"""The reference 70B setting at any scale, for the planner's tests: `examples/problems/70b.json`
(nodes of 8, tp 8, 80 layers, its alpha and memory model), micro-batches = GPUs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from malleus.planner import PlanningProblem

SETTING = json.loads(
    (Path(__file__).resolve().parents[2] / "examples" / "problems" / "70b.json").read_text()
)
ALPHA_70B: list[float] = SETTING["model"]["alpha"]
MEM_70B: dict[str, Any] = SETTING["memory"]


def problem_70b(world: int, **over: Any) -> PlanningProblem:
    """The setting on `world` GPUs; `over` adds or replaces top-level fields (rates, ...)."""
    data: dict[str, Any] = {
        "nodes": world // 8,
        "gpus_per_node": 8,
        "model": dict(SETTING["model"]),
        "micro_batches": world,
        "memory": MEM_70B,
    }
    data.update(over)
    return PlanningProblem.load(data)
