"""A last climb on the chosen plan under the true rates: groups traded into its slowest pipeline.

The search plans on bucketed rates (driver.bucketed) and scores large layouts on any-m lines;
the plan it picks is re-split under the true rates (`driver._polish`), but its groups stay where
the bucketed search put them. Under the true rates the slowest pipeline is often one whose
groups drew slow rates within their buckets, and a swap of one of them with a faster group of
a pipeline with slack (or taking one more group from it) lowers the step time by a few tenths
of a per cent (1024 GPUs, 50% straggling: 1164.0 -> 1157-1162 in the default 6% of the
budget, against a long search's 1157.4).

Each neighbour changes two pipelines; the micro-batches are then split exactly (the greedy of
microbatch.py on per-m pipeline times, from one level below the current split), so a move is
accepted only when the exact step time drops. Only uncalibrated problems: there the greedy's
time is the cost model's step time (a calibrated tail depends on every pipeline's shares).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..plan import Pipeline, Plan, Stage
from ..problem import PlanningProblem
from .evaluate import Evaluator
from .layers import Cls, PipeSolution, solve_pipeline
from .microbatch import ClassSplit, greedy_split

__all__ = ["Solved", "settle"]

Groups = list[tuple[Cls, tuple[int, ...]]]  # one pipeline: (class, ranks) per stage
# How a pipeline is solved: in its own stage order (True: the plan's pipelines keep the order
# the search chose, often a full order search's) or in the load heuristic's (a changed one).
Spec = tuple[bool, tuple[Cls, ...]]
# Pipelines in a given stage order already solved (order, m or None for any m), shared with
# search._polish: the plan settled is mostly one it re-split, and without them the first
# exact split of its micro-batches solved each of its pipelines again (at 1024 GPUs, 50%:
# ~0.03 s of the ~0.04 s settle gets).
Solved = dict[tuple[tuple[Cls, ...], int | None], PipeSolution | None]


def _changed(pipe: Groups) -> Spec:
    return False, tuple(sorted(c for c, _ in pipe))


class _Split:
    """Exact micro-batch split of pipelines given as specs (solutions cached per spec and m)."""

    def __init__(self, ev: Evaluator, solved: Solved) -> None:
        self.ev = ev
        self.B = ev.problem.micro_batches
        self._fixed = solved

    def solution(self, spec: Spec, m: int) -> PipeSolution | None:
        """The pipeline solved for m micro-batches only (Evaluator.time_at also solves it for
        any m and takes the faster: a third more solves, time the trades need more)."""
        fixed, classes = spec
        if not fixed:
            return self.ev.pipe(classes, m)
        if (classes, m) not in self._fixed:
            # as Evaluator.pipe: from 4S+4 micro-batches on, m no longer changes the split
            mm = None if m >= 4 * len(classes) + 4 else m
            if (classes, mm) not in self._fixed:
                p = self.ev.problem
                self._fixed[(classes, mm)] = solve_pipeline(p, classes, mm, classes, self.ev.caps)
            self._fixed[(classes, m)] = self._fixed[(classes, mm)]
        return self._fixed[(classes, m)]

    def time(self, spec: Spec, m: int) -> float:
        sol = self.solution(spec, m)
        return float("inf") if sol is None else sol.time(m)

    def __call__(
        self, specs: list[Spec], start: list[int]
    ) -> tuple[float, list[ClassSplit]] | None:
        times = [lambda m, s=s: self.time(s, m) for s in specs]
        res = greedy_split(times, [1] * len(specs), self.B, start)
        if res is None or res[0] == float("inf"):
            return None
        return res


def _neighbours(
    pipes: list[Groups], crit: int, slack: list[int]
) -> Iterator[tuple[int, Groups, Groups]]:
    """Changes of (critical pipeline, pipeline q): a group g of q swapped with a slower group of
    the critical one of the same shard count, or g moved into it; pipelines with the most
    slack first (they can best afford a slower group or one fewer)."""
    c = pipes[crit]
    for q in slack:
        if q == crit:
            continue
        for gi, g in enumerate(pipes[q]):
            rest = pipes[q][:gi] + pipes[q][gi + 1 :]
            for hi, h in enumerate(c):
                if h[0][1] == g[0][1] and h[0][0] > g[0][0] + 1e-12:
                    yield q, [*c[:hi], g, *c[hi + 1 :]], [*rest, h]
            if rest:
                yield q, [*c, g], rest


def settle(
    problem: PlanningProblem,
    plan: Plan,
    cls_of: Callable[[list[int]], Cls],
    stop: Callable[[], bool],
    solved: Solved | None = None,
) -> Plan | None:
    """`plan` with its micro-batches split exactly, then groups traded while `stop()` (asked
    before every neighbour) allows; None when calibrated, or with nothing to trade with. The
    caller scores it with the cost model like any other candidate."""
    if problem.calibration is not None or len(plan.pipelines) < 2 or stop():
        return None
    split = _Split(Evaluator(problem, quick_orders=True), {} if solved is None else solved)
    pipes: list[Groups] = [
        [(cls_of(list(s.ranks)), tuple(s.ranks)) for s in p.stages] for p in plan.pipelines
    ]
    specs: list[Spec] = [(True, tuple(c for c, _ in p)) for p in pipes]
    res = split(specs, [max(1, p.micro_batches - 1) for p in plan.pipelines])
    if res is None:
        return None
    T, sp = res
    while not stop():
        levels = [m + (1 if up else 0) for m, up in sp]
        at = [split.time(s, m) for s, m in zip(specs, levels, strict=True)]
        crit = max(range(len(pipes)), key=lambda i: at[i])
        slack = sorted(range(len(pipes)), key=lambda i: at[i])
        start = [max(1, m - 1) for m in levels]
        found = False
        for q, nc, nq in _neighbours(pipes, crit, slack):
            if stop():
                break
            new = list(specs)
            new[crit], new[q] = _changed(nc), _changed(nq)
            # q lost a group or took a slower one: it may have to give up two micro-batches
            r = split(new, [*start[:q], max(1, levels[q] - 2), *start[q + 1 :]])
            if r is not None and r[0] < T - 1e-9:
                pipes[crit], pipes[q] = nc, nq
                specs, (T, sp), found = new, r, True
                break
        if not found:
            break
    return _plan(split, plan, pipes, specs, sp)


def _plan(
    split: _Split, plan: Plan, pipes: list[Groups], specs: list[Spec], sp: list[ClassSplit]
) -> Plan | None:
    """Ranks for the pipelines: each stage of the solution's order takes a group of its class."""
    out = []
    for pipe, spec, (m, up) in zip(pipes, specs, sp, strict=True):
        mm = m + (1 if up else 0)
        sol = split.solution(spec, mm)
        if sol is None:
            return None
        pool: dict[Cls, list[tuple[int, ...]]] = {}
        for c, ranks in pipe:
            pool.setdefault(c, []).append(ranks)
        stages, a = [], 0
        for c, n in zip(sol.order, sol.layers, strict=True):
            stages.append(Stage(ranks=list(pool[c].pop()), layers=(a, a + n)))
            a += n
        out.append(Pipeline(micro_batches=mm, stages=stages))
    return Plan(tp=plan.tp, pipelines=out, excluded=list(plan.excluded))
