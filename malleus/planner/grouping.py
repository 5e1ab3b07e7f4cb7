"""TP grouping: how each node's usable GPUs form tensor-parallel groups of tp/2^k GPUs.

A group runs at its slowest member's pace (`y = alpha[k] * max rate`), so within a node the
best groups are runs of GPUs sorted by rate: any grouping is dominated, member by member, by the
sorted-contiguous one with the same sizes, and leaving GPUs out is best done from the slow end.
Per node we therefore search compositions of the sorted GPUs (a small DP), keeping for every
group count the fastest option. The global trade-off (more groups = more pipeline stages = more
bubble) is priced by one number `lam` per grouping policy: each node picks the option maximising
`speed - lam * groups`.

Nodes whose GPUs are all healthy keep full groups in rank order: they are the interchangeable
bulk that the search handles as counts, never one by one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .problem import PlanningProblem

__all__ = [
    "Group",
    "Grouping",
    "NodeOption",
    "all_node_options",
    "candidate_groupings",
    "choose_grouping",
    "node_options",
    "straggler_nodes",
]


@dataclass(frozen=True)
class Group:
    """A TP group: ranks in shard order, its shard exponent k (size tp/2^k) and pace y."""

    ranks: tuple[int, ...]
    node: int
    k: int
    y: float

    @property
    def cls(self) -> tuple[float, int]:
        """Interchangeability class: groups with equal (y, k) cost and weigh the same."""
        return (self.y, self.k)

    @property
    def speed(self) -> float:
        return 1.0 / self.y


@dataclass(frozen=True)
class NodeOption:
    """One way to group a node: groups (fastest GPUs first) and the GPUs left out."""

    groups: tuple[Group, ...]
    excluded: tuple[int, ...]
    speed: float

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def gpus(self) -> int:
        return sum(len(g.ranks) for g in self.groups)

    @property
    def slowest(self) -> float:
        return max((g.y for g in self.groups), default=0.0)


@dataclass(frozen=True)
class Grouping:
    """Every node's choice: the bulk of healthy full groups, the odd ones, the ranks left out."""

    healthy: tuple[Group, ...]
    odd: tuple[Group, ...]
    excluded: tuple[int, ...]

    @property
    def key(self) -> tuple[object, ...]:
        return (len(self.healthy), tuple(sorted(g.cls for g in self.odd)), self.excluded)


def _sizes(tp: int) -> list[int]:
    return [tp >> k for k in range(tp.bit_length())]


def _healthy_y(problem: PlanningProblem) -> float:
    return problem.model.alpha_at(0)


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

    def rec(at: int, groups: list[Group]) -> None:
        key = (tuple(sorted(g.cls for g in groups)), at)
        if key not in found:
            speed = sum(g.speed for g in groups)
            found[key] = NodeOption(tuple(groups), tuple(sorted(ranks[at:])), speed)
        for size, k in blocks:
            if at + size <= len(ranks):
                y = problem.model.alpha_at(k) * rates[at + size - 1]
                g = Group(tuple(sorted(ranks[at : at + size])), node, k, y)
                rec(at + size, [*groups, g])

    rec(0, [])
    return list(found.values())


