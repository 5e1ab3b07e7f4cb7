"""TP grouping: how each node's usable GPUs form tensor-parallel groups of tp/2^k GPUs.

A group runs at its slowest member's pace (`y = alpha[k] * max rate`), so within a node the
best groups are runs of GPUs sorted by rate: any grouping is dominated, member by member, by the
sorted-contiguous one with the same sizes, and leaving GPUs out is best done from the slow end.
Per node we therefore search compositions of the sorted GPUs (a small DP), keeping for every
group count the fastest option. The global trade-off (more groups = more pipeline stages = more
bubble) is priced by one number `lam` per grouping policy: each node picks the option maximising
`speed - lam * groups`.

Nodes whose GPUs are all healthy keep full groups in rank order: they are the interchangeable
bulk that the search handles as counts, never one by one. On clusters of up to 16 nodes they may
also all be split into groups of one smaller size (where such a group holds the model alone),
beside every combination of the straggler nodes' options.

The per-node options (the DP, the group vocabulary `Group` and `NodeOption`) live in
nodegroups.py; this module picks one option per node (`choose_grouping`) and proposes the
candidate groupings the search scores (`candidate_groupings`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..pace import healthy_pace, pace
from ..problem import PlanningProblem
from .deadline import Deadline
from .layers import layer_caps
from .nodegroups import (
    Group,
    NodeOption,
    OptionCache,
    all_node_options,
    full_groups_option,
    node_options,
)

__all__ = [
    "Grouping",
    "candidate_groupings",
    "choose_grouping",
    "straggler_nodes",
]


@dataclass(frozen=True)
class Grouping:
    """Every node's choice: the bulk of healthy full groups, the odd ones, the ranks left out."""

    healthy: tuple[Group, ...]
    odd: tuple[Group, ...]
    excluded: tuple[int, ...]

    @property
    def key(self) -> tuple[object, ...]:
        return (len(self.healthy), tuple(sorted(g.cls for g in self.odd)), self.excluded)


def _healthy_y(problem: PlanningProblem) -> float:
    return healthy_pace(problem)


def _healthy_node_groups(problem: PlanningProblem, node: int) -> list[Group]:
    tp, gpn = problem.tp, problem.gpus_per_node
    base = node * gpn
    y = _healthy_y(problem)
    return [Group(tuple(range(base + a, base + a + tp)), node, 0, y) for a in range(0, gpn, tp)]


def straggler_nodes(problem: PlanningProblem) -> list[int]:
    """Nodes with any GPU whose rate is not exactly 1.0 (slow or unusable), or a slow link."""
    slow = {problem.node_of(r) for r, v in problem.rates.items() if v != 1.0}
    return sorted(slow | {n for n, v in problem.link_rates.items() if v != 1.0})


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
            full_healthy = g.k == 0 and g.y == y0 and g.link == 1.0
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


