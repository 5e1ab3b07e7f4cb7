"""The in-process exact solvers against integer programs stated plainly and solved by PuLP/CBC.

The planner never starts a solver in its search loop (~17 ms per CBC process); these
tests are where the integer programs live, as the clearest statement of what "exact" means.
"""

from __future__ import annotations

import random

import pulp
import pytest

from malleus.planner.search.layersplit import split_layers
from malleus.planner.search.microbatch import split_linear

SOLVER = pulp.PULP_CBC_CMD(msg=False)
# PuLP 3.3 announces its 4.0 API; the 3.x calls used here are the documented ones.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _ilp_layers(ys: list[float], caps: list[int], L: int, m: int) -> float:
    """min (m-1)*b + sum_j y_j*l_j  s.t.  y_j*l_j <= b, 1 <= l_j <= cap_j, sum_j l_j = L."""
    prob = pulp.LpProblem("layers", pulp.LpMinimize)
    ls = [pulp.LpVariable(f"l{j}", 1, c, cat="Integer") for j, c in enumerate(caps)]
    b = pulp.LpVariable("b", 0)
    prob += (m - 1) * b + pulp.lpSum(y * x for y, x in zip(ys, ls, strict=True))
    prob += pulp.lpSum(ls) == L
    for y, x in zip(ys, ls, strict=True):
        prob += y * x <= b
    assert prob.solve(SOLVER) == pulp.LpStatusOptimal
    return pulp.value(prob.objective)


def _ilp_micro_batches(lines: list[tuple[float, float]], B: int) -> float:
    """min T  s.t.  T >= (m_i - 1)*b_i + s_i, sum_i m_i = B, m_i >= 1 integer."""
    prob = pulp.LpProblem("micro_batches", pulp.LpMinimize)
    ms = [pulp.LpVariable(f"m{i}", 1, B, cat="Integer") for i in range(len(lines))]
    t = pulp.LpVariable("T", 0)
    prob += t
    prob += pulp.lpSum(ms) == B
    for (b, s), m in zip(lines, ms, strict=True):
        prob += t >= (m - 1) * b + s
    assert prob.solve(SOLVER) == pulp.LpStatusOptimal
    return pulp.value(prob.objective)


@pytest.mark.parametrize("seed", range(12))
def test_layer_split_is_the_integer_optimum(seed: int) -> None:
    rng = random.Random(seed)
    S = rng.randint(1, 5)
    L = rng.randint(S, 40)
    ys = [rng.choice([1.0, 1.0, 1.5, 1.9, 2.5, 3.66, 4.0, 7.22]) for _ in range(S)]
    caps = [rng.randint(max(1, L // S), L) for _ in range(S)]  # a memory bound per stage
    m = rng.choice([1, 2, S, 8, 64])
    got = split_layers(ys, caps, L, m)
    assert got is not None
    layers, bottleneck, fill = got
    assert sum(layers) == L and all(1 <= n <= c for n, c in zip(layers, caps, strict=True))
    assert (m - 1) * bottleneck + fill == pytest.approx(_ilp_layers(ys, caps, L, m), rel=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_micro_batch_split_is_the_integer_optimum(seed: int) -> None:
    rng = random.Random(100 + seed)
    n = rng.randint(1, 5)
    B = rng.randint(n, 64)
    lines = [(rng.uniform(1, 30), rng.uniform(10, 200)) for _ in range(n)]
    got = split_linear([(b, s, 1) for b, s in lines], B)
    assert got is not None
    step_time, split = got
    assert sum(level + up for level, up in split) == B  # one pipeline per class: m_i = level + up
    assert step_time == pytest.approx(_ilp_micro_batches(lines, B), rel=1e-6)