def node_options(problem: PlanningProblem, node: int) -> list[NodeOption]:
    """Pareto options of one node (and 'none'), from a DP per cap on the slowest group.

    DP over the node's usable GPUs sorted by (rate, rank): best[i][g] is the fastest way to
    group the i fastest GPUs into g groups; the rest of the node is left out.
    """
    tp, gpn = problem.tp, problem.gpus_per_node
    ranks = [r for r in range(node * gpn, (node + 1) * gpn) if problem.rate(r) is not None]
    ranks.sort(key=lambda r: (problem.rate(r), r))
    rates = [float(problem.rate(r) or 1.0) for r in ranks]
    n = len(ranks)
    blocks = [(s, (tp // s).bit_length() - 1) for s in _sizes(tp)]
    paces = sorted(
        {problem.model.alpha_at(k) * rates[i - 1] for s, k in blocks for i in range(s, n + 1)}
    )
    options: list[NodeOption] = [NodeOption((), tuple(ranks), 0.0)]
    # One DP per pace cap: with few micro-batches the slowest group decides, not the sum.
    for cap in paces:
        options.extend(_grouping_dp(problem, node, ranks, rates, blocks, cap))

    # Pareto over (fewer groups, more speed, more GPUs = more memory, slowest group faster).
    unique = {(o.count, round(o.speed, 12), o.gpus, o.slowest): o for o in reversed(options)}
    options = list(unique.values())

    def dominated(o: NodeOption) -> bool:
        return any(
            p.count <= o.count
            and p.speed >= o.speed - 1e-12
            and p.gpus >= o.gpus
            and p.slowest <= o.slowest
            and (p.count, -p.speed, -p.gpus, p.slowest) != (o.count, -o.speed, -o.gpus, o.slowest)
            for p in options
        )

    return [o for o in options if not dominated(o)]


def _grouping_dp(
    problem: PlanningProblem,
    node: int,
    ranks: list[int],
    rates: list[float],
    blocks: list[tuple[int, int]],
    cap: float,
) -> list[NodeOption]:
    """best[i][g]: fastest grouping of the i fastest GPUs into g groups, each of pace <= cap."""
    n = len(ranks)
    best: list[list[tuple[float, int]]] = [[(-1.0, -1)] * (n + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, -1)
    for i in range(1, n + 1):
        for size, k in blocks:
            y = problem.model.alpha_at(k) * rates[i - 1]
            if size > i or y > cap + 1e-12:
                continue
            for g in range(1, i + 1):
                prev = best[i - size][g - 1][0]
                if prev >= 0 and prev + 1.0 / y > best[i][g][0] + 1e-12:
                    best[i][g] = (prev + 1.0 / y, i - size)
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
            groups = []
            for a, b in itertools.pairwise(cuts):
                k = (problem.tp // (b - a)).bit_length() - 1
                y = problem.model.alpha_at(k) * rates[b - 1]
                groups.append(Group(tuple(sorted(ranks[a:b])), node, k, y))
            out.append(NodeOption(tuple(groups), tuple(sorted(ranks[i:])), best[i][g][0]))
    return out


def _healthy_node_groups(problem: PlanningProblem, node: int) -> list[Group]:
    tp, gpn = problem.tp, problem.gpus_per_node
    base = node * gpn
    y = _healthy_y(problem)
    return [Group(tuple(range(base + a, base + a + tp)), node, 0, y) for a in range(0, gpn, tp)]


def straggler_nodes(problem: PlanningProblem) -> list[int]:
    """Nodes with any GPU whose rate is not exactly 1.0 (slow or unusable)."""
    return sorted({problem.node_of(r) for r, v in problem.rates.items() if v != 1.0})


def choose_grouping(
    problem: PlanningProblem,
    options: dict[int, list[NodeOption]],
    lam: float,
    mu: float = 0.0,
    cap: float = math.inf,
) -> Grouping:
    """Each straggler node picks the option maximising speed - lam*groups + mu*GPUs.

    lam prices an extra pipeline stage (bubble); mu values a GPU's memory (tight models need
    many GPUs per pipeline, so a slow full group can beat a fast half group); no group may
    be slower than `cap` (few micro-batches per pipeline: the slowest group decides).
    """
    healthy: list[Group] = []
    odd: list[Group] = []
    excluded: list[int] = []
    y0 = _healthy_y(problem)
    for node in range(problem.nodes):
        opts = options.get(node)
        if opts is None:
            healthy.extend(_healthy_node_groups(problem, node))
            continue
        allowed = [o for o in opts if o.slowest <= cap + 1e-12] or opts[:1]
        pick = max(allowed, key=lambda o: (o.speed - lam * o.count + mu * o.gpus, -o.count))
        excluded.extend(pick.excluded)
        for g in pick.groups:
            full_healthy = g.k == 0 and g.y == y0
            (healthy if full_healthy else odd).append(g)
    return Grouping(tuple(healthy), tuple(odd), tuple(sorted(excluded)))


# Grouping policies. With few combinations every node option is tried; otherwise each policy
# prices an extra group (lam, in healthy-group speeds), a GPU's memory (mu, in healthy-GPU
# speeds) and caps the slowest group's pace.
_LAMBDAS = (0.0, 0.004, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.14, 0.2, 0.3, 0.45, 0.7, 1.5)
_MUS = (0.0, 0.5)
_ALL_COMBOS = 96
_TINY, _ALL_COMBOS_TINY = 16, 400  # up to 16 GPUs: every grouping of every node, if <= 400
_SPLIT_HEALTHY_NODES = 16  # up to this many nodes, policies may split healthy nodes too


def candidate_groupings(problem: PlanningProblem) -> list[Grouping]:
    """Candidate groupings: every per-node combination when few, else one per (lam, mu) price.

    Healthy nodes keep full groups, except on small clusters where splitting them can pay
    (alpha below 2^k makes small groups faster per GPU): there they are enumerated too.
    """
    nodes = straggler_nodes(problem)
    options: dict[int, list[NodeOption]] = {n: node_options(problem, n) for n in nodes}
    seen: dict[tuple[object, ...], Grouping] = {}
    combos = math.prod(len(o) for o in options.values()) if options else 1
    every = {n: options.get(n) or node_options(problem, n) for n in range(problem.nodes)}
    if problem.world <= _TINY:
        full = {n: all_node_options(problem, n) for n in range(problem.nodes)}
        if math.prod(len(o) for o in full.values()) <= _ALL_COMBOS_TINY:
            every = full
    if math.prod(len(o) for o in every.values()) <= max(
        _ALL_COMBOS, _ALL_COMBOS_TINY * (problem.world <= _TINY)
    ):
        options, nodes, combos = every, list(range(problem.nodes)), 0
    if combos <= _ALL_COMBOS:
        for pick in itertools.product(*(range(len(options[n])) for n in nodes)):
            chosen = {n: [options[n][i]] for n, i in zip(nodes, pick, strict=True)}
            g = choose_grouping(problem, chosen, 0.0)
            seen.setdefault(g.key, g)
    else:
        if problem.nodes <= _SPLIT_HEALTHY_NODES:
            options = every  # small clusters: a price may split healthy nodes too
        y0 = problem.model.alpha_at(0)
        alphas = [problem.model.alpha_at(k) for k in range(problem.tp.bit_length())]
        caps = (math.inf, max(alphas), alphas[min(1, len(alphas) - 1)])
        for lam, mu, cap in itertools.product(_LAMBDAS, _MUS, caps):
            g = choose_grouping(problem, options, lam / y0, mu / (y0 * problem.tp), cap)
            seen.setdefault(g.key, g)
    return list(seen.values())
