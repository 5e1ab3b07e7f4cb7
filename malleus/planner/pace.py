"""Per-group pace: how fast a TP group runs one layer, and each pipeline position's extras.

These are the cost model's per-group numbers, in layer-time units (`cost.py` explains the
units): a group's compute at its slowest GPU's rate times alpha[k], plus (calibrated) its TP
collectives at its node's link rate, and the embedding, head and activation transfer that a
stage pays by its position in the pipeline. The grouping, the layer split and the search call
them for every candidate group, so they take ranks or plain numbers, never a plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .problem import PlanningProblem
from .schedule import INF

__all__ = [
    "group_link",
    "group_pace",
    "group_rate",
    "healthy_pace",
    "pace",
    "position_extras",
    "shard_exponent",
]


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


def pace(problem: PlanningProblem, k: int, worst: float, link: float = 1.0) -> float:
    """Time per layer per micro-batch of a group of tp/2^k GPUs whose slowest member has rate
    `worst`, on a node of link rate `link`: alpha[k] * worst + tp_comm[size] * link."""
    y = problem.model.alpha_at(k) * worst
    cal = problem.calibration
    if cal is None:
        return y
    return y + cal.tp_comm_at(problem.tp >> k) * link


def healthy_pace(problem: PlanningProblem) -> float:
    """Pace of a healthy full TP group on a healthy link."""
    return pace(problem, 0, 1.0, 1.0)


def group_link(problem: PlanningProblem, ranks: Sequence[int]) -> float:
    return max((problem.link_rate(problem.node_of(r)) for r in ranks), default=1.0)


def group_pace(problem: PlanningProblem, ranks: Sequence[int]) -> float:
    """`pace` of a concrete group: compute at its slowest GPU plus its TP collectives."""
    y = group_rate(problem, ranks)
    cal = problem.calibration
    if cal is None or not math.isfinite(y):
        return y
    return y + cal.tp_comm_at(len(ranks)) * group_link(problem, ranks)


def position_extras(
    problem: PlanningProblem,
    paces: Sequence[float],
    links: Sequence[float],
    sizes: Sequence[int],
) -> list[float]:
    """Per micro-batch work of each stage beyond its layers, by position in the pipeline.

    The first stage runs the embedding and the last the head, each at the stage's pace relative
    to a healthy full group's, plus their own TP collectives by the stage's group size (`sizes`)
    at its link rate; every stage but the last sends its activations to the next one (and
    receives their gradient), at the worse of the two nodes' link rates.
    """
    S = len(paces)
    cal = problem.calibration
    if cal is None or S == 0:
        return [0.0] * S
    y0 = healthy_pace(problem)
    out = [0.0] * S
    out[0] += cal.embedding * paces[0] / y0 + cal.embedding_comm_at(sizes[0]) * links[0]
    out[-1] += cal.head * paces[-1] / y0 + cal.head_comm_at(sizes[-1]) * links[-1]
    for j in range(S - 1):
        out[j] += cal.p2p * max(links[j], links[j + 1])
    return out
