"""From an abstract layout to a Plan with ranks: which concrete group fills which stage.

Groups of one class are interchangeable for time, not for migration: a group that stays where
it was moves nothing. With a previous plan, every group is described by what its GPUs hold
(layer range, shard range, embedding/head) and every stage slot by what it needs; a greedy
transportation over (signature x slot type) pairs, cheapest first, keeps groups in place. Groups
with identical holdings share one signature, so 4096 GPUs cost a few hundred pairs, not 10^5.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from ..plan import Pipeline, Plan, Stage
from ..problem import PlanningProblem
from .evaluate import Evaluator, Scored
from .grouping import Grouping
from .layers import Cls, PipeSolution
from .nodegroups import Group

__all__ = ["Holding", "materialize", "previous_holdings"]


@dataclass(frozen=True)
class Holding:
    """What one GPU holds under a plan: layers [a, b), shards [lo, hi), embedding, head."""

    a: int
    b: int
    lo: int
    hi: int
    emb: bool
    head: bool


def previous_holdings(plan: Plan | None) -> dict[int, Holding]:
    if plan is None:
        return {}
    out: dict[int, Holding] = {}
    for p in plan.pipelines:
        last = len(p.stages) - 1
        for j, s in enumerate(p.stages):
            n = s.shards_per_gpu(plan.tp)
            for idx, r in enumerate(s.ranks):
                out[r] = Holding(
                    s.layers[0], s.layers[1], idx * n, (idx + 1) * n, j == 0, j == last
                )
    return out


@dataclass(frozen=True)
class _Slot:
    cls: Cls
    a: int
    b: int
    first: bool
    last: bool


def _missing(problem: PlanningProblem, held: Holding | None, need: Holding) -> float:
    """MB a GPU must receive to hold `need` when it holds `held` now."""
    mem = problem.memory
    layer_mb = mem.layer_mb if mem else 1.0
    emb_mb = mem.embedding_mb if mem else 0.0
    shards = need.hi - need.lo
    so = lo_ = 0
    if held is not None:
        so = max(0, min(need.hi, held.hi) - max(need.lo, held.lo))
        lo_ = max(0, min(need.b, held.b) - max(need.a, held.a))
    units = (need.b - need.a) * shards - lo_ * so
    ends = 0
    if need.emb:
        ends += shards - (so if held is not None and held.emb else 0)
    if need.head:
        ends += shards - (so if held is not None and held.head else 0)
    return units * layer_mb + ends * emb_mb


def _ordered(group: Group, prev: dict[int, Holding]) -> Group:
    """Shard order of a group: as before if it existed, else by the shards its GPUs held."""
    if not prev:
        return group
    ranks = tuple(sorted(group.ranks, key=lambda r: (prev[r].lo if r in prev else 1 << 30, r)))
    return Group(ranks, group.node, group.k, group.y, group.link)


def _cost(problem: PlanningProblem, g: Group, slot: _Slot, prev: dict[int, Holding]) -> float:
    n = problem.tp // len(g.ranks)
    return sum(
        _missing(
            problem,
            prev.get(r),
            Holding(slot.a, slot.b, i * n, (i + 1) * n, slot.first, slot.last),
        )
        for i, r in enumerate(g.ranks)
    )


def _assign(
    problem: PlanningProblem,
    groups: list[Group],
    slots: list[_Slot],
    prev: dict[int, Holding],
) -> list[Group]:
    """One group per slot (all slots share one class), cheapest migration first."""
    if not prev:
        return sorted(groups, key=lambda g: g.ranks)[: len(slots)]
    by_sig: dict[tuple[object, ...], deque[Group]] = defaultdict(deque)
    for g in sorted(groups, key=lambda g: g.ranks):
        by_sig[tuple(prev.get(r) for r in g.ranks)].append(g)
    by_type: dict[_Slot, deque[int]] = defaultdict(deque)
    for i, s in enumerate(slots):
        by_type[s].append(i)
    pairs = []
    for sig, gs in by_sig.items():
        for t in by_type:
            pairs.append((_cost(problem, gs[0], t, prev), len(pairs), sig, t))
    pairs.sort(key=lambda x: (x[0], x[1]))
    out: list[Group | None] = [None] * len(slots)
    for _, _, sig, t in pairs:
        gs, idx = by_sig[sig], by_type[t]
        while gs and idx:
            out[idx.popleft()] = gs.popleft()
    assert all(g is not None for g in out)
    return [g for g in out if g is not None]


def materialize(
    problem: PlanningProblem, ev: Evaluator, scored: Scored, grouping: Grouping
) -> Plan:
    """Concrete Plan for a scored layout and the grouping its classes came from."""
    prev = previous_holdings(problem.previous_plan)
    instances: list[tuple[PipeSolution, int]] = []
    for (_, n), (m, up), (sol_m, sol_up) in zip(
        scored.layout, scored.splits, ev.solutions(scored), strict=True
    ):
        instances.extend((sol_m, m) for _ in range(n - up))
        instances.extend((sol_up or sol_m, m + 1) for _ in range(up))
    slots: list[_Slot] = []
    where: list[tuple[int, int]] = []
    for i, (sol, _) in enumerate(instances):
        start = 0
        S = len(sol.order)
        for j, (c, n_layers) in enumerate(zip(sol.order, sol.layers, strict=True)):
            slots.append(_Slot(c, start, start + n_layers, j == 0, j == S - 1))
            where.append((i, j))
            start += n_layers
    pool: dict[Cls, list[Group]] = defaultdict(list)
    for g in (*grouping.healthy, *grouping.odd):
        pool[g.cls].append(_ordered(g, prev))
    chosen: dict[int, Group] = {}
    used: set[tuple[int, ...]] = set()
    by_cls: dict[Cls, list[int]] = defaultdict(list)
    for idx, s in enumerate(slots):
        by_cls[s.cls].append(idx)
    for c, idxs in by_cls.items():
        picks = _assign(problem, pool[c], [slots[i] for i in idxs], prev)
        for i, g in zip(idxs, picks, strict=True):
            chosen[i] = g
            used.add(g.ranks)
    stages: list[list[Stage]] = [[] for _ in instances]
    for idx, (i, _j) in enumerate(where):
        s = slots[idx]
        stages[i].append(Stage(ranks=list(chosen[idx].ranks), layers=(s.a, s.b)))
    excluded = set(grouping.excluded)
    for gs in pool.values():
        excluded.update(r for g in gs if g.ranks not in used for r in g.ranks)
    pipelines = [
        Pipeline(micro_batches=m, stages=st) for (_, m), st in zip(instances, stages, strict=True)
    ]
    pipelines.sort(key=lambda p: min(r for s in p.stages for r in s.ranks))
    return Plan(tp=problem.tp, pipelines=pipelines, excluded=sorted(excluded))
