"""Candidates that keep the plan in force: the cheapest moves are often no move at all.

Re-splitting micro-batches moves no state; re-splitting layers along the same stages moves only
the layers that cross a boundary. When the rates shift a little, one of these is usually within
1% of the best layout and wins on migration.
"""

from __future__ import annotations

from ..cost import stage_costs
from ..memory import stage_memory_mb
from ..pace import group_pace, position_extras
from ..plan import Pipeline, Plan, Stage
from ..problem import PlanningProblem
from ..schedule import pipeline_time
from .evaluate import Evaluator
from .layers import layer_caps
from .layersplit import split_layers
from .microbatch import greedy_split

__all__ = ["previous_variants"]


def _usable(problem: PlanningProblem, prev: Plan) -> bool:
    if prev.tp != problem.tp:
        return False
    for _, _, s in prev.stages():
        if not s.ranks or any(
            not 0 <= r < problem.world or problem.rate(r) is None for r in s.ranks
        ):
            return False
    return all(p.stages and p.stages[-1].layers[1] == problem.layers for p in prev.pipelines)


def _with_micro_batches(problem: PlanningProblem, pipes: list[list[Stage]]) -> Plan | None:
    """Split micro-batches over fixed pipelines (memory checked at every m)."""
    cap = problem.memory.capacity_mb if problem.memory else None

    def time_of(stages: list[Stage]):
        cs = stage_costs(problem, Pipeline(micro_batches=1, stages=stages))
        S = len(stages)

        def t(m: int) -> float:
            if cap is not None:
                for j, s in enumerate(stages):
                    need = stage_memory_mb(
                        problem, problem.tp // len(s.ranks), s.num_layers, S, j, m
                    )
                    if need > cap + 1e-9:
                        return float("inf")
            return pipeline_time(m, cs)

        return t

    res = greedy_split([time_of(st) for st in pipes], [1] * len(pipes), problem.micro_batches)
    if res is None or res[0] == float("inf"):
        return None
    _, splits = res
    pipelines = [
        Pipeline(micro_batches=m + up, stages=st) for st, (m, up) in zip(pipes, splits, strict=True)
    ]
    used = {r for st in pipes for s in st for r in s.ranks}
    excluded = [r for r in problem.usable_ranks() if r not in used]
    return Plan(tp=problem.tp, pipelines=pipelines, excluded=excluded)


def _resplit(problem: PlanningProblem, stages: list[Stage]) -> list[Stage] | None:
    ks = [(problem.tp // len(s.ranks)).bit_length() - 1 for s in stages]
    ys = [group_pace(problem, s.ranks) for s in stages]
    links = [max(problem.link_rate(problem.node_of(r)) for r in s.ranks) for s in stages]
    es = position_extras(problem, ys, links, [len(s.ranks) for s in stages])
    res = split_layers(ys, layer_caps(problem, ks, None), problem.layers, None, es)
    if res is None:
        return None
    out, start = [], 0
    for s, n in zip(stages, res[0], strict=True):
        out.append(Stage(ranks=list(s.ranks), layers=(start, start + n)))
        start += n
    return out


def previous_variants(problem: PlanningProblem, ev: Evaluator) -> list[Plan]:
    """The previous plan with micro-batches re-split, and with layers re-split too."""
    prev = problem.previous_plan
    if prev is None or not _usable(problem, prev):
        return []
    if problem.dp is not None and prev.dp != problem.dp:
        return []
    out = []
    same = _with_micro_batches(problem, [list(p.stages) for p in prev.pipelines])
    if same is not None:
        out.append(same)
    resplit = [_resplit(problem, list(p.stages)) for p in prev.pipelines]
    if all(r is not None for r in resplit):
        moved = _with_micro_batches(problem, [r for r in resplit if r is not None])
        if moved is not None:
            out.append(moved)
    del ev
    return out
