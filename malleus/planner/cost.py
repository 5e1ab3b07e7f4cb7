"""The cost model (calibrated: docs/architecture.md "Cost model"): the planner's
objective and every benchmark's yardstick.

Times are in *layer-time* units: one layer, forward+backward, one micro-batch, on a healthy full
TP group; `Calibration.layer_seconds` converts them to seconds. Without a calibration a stage
costs its layer compute only (the model before calibration); with one it also pays its TP
collectives, the embedding or head at the pipeline's ends, the activation transfer to the next
stage, and the step pays gradient sync, the optimizer and a fixed part. A pipeline's time is the
exact makespan of the 1F1B schedule over its stage costs (`pipeline_time`). All functions are
pure; the search calls the numeric ones (`pace`, `position_extras`, `pipeline_time`) in its inner
loop.

The model lives in four modules: schedule.py (the 1F1B makespan from stage costs), pace.py (a
group's pace and a position's extras), memory.py (per-GPU memory, held state and migration),
and this one: a plan's stage costs and step-time terms (gradient sync, optimizer, fixed), and
the yardsticks (uniform, ideal and reference step times). This module also exports the others'
public names, the cost model's one import path for the controller, runner, trainer and benches.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from .memory import held_mb, holdings, migration_mb, stage_memory_mb, unit_mb
from .pace import (
    group_link,
    group_pace,
    group_rate,
    healthy_pace,
    pace,
    position_extras,
    shard_exponent,
)
from .plan import Pipeline, Plan, Stage
from .problem import PlanningProblem
from .schedule import (
    EXACT_MICRO_BATCHES,
    INF,
    pipeline_time,
    pipeline_time_lower,
    pipeline_time_upto,
)

__all__ = [
    "EXACT_MICRO_BATCHES",
    "INF",
    "StepTerms",
    "at_plan_contention",
    "grad_sync_by_gpu",
    "group_pace",
    "group_rate",
    "healthy_pace",
    "holdings",
    "ideal_step_time",
    "migration_mb",
    "pace",
    "pipeline_time",
    "pipeline_time_lower",
    "pipeline_time_upto",
    "plan_step_time",
    "position_extras",
    "reference_step_time",
    "shard_exponent",
    "stage_costs",
    "stage_memory_mb",
    "step_time_terms",
    "uniform_plan",
    "uniform_step_time",
    "unit_mb",
]


@dataclass(frozen=True)
class _StageParts:
    layers: float
    tp_comm: float
    embedding: float
    head: float
    p2p: float

    @property
    def total(self) -> float:
        return self.layers + self.tp_comm + self.embedding + self.head + self.p2p


def _stage_parts(problem: PlanningProblem, p: Pipeline) -> list[_StageParts]:
    cal = problem.calibration
    S = len(p.stages)
    ys = [group_rate(problem, s.ranks) for s in p.stages]
    if cal is None:
        return [
            _StageParts(y * s.num_layers, 0.0, 0.0, 0.0, 0.0)
            for y, s in zip(ys, p.stages, strict=True)
        ]
    links = [group_link(problem, s.ranks) for s in p.stages]
    comms = [cal.tp_comm_at(len(s.ranks)) * lk for s, lk in zip(p.stages, links, strict=True)]
    paces = [y + c for y, c in zip(ys, comms, strict=True)]
    y0 = healthy_pace(problem)
    out = []
    for j, s in enumerate(p.stages):
        out.append(
            _StageParts(
                ys[j] * s.num_layers,
                comms[j] * s.num_layers,
                cal.embedding * paces[j] / y0 + cal.embedding_comm_at(len(s.ranks)) * links[j]
                if j == 0
                else 0.0,
                cal.head * paces[j] / y0 + cal.head_comm_at(len(s.ranks)) * links[j]
                if j == S - 1
                else 0.0,
                cal.p2p * max(links[j], links[j + 1]) if j < S - 1 else 0.0,
            )
        )
    return out


def stage_costs(problem: PlanningProblem, p: Pipeline) -> list[float]:
    """c_j: time per micro-batch (forward+backward) of every stage of a pipeline."""
    return [x.total for x in _stage_parts(problem, p)]


def _pipeline_step_time(problem: PlanningProblem, p: Pipeline) -> float:
    return pipeline_time(p.micro_batches, stage_costs(problem, p))


def _grad_sync(problem: PlanningProblem, plan: Plan) -> float:
    """Data-parallel gradient sync: the slowest GPU's (`grad_sync_by_gpu`); the step waits."""
    return max(grad_sync_by_gpu(problem, plan).values(), default=0.0)