def candidate_groupings(
    problem: PlanningProblem, deadline: Deadline | None = None
) -> list[Grouping]:
    """Candidate groupings: every per-node combination when few, else one per (lam, mu) price.

    Healthy nodes keep full groups, except on small clusters where splitting them can pay
    (alpha below 2^k makes small groups faster per GPU): there they are enumerated too, or
    all split alike beside each straggler combination. Any
    straggler node, slow ones included, may be split into smaller groups. Past the deadline,
    the nodes not yet grouped keep full groups and no further price is tried (at least one
    grouping always comes back).
    """
    dl = deadline or Deadline()
    cache: OptionCache = {}
    nodes = straggler_nodes(problem)
    options: dict[int, list[NodeOption]] = {}
    for n in nodes:
        if dl.expired():
            options[n] = [full_groups_option(problem, n)]
            continue
        options[n] = node_options(problem, n, cache)
        dl.spend()
    seen: dict[tuple[object, ...], Grouping] = {}
    combos = math.prod(len(o) for o in options.values()) if options else 1
    if problem.nodes <= _SPLIT_HEALTHY_NODES or combos <= _ALL_COMBOS:
        every = {n: options.get(n) or node_options(problem, n, cache) for n in range(problem.nodes)}
    else:
        every = options  # large clusters: healthy nodes keep full groups (never enumerated)
    if problem.world <= _TINY:
        full = {n: all_node_options(problem, n) for n in range(problem.nodes)}
        if math.prod(len(o) for o in full.values()) <= _ALL_COMBOS_TINY:
            every = full
    if len(every) == problem.nodes and math.prod(len(o) for o in every.values()) <= max(
        _ALL_COMBOS, _ALL_COMBOS_TINY * (problem.world <= _TINY)
    ):
        options, nodes, combos = every, list(range(problem.nodes)), 0
    healthy_nodes = [n for n in range(problem.nodes) if n not in options]
    shared: list[int | None] = [None]  # None: healthy nodes keep full groups
    if combos and problem.nodes <= _SPLIT_HEALTHY_NODES and healthy_nodes:
        # Small clusters: the healthy nodes (interchangeable) are all split into groups of one
        # smaller size beside every combination of the straggler nodes' options (alpha[k] <
        # 2^k makes pairs faster per GPU than a full group: with a node at 1.57x among 8,
        # healthy pairs beside it took 2880 to 2720 where the straggler node's options alone
        # kept 2880). Only sizes whose group holds the model alone: where memory needs deeper
        # pipelines a split multiplies their stages (at 64 GPUs with the 70B memory model such
        # groupings scored 975-995 against 725, and their templates tripled the search's time).
        first = every[healthy_nodes[0]]
        shared += [i for i, o in enumerate(first) if _holds_the_model(problem, _one_size(o))]
    if combos <= _ALL_COMBOS:
        picks = itertools.product(*(range(len(options[n])) for n in nodes))
        for pick, h in itertools.product(list(picks), shared):
            if seen and dl.expired():
                break
            chosen = {n: [options[n][i]] for n, i in zip(nodes, pick, strict=True)}
            if h is not None:
                chosen.update({n: [every[n][h]] for n in healthy_nodes})
            g = choose_grouping(problem, chosen, 0.0)
            dl.spend()
            seen.setdefault(g.key, g)
    else:
        if problem.nodes <= _SPLIT_HEALTHY_NODES:
            options = every  # small clusters: a price may split healthy nodes too
        y0 = healthy_pace(problem)
        alphas = [pace(problem, k, 1.0) for k in range(problem.tp.bit_length())]
        caps = (math.inf, max(alphas), alphas[min(1, len(alphas) - 1)])
        many = len(nodes) > max(_MANY_NODES, problem.nodes // 2)
        for i, (lam, mu, cap) in enumerate(_policies(caps, many)):
            # the first prices are cheap and the likeliest to win: when the nodes' options
            # took the phase's whole share, they still run on the next phase's time
            if seen and dl.expired() and (i >= _FIRST_POLICIES or _outer_expired(dl)):
                break
            g = choose_grouping(problem, options, lam / y0, mu / (y0 * problem.tp), cap)
            dl.spend()
            seen.setdefault(g.key, g)
    return list(seen.values())


def _one_size(option: NodeOption) -> int | None:
    """The shard exponent k of an option whose groups all have one size and leave no usable GPU
    out (None for any other option)."""
    ks = {g.k for g in option.groups}
    return ks.pop() if len(ks) == 1 and not option.excluded else None


def _holds_the_model(problem: PlanningProblem, k: int | None) -> bool:
    """Whether a split group of shard exponent k (k >= 1) holds every layer alone (one stage,
    one micro-batch in flight)."""
    return k is not None and k >= 1 and layer_caps(problem, [k], 1)[0] >= problem.layers


# Uncapped prices go first (see _policies) when more nodes straggle than this and than half
# of all nodes: with a minority of straggler nodes, rare very slow GPUs are what caps are for.
_MANY_NODES = 64
_FIRST_LAMBDAS = 5  # the middle prices tried uncapped before any cap (see _policies)
_FIRST_POLICIES = _FIRST_LAMBDAS * len(_MUS)


def _outer_expired(dl: Deadline) -> bool:
    """Whether the deadline this phase's deadline was cut from has passed (or it has none)."""
    return dl.parent is None or dl.parent.expired()


def _policies(caps: tuple[float, ...], uncapped_first: bool) -> list[tuple[float, float, float]]:
    """Every (lam, mu, cap) price, the likeliest first: a deadline that cuts the list short
    has tried the middle of the lam range at every cap before its extremes. With stragglers
    on most nodes of a large cluster (`uncapped_first`), uncapped prices at the middle of the
    range come first of all: there the nodes' options leave time for a few prices only, and
    a cap on the slowest group (which pays when a rare very slow GPU would set a pipeline's
    pace) costs more speed than it saves."""
    mid = len(_LAMBDAS) // 2
    lams = sorted(_LAMBDAS, key=lambda x: (abs(_LAMBDAS.index(x) - mid), x))
    every = [(lam, mu, cap) for lam in lams for mu in _MUS for cap in caps]
    if not uncapped_first:
        return every
    first = [(lam, mu, caps[0]) for lam in lams[:_FIRST_LAMBDAS] for mu in _MUS]
    return first + [x for x in every if x not in first]
