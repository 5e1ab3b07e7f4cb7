"""`malleus plan PROBLEM.json [-o PLAN.json]`: plan, print a readable summary, write the Plan.

Bad input (a missing file, broken JSON, an invalid or unplannable problem) exits with status 2
and one line per fault, never a traceback: the command is used by people and by scripts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TextIO

from .cost import group_rate, uniform_plan
from .plan import Plan
from .problem import PlanningProblem, ProblemError
from .search import plan

__all__ = ["format_ranks", "plan_main", "summary"]

_MAX_PIPELINES = 32  # beyond this the table shows the first ones and counts the rest


def format_ranks(ranks: list[int]) -> str:
    """Compact rank list: [0, 1, 2, 3, 6] -> '0-3,6'."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _uniform_note(problem: PlanningProblem) -> str:
    dead = [r for r in range(problem.world) if problem.rate(r) is None]
    if dead:
        shown = ", ".join(map(str, dead[:8])) + (" ..." if len(dead) > 8 else "")
        return f"uniform cannot run: rank{'s' if len(dead) > 1 else ''} {shown} unusable"
    if uniform_plan(problem) is None:
        return "uniform cannot run: no static layout (pp dividing groups and layers) fits"
    return "uniform cannot run"


def summary(problem: PlanningProblem, result: Plan) -> str:
    """Human-readable table of the plan and its estimate."""
    e = result.estimate
    lines = [
        f"{problem.nodes} nodes x {problem.gpus_per_node} GPUs, tp {problem.tp}, "
        f"{problem.layers} layers, {problem.micro_batches} micro-batches -> "
        f"{result.dp} pipeline{'s' if result.dp != 1 else ''} (generation {result.generation})",
        "",
        f"{'pipeline':>8} {'micro-b':>7} {'stage':>5}  {'ranks':<24} {'layers':<9} "
        f"{'rate':>6} {'time/mb':>8}",
    ]
    for i, p in enumerate(result.pipelines[:_MAX_PIPELINES]):
        for j, s in enumerate(p.stages):
            y = group_rate(problem, s.ranks)
            lead = f"{i:>8} {p.micro_batches:>7}" if j == 0 else " " * 16
            lines.append(
                f"{lead} {j:>5}  {format_ranks(s.ranks):<24} "
                f"{f'{s.layers[0]}-{s.layers[1]}':<9} {y:>6.2f} {y * s.num_layers:>8.1f}"
            )
    if result.dp > _MAX_PIPELINES:
        lines.append(f"{'':>8} ... and {result.dp - _MAX_PIPELINES} more pipelines")
    lines.append("")
    lines.append(f"excluded ranks: {format_ranks(result.excluded) if result.excluded else 'none'}")
    if e is not None:
        lines.append(f"predicted step time: {e.step_time:.1f} (layer-time units, DESIGN §4.3)")
        if e.uniform_step_time is not None and math.isfinite(e.uniform_step_time):
            lines.append(
                f"uniform layout: {e.uniform_step_time:.1f} -> speedup "
                f"{e.uniform_step_time / e.step_time:.2f}x"
            )
        else:
            lines.append(_uniform_note(problem))
        if e.reference_step_time and math.isfinite(e.reference_step_time):
            lines.append(f"recovery: {e.reference_step_time / e.step_time:.3f} (reference/T)")
        if e.ideal_step_time:
            lines.append(f"efficiency: {e.ideal_step_time / e.step_time:.3f} (ideal/T)")
        unit = "MB" if problem.memory else "layer-shards"
        if problem.previous_plan is not None:
            lines.append(
                f"migration: {e.migration_mb:.0f} {unit} from generation "
                f"{problem.previous_plan.generation}"
            )
        else:
            lines.append("migration: none (no previous plan)")
        if e.planning_seconds is not None:
            lines.append(f"planning: {e.planning_seconds:.2f} s")
    return "\n".join(lines)


def _fail(err: TextIO, faults: list[str]) -> int:
    print("malleus plan: cannot plan:", file=err)
    for f in faults:
        print(f"  {f}", file=err)
    return 2


def plan_main(
    args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Entry of `malleus plan`: 0 on success, 2 on bad input (message, no traceback)."""
    out = out or sys.stdout
    err = err or sys.stderr
    path = Path(args.problem)
    try:
        text = path.read_text()
    except OSError as e:
        return _fail(err, [f"{path}: {e.strerror or e}"])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return _fail(err, [f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"])
    if not isinstance(data, dict):
        return _fail(
            err, [f"{path}: a PlanningProblem is a JSON object, not {type(data).__name__}"]
        )
    try:
        problem = PlanningProblem.load(data)
        result = plan(problem)
    except ProblemError as e:
        return _fail(err, [f"{path}: {f}" for f in e.faults])
    print(summary(problem, result), file=out)
    output = getattr(args, "output", None)
    if output:
        try:
            Path(output).write_text(result.to_json() + "\n")
        except OSError as e:
            return _fail(err, [f"{output}: {e.strerror or e}"])
        print(f"plan written to {output}", file=out)
    else:
        print("(use -o PLAN.json to write the plan)", file=out)
    return 0
