"""The planner's half of `malleus plan`: `--rates` what-ifs, a readable table, the Plan file.

`malleus plan` (in `malleus/cli.py`) reads the file, since a MalleusJob manifest needs the job
package, which the planner may not import; everything that needs only the planner is here.
Bad input raises `BadInput` naming the field or the option (`rates.3`, `--rates`, `--output`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, TextIO

from malleus.errors import BadInput
from malleus.notation import layer_range, rank_list, rate, size_mib, speedup

from .cost import stage_costs, step_time_terms, uniform_plan
from .plan import Plan
from .problem import PlanningProblem

__all__ = [
    "check_ranks",
    "format_ranks",
    "load_problem",
    "parse_rates",
    "show_plan",
    "summary",
    "with_rates",
]

_MAX_PIPELINES = 32  # beyond this the table shows the first ones and counts the rest
_UNUSABLE = ("failed", "null")


def format_ranks(ranks: list[int]) -> str:
    """Compact rank list: [0, 1, 2, 3, 6] -> '0-3,6' (`malleus.notation.rank_list`)."""
    return rank_list(ranks) if ranks else ""


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
        f"{'shards':>6} {'rate':>6} {'time/mb':>8}",
    ]
    for i, p in enumerate(result.pipelines[:_MAX_PIPELINES]):
        costs = stage_costs(problem, p)
        for j, s in enumerate(p.stages):
            lead = f"{i:>8} {p.micro_batches:>7}" if j == 0 else " " * 16
            # the GPUs' own rate (the slowest of the group's), not the group's pace: a healthy
            # GPU holding every shard of its layers alone is 1.00 with `shards` = tp
            slowest = max((problem.rate(r) or 1.0) for r in s.ranks)
            lines.append(
                f"{lead} {j:>5}  {format_ranks(s.ranks):<24} {layer_range(s.layers):<9} "
                f"{s.shards_per_gpu(problem.tp):>6} {rate(slowest):>6} {costs[j]:>8.1f}"
            )
    if result.dp > _MAX_PIPELINES:
        lines.append(f"{'':>8} ... and {result.dp - _MAX_PIPELINES} more pipelines")
    failed = [r for r in range(problem.world) if problem.rate(r) is None]
    lines.append("")
    lines.append(f"excluded ranks: {format_ranks(result.excluded) if result.excluded else 'none'}")
    if failed:
        lines.append(f"failed ranks: {format_ranks(failed)} (unusable: in no stage)")
    lines.append(
        "(layers inclusive; shards: logical TP shards per GPU; rate: the slowest GPU's "
        "straggling rate; time/mb: the stage's time per micro-batch)"
    )
    if e is not None:
        lines.append(f"predicted step time: {e.step_time:.1f} (layer-time units)")
        lines.extend(_terms(problem, result))
        if e.uniform_step_time is not None and math.isfinite(e.uniform_step_time):
            lines.append(
                f"uniform layout: {e.uniform_step_time:.1f} -> speedup "
                f"{speedup(e.uniform_step_time / e.step_time)}"
            )
        else:
            lines.append(_uniform_note(problem))
        if e.reference_step_time and math.isfinite(e.reference_step_time):
            lines.append(f"recovery: {e.reference_step_time / e.step_time:.3f} (reference/T)")
        if e.ideal_step_time:
            lines.append(f"efficiency: {e.ideal_step_time / e.step_time:.3f} (ideal/T)")
        moved = size_mib(e.migration_mb) if problem.memory else f"{e.migration_mb:.0f} layer-shards"
        if problem.previous_plan is not None:
            lines.append(f"migration: {moved} from generation {problem.previous_plan.generation}")
        else:
            lines.append("migration: none (no previous plan)")
        if e.planning_seconds is not None:
            lines.append(f"planning: {e.planning_seconds:.2f} s")
    return "\n".join(lines)


def _terms(problem: PlanningProblem, result: Plan) -> list[str]:
    """The calibrated model's terms of the step time, in seconds when the unit is known."""
    cal = problem.calibration
    if cal is None:
        return []
    t = step_time_terms(problem, result)
    sec = cal.layer_seconds

    def show(v: float) -> str:
        return f"{v:.1f} ({v * sec:.3f} s)"

    per = ", ".join(f"{k} {v:.2f}" for k, v in t.stages.items() if v)
    lines = [
        f"  step time {show(t.total)} = pipeline {show(t.pipeline)} + gradient sync "
        f"{show(t.grad_sync)} + optimizer {show(t.optimizer)} + fixed {show(t.fixed)}",
        f"  slowest pipeline {t.critical}, per micro-batch through its stages: {per or 'none'}",
    ]
    slow = {n: v for n, v in sorted(problem.link_rates.items()) if v != 1.0}
    if slow:
        lines.append("  slow links: " + ", ".join(f"node {n} x{v:g}" for n, v in slow.items()))
    return lines