def grad_sync_by_gpu(problem: PlanningProblem, plan: Plan) -> dict[int, float]:
    """Each GPU's data-parallel gradient sync (layer-time units; empty when there is none).

    Every (layer, shard) is all-reduced among the GPUs that hold it, one per pipeline: per MB
    held at the intra- or inter-node figure, plus one per-call figure for every all-reduce the
    trainer issues, all times the slowest link among the group's nodes. The trainer issues one
    all-reduce per distinct holder set of a GPU's pieces (trainer/parallel/layout.py `_buckets`).
    The plan's stage cuts split the layers into segments held by the same stage of every
    pipeline (a "column"); in a column, a sharded piece's holder set is fixed by which GPU of
    each stage holds its shard, so a GPU holding 2^k shards meets 2^k / 2^k_min sets, 2^k_min
    the fewest shards per GPU in the column (shard counts are powers of two: a finer stage's
    split refines a coarser one's); the replicated RMSNorm weights are held by every GPU of the
    column's stages, one more set unless every stage there is a single GPU (then it is the
    shard set). The embedding and head share the first and last column's sets (untied: a tied
    embedding, or K/V replicated over fewer kv heads than tp, add sets the problem does not
    describe). A column's stages each lie in one node, so all its sets span the same nodes.
    """
    cal = problem.calibration
    if cal is None or plan.dp < 2:
        return {}
    per_mb = (cal.grad_sync_intra, cal.grad_sync_inter)
    per_call = (cal.grad_sync_call_intra, cal.grad_sync_call_inter)
    if not (any(per_mb) or any(per_call)):
        return {}
    unit, emb = unit_mb(problem)
    tp = plan.tp
    cuts = sorted({0, problem.layers, *(x for _, _, s in plan.stages() for x in s.layers)})
    where = []  # per pipeline: the stage holding each layer segment
    for p in plan.pipelines:
        row, j = [], 0
        for a in cuts[:-1]:
            while j < len(p.stages) - 1 and p.stages[j].layers[1] <= a:
                j += 1
            row.append(p.stages[j])
        where.append(row)
    last = len(cuts) - 2
    tally: dict[int, float] = defaultdict(float)
    for seg, (a, b) in enumerate(itertools.pairwise(cuts)):
        column = [row[seg] for row in where]
        nodes = {problem.node_of(s.ranks[0]) for s in column}
        inter = int(len(nodes) > 1)
        link = max(problem.link_rate(n) for n in nodes)
        mb = (b - a) * unit + emb * ((seg == 0) + (seg == last))  # per shard held
        spgs = [s.shards_per_gpu(tp) for s in column]
        finest = min(spgs)
        norms = int(finest < tp)
        for s, spg in zip(column, spgs, strict=True):
            calls = spg // finest + norms
            cost = (spg * mb * per_mb[inter] + calls * per_call[inter]) * link
            for r in s.ranks:
                tally[r] += cost
    return dict(tally)


