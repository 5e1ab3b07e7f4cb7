"""Per-node TP grouping options: the ways one node's usable GPUs form groups of tp/2^k GPUs.

A group runs at its slowest member's pace (`y = alpha[k] * max rate`), so within a node the
best groups are runs of GPUs sorted by rate: any grouping is dominated, member by member, by the
sorted-contiguous one with the same sizes, and leaving GPUs out is best done from the slow end.
Per node we therefore search compositions of the sorted GPUs (a small DP), keeping for every
group count the fastest option (`node_options`; `all_node_options` on tiny clusters). Here
live the group vocabulary (`Group`, `NodeOption`) and the per-node search; grouping.py chooses
one option per node for the whole cluster.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

from ..pace import pace
from ..problem import PlanningProblem

__all__ = [
    "Group",
    "NodeOption",
    "OptionCache",
    "all_node_options",
    "full_groups_option",
    "node_options",
]


@dataclass(frozen=True)
class Group:
    """A TP group: ranks in shard order, its shard exponent k (size tp/2^k) and pace y."""

    ranks: tuple[int, ...]
    node: int
    k: int
    y: float
    link: float = 1.0  # the node's link rate (calibrated cost model)

    @property
    def cls(self) -> tuple[float, ...]:
        """Interchangeability class: groups with equal (y, k) cost and weigh the same; a group
        on a slow-link node carries its link rate too (its gradient sync is slower)."""
        return (self.y, self.k) if self.link == 1.0 else (self.y, self.k, self.link)

    @property
    def speed(self) -> float:
        return 1.0 / self.y


@dataclass(frozen=True)
class NodeOption:
    """One way to group a node: groups (fastest GPUs first) and the GPUs left out."""

    groups: tuple[Group, ...]
    excluded: tuple[int, ...]
    speed: float

    # cached: a grouping policy asks every option of every node for these (thousands of times)
    @cached_property
    def count(self) -> int:
        return len(self.groups)

    @cached_property
    def gpus(self) -> int:
        return sum(len(g.ranks) for g in self.groups)

    @cached_property
    def slowest(self) -> float:
        return max((g.y for g in self.groups), default=0.0)


def _sizes(tp: int) -> list[int]:
    return [tp >> k for k in range(tp.bit_length())]


def all_node_options(problem: PlanningProblem, node: int) -> list[NodeOption]:
    """Every grouping of the node's i fastest GPUs (any i) into runs, one per class multiset.

    Complete up to the dominance of sorted runs (module docstring); used on tiny clusters.
    """
    tp, gpn = problem.tp, problem.gpus_per_node
    ranks = [r for r in range(node * gpn, (node + 1) * gpn) if problem.rate(r) is not None]
    ranks.sort(key=lambda r: (problem.rate(r), r))
    rates = [float(problem.rate(r) or 1.0) for r in ranks]
    blocks = [(s, (tp // s).bit_length() - 1) for s in _sizes(tp)]
    found: dict[tuple[object, ...], NodeOption] = {}
    link = problem.link_rate(node)

    def rec(at: int, groups: list[Group]) -> None:
        key = (tuple(sorted(g.cls for g in groups)), at)
        if key not in found:
            speed = sum(g.speed for g in groups)
            found[key] = NodeOption(tuple(groups), tuple(sorted(ranks[at:])), speed)
        for size, k in blocks:
            if at + size <= len(ranks):
                y = pace(problem, k, rates[at + size - 1], link)
                g = Group(tuple(sorted(ranks[at : at + size])), node, k, y, link)
                rec(at + size, [*groups, g])

    rec(0, [])
    return list(found.values())


def _sorted_node(problem: PlanningProblem, node: int) -> tuple[list[int], list[float]]:
    """The node's usable ranks sorted by (rate, rank), and their rates."""
    gpn = problem.gpus_per_node
    ranks = [r for r in range(node * gpn, (node + 1) * gpn) if problem.rate(r) is not None]
    ranks.sort(key=lambda r: (problem.rate(r), r))
    return ranks, [float(problem.rate(r) or 1.0) for r in ranks]


_ALL_CAPS_NODES, _MAX_CAPS = 64, 6  # beyond 64 nodes, at most 6 pace caps per node DP

OptionCache = dict[
    tuple[object, ...], list[tuple[tuple[tuple[tuple[int, ...], int, float], ...], int, float]]
]
"""Node options by node signature (sorted rates, link): as positions in the sorted node."""


def node_options(
    problem: PlanningProblem, node: int, cache: OptionCache | None = None
) -> list[NodeOption]:
    """Pareto options of one node (and 'none'), from a DP per cap on the slowest group.

    DP over the node's usable GPUs sorted by (rate, rank): best[i][g] is the fastest way to
    group the i fastest GPUs into g groups; the rest of the node is left out. Nodes with the
    same sorted rates and link have the same options up to their ranks: `cache` solves each
    such signature once (thousands of nodes, a few hundred signatures).
    """
    ranks, rates = _sorted_node(problem, node)
    link = problem.link_rate(node)
    sig = (tuple(rates), link)
    shapes = cache.get(sig) if cache is not None else None
    if shapes is None:
        opts = _node_options(problem, node, ranks, rates)
        pos = {r: i for i, r in enumerate(ranks)}
        shapes = [
            (
                tuple((tuple(pos[r] for r in g.ranks), g.k, g.y) for g in o.groups),
                len(ranks) - len(o.excluded),
                o.speed,
            )
            for o in opts
        ]
        if cache is not None:
            cache[sig] = shapes
        return opts
    out = []
    for groups, used, speed in shapes:
        gs = tuple(
            Group(tuple(sorted(ranks[i] for i in idx)), node, k, y, link) for idx, k, y in groups
        )
        out.append(NodeOption(gs, tuple(sorted(ranks[used:])), speed))
    return out


