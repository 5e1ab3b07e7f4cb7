"""The cost model of DESIGN §4.3: the planner's objective and every benchmark's yardstick.

Times are in *layer-time* units: one layer, forward+backward, one micro-batch, on a healthy full
TP group. All functions are pure and cheap; the search calls the stage/pipeline formulas in its
inner loop, so they take plain numbers as well as Plan objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .plan import Pipeline, Plan, Stage
from .problem import PlanningProblem

__all__ = [
    "INF",
    "group_rate",
    "holdings",
    "ideal_step_time",
    "migration_mb",
    "pipeline_time",
    "plan_step_time",
    "reference_step_time",
    "shard_exponent",
    "stage_memory_mb",
    "uniform_plan",
    "uniform_step_time",
]

INF = math.inf


def shard_exponent(tp: int, group_size: int) -> int:
    """k such that group_size == tp / 2^k."""
    return (tp // group_size).bit_length() - 1


def group_rate(problem: PlanningProblem, ranks: Sequence[int]) -> float:
    """y = alpha[k] * slowest member's rate: a TP group runs at its slowest GPU's pace."""
    worst = 1.0
    for r in ranks:
        rate = problem.rate(r)
        if rate is None:
            return INF
        worst = max(worst, rate)
    return problem.model.alpha_at(shard_exponent(problem.tp, len(ranks))) * worst


def pipeline_time(micro_batches: int, stage_costs: Iterable[float]) -> float:
    """1F1B step time of one pipeline: (m - 1) * bottleneck + fill/drain (sum of stages)."""
    costs = list(stage_costs)
    if not costs:
        return INF
    return (micro_batches - 1) * max(costs) + sum(costs)


def _pipeline_step_time(problem: PlanningProblem, p: Pipeline) -> float:
    return pipeline_time(
        p.micro_batches, (group_rate(problem, s.ranks) * s.num_layers for s in p.stages)
    )


def plan_step_time(problem: PlanningProblem, plan: Plan) -> float:
    """T = max over pipelines of the 1F1B time (DP synchronisation is not modelled in v1)."""
    return max((_pipeline_step_time(problem, p) for p in plan.pipelines), default=INF)


def stage_memory_mb(
    problem: PlanningProblem, shards: int, layers: int, stages: int, index: int, micro_batches: int
) -> float:
    """Memory of one GPU of stage `index` (of `stages`), holding `shards` = 2^k logical shards."""
    mem = problem.memory
    if mem is None:
        return 0.0
    in_flight = min(stages - index, micro_batches)
    ends = int(index == 0) + int(index == stages - 1)  # embedding and head: both if S == 1
    per_shard = (
        mem.layer_mb * layers + mem.activation_mb * layers * in_flight + mem.embedding_mb * ends
    )
    return shards * per_shard + mem.fixed_mb


def _uniform_pp(problem: PlanningProblem) -> int | None:
    """Smallest pp a static framework would pick on a healthy cluster (None: none fits)."""
    groups = problem.world // problem.tp
    L, B = problem.layers, problem.micro_batches
    for pp in range(1, groups + 1):
        if groups % pp or L % pp:
            continue
        dp = groups // pp
        if problem.dp is not None and dp != problem.dp:
            continue
        if B % dp:
            continue
        m = B // dp
        cap = problem.memory.capacity_mb if problem.memory else INF
        if all(stage_memory_mb(problem, 1, L // pp, pp, j, m) <= cap for j in range(pp)):
            return pp
    return None


def uniform_plan(problem: PlanningProblem) -> Plan | None:
    """The static (Megatron-LM style) layout: dp pipelines of pp full groups in rank order.

    Rates are ignored: this is what a framework that does not know of stragglers runs.
    """
    pp = _uniform_pp(problem)
    if pp is None:
        return None
    tp, groups = problem.tp, problem.world // problem.tp
    dp = groups // pp
    per = problem.layers // pp
    pipelines = []
    for i in range(dp):
        stages = []
        for j in range(pp):
            g = i * pp + j
            stages.append(
                Stage(ranks=list(range(g * tp, (g + 1) * tp)), layers=(j * per, (j + 1) * per))
            )
        pipelines.append(Pipeline(micro_batches=problem.micro_batches // dp, stages=stages))
    return Plan(tp=tp, pipelines=pipelines)


def uniform_step_time(problem: PlanningProblem) -> float:
    """Step time of the static layout under the current rates (INF if it cannot run)."""
    plan = uniform_plan(problem)
    return INF if plan is None else plan_step_time(problem, plan)


def ideal_step_time(problem: PlanningProblem) -> float:
    """Physical limit: every usable GPU busy, no bubble, at its own speed."""
    speed = sum(1.0 / (problem.tp * r) for x in problem.usable_ranks() if (r := problem.rate(x)))
    return problem.micro_batches * problem.layers / speed


def reference_step_time(problem: PlanningProblem) -> float:
    """Healthy uniform step time scaled by the capacity the stragglers took (DESIGN §4.3)."""
    healthy = problem.model_copy(update={"rates": {}})
    base = uniform_step_time(healthy)
    capacity = sum(1.0 / r for x in problem.usable_ranks() if (r := problem.rate(x)))
    return base * problem.world / capacity


Unit = tuple[str, int, int]  # (kind: "layer" | "emb" | "head", layer index or 0, logical shard)


def holdings(plan: Plan) -> dict[int, set[Unit]]:
    """The state units each rank holds under a plan: (layer, shard) plus embedding/head shards."""
    held: dict[int, set[Unit]] = {}
    for p in plan.pipelines:
        last = len(p.stages) - 1
        for j, s in enumerate(p.stages):
            for idx, rank in enumerate(s.ranks):
                units = held.setdefault(rank, set())
                for shard in s.shards_of(idx, plan.tp):
                    units.update(("layer", layer, shard) for layer in range(*s.layers))
                    if j == 0:
                        units.add(("emb", 0, shard))
                    if j == last:
                        units.add(("head", 0, shard))
    return held


def migration_mb(problem: PlanningProblem, old: Plan | None, new: Plan) -> float:
    """State that must move to go from `old` to `new`: every unit a rank needs and lacks.

    In MB when the problem has a memory model, else in layer-shard units. A unit a rank already
    holds moves nothing; a unit needed by two new holders is sent twice.
    """
    if old is None:
        return 0.0
    mem = problem.memory
    layer_mb = mem.layer_mb if mem else 1.0
    emb_mb = mem.embedding_mb if mem else 0.0
    before = holdings(old)
    total = 0.0
    for rank, units in holdings(new).items():
        for kind, _, _ in units - before.get(rank, set()):
            total += layer_mb if kind == "layer" else emb_mb
    return total
