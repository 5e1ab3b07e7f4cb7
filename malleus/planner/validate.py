"""`validate_plan`: every invariant of the plan contract (`plan.py`) plus the memory bound, all violations at once.

The trainer calls it before any collective starts and the operator before it posts a plan, so
each message names where the fault is (pipeline, stage, field) and what is expected.
"""

from __future__ import annotations

from malleus.errors import BadInput

from .memory import stage_memory_mb
from .plan import Plan
from .problem import PlanningProblem, as_fault

__all__ = ["PlanError", "check_plan", "validate_plan"]


class PlanError(BadInput):
    """A plan that breaks the contract; `violations` holds one message per fault."""

    def __init__(self, violations: list[str], source: str | None = None) -> None:
        self.violations = list(violations)
        super().__init__([as_fault(v) for v in violations], source, what="plan")


def validate_plan(problem: PlanningProblem, plan: Plan) -> list[str]:
    """All violations of `plan` against `problem` (empty list = valid)."""
    out: list[str] = []
    tp, world, L = problem.tp, problem.world, problem.layers
    if plan.tp != tp:
        out.append(f"tp: plan has {plan.tp}, problem has {tp}")
    if not plan.pipelines:
        out.append("pipelines: a plan needs at least one pipeline")
    seen: dict[int, str] = {}

    def place(rank: int, where: str) -> None:
        if rank in seen:
            out.append(f"{where}: rank {rank} is also in {seen[rank]}; a rank may appear once")
        else:
            seen[rank] = where

    cap = problem.memory.capacity_mb if problem.memory else None
    for i, p in enumerate(plan.pipelines):
        pw = f"pipelines[{i}]"
        if p.micro_batches < 1:
            out.append(f"{pw}.micro_batches: {p.micro_batches}; each pipeline needs at least 1")
        if not p.stages:
            out.append(f"{pw}.stages: a pipeline needs at least one stage")
            continue
        expect = 0
        S = len(p.stages)
        for j, s in enumerate(p.stages):
            sw = f"{pw}.stages[{j}]"
            a, b = s.layers
            if a != expect:
                what = "a gap" if a > expect else "an overlap"
                out.append(
                    f"{sw}.layers: starts at {a} but the previous stage ends at {expect} ({what})"
                )
            if b <= a:
                out.append(f"{sw}.layers: [{a}, {b}) is empty; each stage needs at least one layer")
            expect = b
            n = len(s.ranks)
            if n == 0 or tp % n or n & (n - 1):
                out.append(
                    f"{sw}.ranks: a group of {n} GPUs; allowed sizes are tp/2^k "
                    f"({', '.join(str(tp >> k) for k in range(tp.bit_length()))})"
                )
            nodes = set()
            for r in s.ranks:
                if not 0 <= r < world:
                    out.append(f"{sw}.ranks: rank {r} is beyond the world (0..{world - 1})")
                    continue
                if problem.rate(r) is None:
                    out.append(f"{sw}.ranks: rank {r} is unusable (rate null) and cannot serve")
                nodes.add(problem.node_of(r))
                place(r, sw)
            if len(nodes) > 1:
                out.append(
                    f"{sw}.ranks: {s.ranks} span nodes {sorted(nodes)}; a TP group must sit in one node"
                )
            if cap is not None and n and not tp % n and b > a:
                need = stage_memory_mb(problem, tp // n, b - a, S, j, p.micro_batches)
                if need > cap + 1e-9:
                    out.append(
                        f"{sw}: needs {need:.0f} MB per GPU ({b - a} layers, {tp // n} shards "
                        f"per GPU), over the capacity of {cap:.0f} MB"
                    )
        if expect != L:
            out.append(f"{pw}.stages: layers end at {expect}; they must cover [0, {L})")
    for r in plan.excluded:
        if not 0 <= r < world:
            out.append(f"excluded: rank {r} is beyond the world (0..{world - 1})")
        else:
            place(r, "excluded")
    for r in plan.failed:
        if not 0 <= r < world:
            out.append(f"failed: rank {r} is beyond the world (0..{world - 1})")
        elif problem.rate(r) is not None:
            out.append(f"failed: rank {r} is usable in the problem (rate {problem.rate(r)})")
        else:
            place(r, "failed")
    missing = [r for r in problem.usable_ranks() if r not in seen]
    if missing:
        out.append(f"ranks {missing} are usable but in no stage and not in excluded")
    total = sum(p.micro_batches for p in plan.pipelines)
    if total != problem.micro_batches:
        out.append(
            f"micro_batches: pipelines sum to {total}, the problem's step has {problem.micro_batches}"
        )
    return out


def check_plan(problem: PlanningProblem, plan: Plan) -> None:
    """Raise PlanError with every violation, if any."""
    violations = validate_plan(problem, plan)
    if violations:
        raise PlanError(violations)