@dataclass(frozen=True)
class StepTerms:
    """The terms of a plan's step time (layer-time units; `seconds()` converts).

    total = pipeline + grad_sync + optimizer + fixed. `pipeline` is the slowest pipeline's 1F1B
    makespan (bubble included); `stages` splits that pipeline's sum of stage costs per
    micro-batch into layers, tp_comm, embedding, head and p2p.
    """

    pipeline: float
    grad_sync: float = 0.0
    optimizer: float = 0.0
    fixed: float = 0.0
    critical: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    layer_seconds: float | None = None

    @property
    def total(self) -> float:
        return self.pipeline + self.grad_sync + self.optimizer + self.fixed

    def as_dict(self) -> dict[str, float]:
        """Every term by name (layer-time units), total last."""
        out = {"pipeline": self.pipeline}
        out.update({f"per_micro_batch.{k}": v for k, v in self.stages.items()})
        out.update(grad_sync=self.grad_sync, optimizer=self.optimizer, fixed=self.fixed)
        out["total"] = self.total
        return out

    def seconds(self) -> dict[str, float] | None:
        """The same in seconds, when the calibration says what a layer-time unit is."""
        if self.layer_seconds is None:
            return None
        return {k: v * self.layer_seconds for k, v in self.as_dict().items()}


def at_plan_contention(problem: PlanningProblem, plan: Plan) -> PlanningProblem:
    """`problem` with its calibration's host-work terms at `plan`'s contention (its serving
    GPUs against the CPUs they share, `Calibration.contention`); itself when nothing is shared.

    Applied here, for whole plans only: the search's inner loop prices candidates at the
    measured contention, and its final choice (`plan_step_time`) at their own."""
    cal = problem.calibration
    if cal is None or cal.shared_cpus is None:
        return problem
    factor = cal.contention(len(plan.active_ranks()))
    if factor == 1.0:
        return problem
    return problem.model_copy(update={"calibration": cal.at_contention(factor)})


def step_time_terms(problem: PlanningProblem, plan: Plan) -> StepTerms:
    """Each term of the step time of `plan` (docs/architecture.md, "Cost model")."""
    problem = at_plan_contention(problem, plan)
    times = [_pipeline_step_time(problem, p) for p in plan.pipelines]
    if not times:
        return StepTerms(INF)
    crit = max(range(len(times)), key=lambda i: times[i])
    cal = problem.calibration
    if cal is None:
        return StepTerms(times[crit], critical=crit)
    parts = _stage_parts(problem, plan.pipelines[crit])
    stages = {
        name: sum(getattr(x, name) for x in parts)
        for name in ("layers", "tp_comm", "embedding", "head", "p2p")
    }
    held = held_mb(problem, plan)
    return StepTerms(
        pipeline=times[crit],
        grad_sync=_grad_sync(problem, plan),
        optimizer=cal.optimizer * max(held.values(), default=0.0),
        fixed=cal.fixed,
        critical=crit,
        stages=stages,
        layer_seconds=cal.layer_seconds,
    )


def plan_step_time(problem: PlanningProblem, plan: Plan) -> float:
    """T = max over pipelines of the 1F1B time, plus (calibrated) gradient sync, optimizer and
    the fixed part of a step."""
    if problem.calibration is None:
        return max((_pipeline_step_time(problem, p) for p in plan.pipelines), default=INF)
    return step_time_terms(problem, plan).total


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
    """Physical limit: every usable GPU busy, no bubble, at its own speed (calibrated: each
    micro-batch also pays a healthy full group's TP collectives, embedding and head, and the
    step its fixed part)."""
    speed = sum(1.0 / (problem.tp * r) for x in problem.usable_ranks() if (r := problem.rate(x)))
    cal = problem.calibration
    if cal is None:
        return problem.micro_batches * problem.layers / speed
    work = problem.layers * healthy_pace(problem) / problem.model.alpha_at(0)
    ends = (
        cal.embedding + cal.head + cal.embedding_comm_at(problem.tp) + cal.head_comm_at(problem.tp)
    )
    return problem.micro_batches * (work + ends) / speed + cal.fixed


def reference_step_time(problem: PlanningProblem) -> float:
    """Healthy uniform step time scaled by the capacity the stragglers took."""
    healthy = problem.model_copy(update={"rates": {}, "link_rates": {}})
    base = uniform_step_time(healthy)
    capacity = sum(1.0 / r for x in problem.usable_ranks() if (r := problem.rate(x)))
    return base * problem.world / capacity
