"""Memory and model state: what a GPU holds under a plan, and what a plan change moves.

The cost model's space side, apart from its time side (cost.py): a stage's per-GPU memory
(`stage_memory_mb`, the bound validation and the layer caps check), the size of the gradient
and master-parameter shards a GPU syncs and steps (`unit_mb`, `held_mb`), and the state units
each rank holds (`holdings`) from which `migration_mb` counts what must move between plans.
"""

from __future__ import annotations

from collections import defaultdict

from .plan import Plan
from .problem import PlanningProblem

__all__ = ["Unit", "held_mb", "holdings", "migration_mb", "stage_memory_mb", "unit_mb"]


def unit_mb(problem: PlanningProblem) -> tuple[float, float]:
    """(MB of gradient / master parameters per layer shard, per embedding or head shard).

    `layer_mb` counts parameters, gradients and two Adam moments at 16 bytes per parameter, so
    a shard's fp32 gradient (and its fp32 master copy) is a quarter of it. Without a memory
    model: one MB per layer shard, nothing for the embedding and head.
    """
    mem = problem.memory
    if mem is None:
        return 1.0, 0.0
    return mem.layer_mb / 4.0, mem.embedding_mb / 4.0


def held_mb(problem: PlanningProblem, plan: Plan) -> dict[int, float]:
    unit, emb = unit_mb(problem)
    held: dict[int, float] = defaultdict(float)
    for p in plan.pipelines:
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            mb = s.shards_per_gpu(plan.tp) * (
                s.num_layers * unit + (int(j == 0) + int(j == S - 1)) * emb
            )
            for r in s.ranks:
                held[r] += mb
    return held


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