def _node_options(
    problem: PlanningProblem, node: int, ranks: list[int], rates: list[float]
) -> list[NodeOption]:
    tp = problem.tp
    n = len(ranks)
    blocks = [(s, (tp // s).bit_length() - 1) for s in _sizes(tp)]
    link = problem.link_rate(node)
    ys = {(i, k): pace(problem, k, rates[i - 1], link) for s, k in blocks for i in range(s, n + 1)}
    # One DP per pace cap: with few micro-batches the slowest group decides, not the sum.
    # Options are (cuts, speed) until the front is known: most caps repeat each other's.
    raw: list[tuple[tuple[int, ...], float]] = [((0,), 0.0)]
    caps = sorted(set(ys.values()))
    if problem.nodes > _ALL_CAPS_NODES and len(caps) > _MAX_CAPS:
        # large clusters: many micro-batches per pipeline, the cap matters less than the sum;
        # a ladder of caps (the loosest always) keeps the node's options few and quick
        step = (len(caps) - 1) / (_MAX_CAPS - 1)
        caps = [caps[round(i * step)] for i in range(_MAX_CAPS)]
    for cap in caps:
        raw.extend(_grouping_dp(n, blocks, ys, cap))
    memo: dict[tuple[int, ...], float] = {}  # caps repeat each other's groupings

    def slowest(cuts: tuple[int, ...]) -> float:
        y = memo.get(cuts)
        if y is None:
            y = memo[cuts] = max(
                (ys[(b, _k(tp, b - a))] for a, b in itertools.pairwise(cuts)), default=0.0
            )
        return y

    # Pareto over (fewer groups, more speed, more GPUs = more memory, slowest group faster).
    keyed = [((len(c) - 1, round(v, 12), c[-1], slowest(c)), c, v) for c, v in raw]
    unique = {key: (key, c, v) for key, c, v in reversed(keyed)}
    options = list(unique.values())
    # Whatever dominates an option sorts before it, and dominance is transitive: one pass over
    # the sorted options against those kept so far (a few dozen) finds the front.
    kept: list[tuple[int, float, int, float]] = []
    front = set()
    for key, _c, v in sorted(options, key=lambda o: (o[0][0], -o[2], -o[0][2], o[0][3])):
        count, _, gpus, slow = key
        if not any(
            pc <= count and pv >= v - 1e-12 and pg >= gpus and ps <= slow for pc, pv, pg, ps in kept
        ):
            kept.append((count, v, gpus, slow))
            front.add(key)
    out = []
    for key, cuts, v in options:
        if key not in front:
            continue
        groups = tuple(
            Group(tuple(sorted(ranks[a:b])), node, _k(tp, b - a), ys[(b, _k(tp, b - a))], link)
            for a, b in itertools.pairwise(cuts)
        )
        out.append(NodeOption(groups, tuple(sorted(ranks[cuts[-1] :])), v))
    return out


def _k(tp: int, size: int) -> int:
    return (tp // size).bit_length() - 1


def _grouping_dp(
    n: int,
    blocks: list[tuple[int, int]],
    ys: dict[tuple[int, int], float],
    cap: float,
) -> list[tuple[tuple[int, ...], float]]:
    """best[i][g]: fastest grouping of the i fastest GPUs into g groups, each of pace <= cap
    (`ys[(i, k)]`: pace of a group of shard exponent k whose slowest GPU is the i-th);
    returned as (cuts 0 = c_0 < ... < c_g = i, speed)."""
    best: list[list[tuple[float, int]]] = [[(-1.0, -1)] * (n + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, -1)
    for i in range(1, n + 1):
        row = best[i]
        for size, k in blocks:
            if size > i:
                continue
            y = ys[(i, k)]
            if y > cap + 1e-12:
                continue
            inv = 1.0 / y
            src = best[i - size]
            for g in range(1, i + 1):
                prev = src[g - 1][0]
                if prev >= 0 and prev + inv > row[g][0] + 1e-12:
                    row[g] = (prev + inv, i - size)
    out = []
    for i in range(1, n + 1):
        for g in range(1, i + 1):
            if best[i][g][0] < 0:
                continue
            cuts = [i]
            ii, gg = i, g
            while ii > 0:
                ii = best[ii][gg][1]
                gg -= 1
                cuts.append(ii)
            cuts.reverse()
            out.append((tuple(cuts), best[i][g][0]))
    return out


def full_groups_option(problem: PlanningProblem, node: int) -> NodeOption:
    """The node's usable GPUs, sorted by rate, in full groups (the rest left out): cheap."""
    ranks, rates = _sorted_node(problem, node)
    link = problem.link_rate(node)
    tp = problem.tp
    groups = tuple(
        Group(
            tuple(sorted(ranks[a : a + tp])),
            node,
            0,
            pace(problem, 0, rates[a + tp - 1], link),
            link,
        )
        for a in range(0, len(ranks) - tp + 1, tp)
    )
    used = len(groups) * tp
    return NodeOption(groups, tuple(sorted(ranks[used:])), sum(g.speed for g in groups))
