"""Brute-force optimum of tiny planning problems, written independently of the planner.

It enumerates every plan: each node's usable GPUs split into TP groups of any allowed size (any
subsets, not only runs of sorted rates) with any GPUs left out; every partition of the groups
into pipelines; every stage order; every layer split; every micro-batch split. Only exact
symmetry is used to keep it fast: groups with the same (pace, size, link) are interchangeable,
so pipelines are memoised by their multiset of classes and partitions are deduplicated.

A pipeline's time is the 1F1B makespan from the discrete-event simulation (sim1f1b.py). With a
calibration, a group's pace adds its TP collectives (tp_comm of its size, which the cases list
for every size, times its node's link rate), the first stage pays the embedding and the last the
head (scaled by pace over a healthy full group's, plus their own collectives by the stage's
group size, `embedding_comm` / `head_comm`, listed for every size as tp_comm), every boundary the p2p figure at the worse
link, and the step the fixed part. Gradient sync and the optimizer are not enumerated (they need
ranks or couple the pipelines): cases here leave them at 0.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

from malleus.planner import PlanningProblem
from tests.planner.sim1f1b import simulate

__all__ = ["optimum"]

Cls = tuple[float, int, float]  # (pace y, shards per GPU, link rate of its node)


def _tp_comm(problem: PlanningProblem, size: int) -> float:
    cal = problem.calibration
    return 0.0 if cal is None or size == 1 else float(cal.tp_comm.get(size, 0.0))


def _node_groupings(problem: PlanningProblem, node: int) -> Iterator[tuple[Cls, ...]]:
    """Every grouping of one node's usable GPUs (with leave-outs), as a multiset of classes."""
    gpn, tp = problem.gpus_per_node, problem.tp
    ranks = [r for r in range(node * gpn, (node + 1) * gpn) if problem.rate(r) is not None]
    sizes = [tp >> k for k in range(tp.bit_length())]

    def parts(rest: list[int]) -> Iterator[list[tuple[int, ...]]]:
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        yield from parts(others)  # `first` is left out
        for s in sizes:
            for mates in itertools.combinations(others, s - 1):
                left = [r for r in others if r not in mates]
                for tail in parts(left):
                    yield [(first, *mates), *tail]

    seen = set()
    link = float(problem.link_rates.get(node, 1.0))
    for groups in parts(ranks):
        key = []
        for g in groups:
            shards = tp // len(g)
            k = shards.bit_length() - 1
            worst = max(problem.rate(r) or 1.0 for r in g)
            pace = problem.model.alpha_at(k) * worst + _tp_comm(problem, len(g)) * link
            key.append((pace, shards, link))
        t = tuple(sorted(key))
        if t not in seen:
            seen.add(t)
            yield t


def _memory_ok(
    problem: PlanningProblem, order: tuple[Cls, ...], layers: tuple[int, ...], m: int
) -> bool:
    mem = problem.memory
    if mem is None:
        return True
    S = len(order)
    for j, ((_, shards, _), n) in enumerate(zip(order, layers, strict=True)):
        ends = mem.embedding_mb * ((j == 0) + (j == S - 1))  # a lone stage holds both
        per = mem.layer_mb * n + mem.activation_mb * n * min(S - j, m) + ends
        if shards * per + mem.fixed_mb > mem.capacity_mb + 1e-9:
            return False
    return True


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def optimum(problem: PlanningProblem) -> float:
    """The least step time over every valid plan (inf if none fits)."""
    L, B = problem.layers, problem.micro_batches
    cal = problem.calibration
    y0 = problem.model.alpha_at(0) + _tp_comm(problem, problem.tp)

    def costs_of(order: tuple[Cls, ...], layers: tuple[int, ...]) -> tuple[float, ...]:
        costs = [y * n for (y, _, _), n in zip(order, layers, strict=True)]
        if cal is not None:
            # the ends' own collectives by the end stage's group size (tp / shards), at its link
            first, last = order[0], order[-1]
            emb = (
                float(cal.embedding_comm.get(problem.tp // first[1], 0.0))
                if first[1] < problem.tp
                else 0.0
            )
            head = (
                float(cal.head_comm.get(problem.tp // last[1], 0.0))
                if last[1] < problem.tp
                else 0.0
            )
            costs[0] += cal.embedding * first[0] / y0 + emb * first[2]
            costs[-1] += cal.head * last[0] / y0 + head * last[2]
            for j in range(len(order) - 1):
                costs[j] += cal.p2p * max(order[j][2], order[j + 1][2])
        return tuple(costs)

    sim = functools.cache(simulate)

    @functools.cache
    def pipe_time(classes: tuple[Cls, ...], m: int) -> float:
        best = float("inf")
        if len(classes) > L:
            return best
        for order in set(itertools.permutations(classes)):
            for layers in _compositions(L, len(order)):
                if not _memory_ok(problem, order, layers, m):
                    continue
                best = min(best, sim(costs_of(order, layers), m))
        return best

    def partitions(items: tuple[Cls, ...]) -> Iterator[list[tuple[Cls, ...]]]:
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for r in range(len(rest) + 1):
            for idx in itertools.combinations(range(len(rest)), r):
                block = (first, *(rest[i] for i in idx))
                left = tuple(x for i, x in enumerate(rest) if i not in idx)
                for tail in partitions(left):
                    yield [tuple(sorted(block)), *tail]

    best = float("inf")
    per_node = [list(_node_groupings(problem, n)) for n in range(problem.nodes)]
    all_groups = {tuple(sorted(sum(pick, ()))) for pick in itertools.product(*per_node)}
    seen_parts = set()
    for groups in all_groups:
        for part in partitions(groups):
            key = tuple(sorted(part))
            if not key or key in seen_parts or len(key) > B:
                continue
            if problem.dp is not None and len(key) != problem.dp:
                continue
            seen_parts.add(key)
            for ms in _compositions(B, len(key)):
                t = max(pipe_time(p, m) for p, m in zip(key, ms, strict=True))
                best = min(best, t)
    return best + (cal.fixed if cal is not None else 0.0)