def parse_rates(text: str) -> dict[int, float | None]:
    """``3=2.5,17=failed`` -> ``{3: 2.5, 17: None}``: what-if rates, `failed`/`null` unusable.

    Every malformed entry is a fault on ``--rates`` (a rate is a slowdown: at least 1.0).
    """
    rates: dict[int, float | None] = {}
    faults: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if entry.count("=") > 1:  # entries run together: 3=2.5;17=failed
            between = re.search(r"=[\w.+\-]*([^\w.+=\-]+)", entry)
            found = between.group(1) if between else ""
            said = ", not a space" if found.isspace() else f", not {found.strip()!r}"
            faults.append(
                f"{entry!r}: separate the entries with commas{said if found else ''}: "
                "e.g. 3=2.5,17=failed"
            )
            continue
        rank_text, sep, rate_text = entry.partition("=")
        try:
            rank = int(rank_text)
            if not sep or rank < 0:
                raise ValueError
        except ValueError:
            faults.append(f"{entry!r}: expected RANK=RATE, e.g. 3=2.5 or 17=failed")
            continue
        if rate_text.strip().lower() in _UNUSABLE:
            rates[rank] = None
            continue
        try:
            rate = float(rate_text)
        except ValueError:
            rate = math.nan
        if not (math.isfinite(rate) and rate >= 1.0):
            faults.append(f"{entry!r}: a rate is a slowdown >= 1.0, or failed")
        else:
            rates[rank] = rate
    if faults:
        raise BadInput.one("--rates", "; ".join(faults), what="arguments")
    return rates


def check_ranks(rates: dict[int, float | None], world: int) -> None:
    """`BadInput` on ``--rates`` naming ranks a job of `world` GPUs does not have."""
    outside = sorted(r for r in rates if r >= world)
    if outside:
        raise BadInput.one(
            "--rates",
            f"rank{'s' if len(outside) > 1 else ''} {format_ranks(outside)} beyond the "
            f"{world} GPUs (ranks 0-{world - 1})",
            what="arguments",
        )


def with_rates(problem: PlanningProblem, rates: dict[int, float | None]) -> PlanningProblem:
    """`problem` with `rates` laid over its own, validated again (an all-failed cluster, say)."""
    if not rates:
        return problem
    return PlanningProblem.load({**dict(problem), "rates": {**problem.rates, **rates}})


def load_problem(
    data: str | dict[str, Any], source: str, rates: dict[int, float | None] | None = None
) -> PlanningProblem:
    """A PlanningProblem from JSON text or a mapping, with what-if `rates` (ranks checked on
    ``--rates``); faults of the problem name `source`."""
    try:
        problem = PlanningProblem.load(data)
    except BadInput as error:
        raise BadInput(error.faults, source, what=error.what) from None
    check_ranks(rates or {}, problem.world)
    try:
        return with_rates(problem, rates or {})
    except BadInput as error:
        raise BadInput(error.faults, source, what=error.what) from None


def show_plan(problem: PlanningProblem, result: Plan, output: str | None, out: TextIO) -> None:
    """Print the table; write the Plan JSON to `output` (`BadInput` on ``--output`` if it fails)."""
    print(summary(problem, result), file=out)
    if not output:
        print("(use -o PLAN.json to write the plan)", file=out)
        return
    try:
        Path(output).write_text(result.to_json() + "\n")
    except OSError as error:
        raise BadInput.one(
            "--output", f"{output}: {error.strerror or error}", what="arguments"
        ) from None
    print(f"plan written to {output}", file=out)
