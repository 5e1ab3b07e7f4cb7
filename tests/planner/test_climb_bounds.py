"""The climbs' cheap verdicts never reject a neighbour the full score would accept.

`layersplit.LineFloor` bounds what a pipeline not solved yet can take within a step time, and
`localsearch.Tally` judges a neighbour from its changed pipelines alone (issue 13, item 2):
both must only ever save work, never change which neighbours a climb accepts.
"""

from __future__ import annotations

import itertools
import random

from malleus.planner import PlanningProblem
from malleus.planner.search.evaluate import Evaluator, Layout, merge
from malleus.planner.search.layers import Cls
from malleus.planner.search.layersplit import line_floor, split_layers
from malleus.planner.search.localsearch import Tally, apply_move, candidate_moves, used_groups
from malleus.planner.search.microbatch import line_count
from tests.planner.setting_70b import problem_70b


def _problem(world: int) -> PlanningProblem:
    return problem_70b(world)


def test_line_floor_never_counts_fewer_than_the_solved_line() -> None:
    rng = random.Random(7)
    for _ in range(400):
        S = rng.randint(1, 12)
        L = rng.randint(S, 96)
        ys = [rng.choice([1.0, 1.9, 3.66, 7.22]) * rng.uniform(1.0, 3.0) for _ in range(S)]
        caps = [rng.randint(1, L) for _ in range(S)]
        es = [rng.uniform(0.0, 2.0) if rng.random() < 0.3 else 0.0 for _ in range(S)]
        res = split_layers(ys, caps, L, None, es)
        floor = line_floor(ys, L)
        if res is None:
            continue
        assert floor is not None
        _, b, s = res
        for T in (s * 0.5, s, s + 0.3 * b, s + 7.5 * b, s + 40 * b, 3 * s + 100 * b):
            assert floor.count(T) >= line_count([(b, s, 1)], T), (ys, caps, es, T)


def _random_layout(rng: random.Random, groups: list[Cls], pipes: int) -> Layout:
    rng.shuffle(groups)
    cut = sorted(rng.sample(range(1, len(groups)), pipes - 1))
    parts = [groups[a:b] for a, b in itertools.pairwise([0, *cut, len(groups)])]
    return merge([(tuple(p), 1) for p in parts])


def test_tally_rejects_only_neighbours_the_full_score_rejects() -> None:
    # 256 GPUs of the 70B setting, groups of mixed paces and shard counts in 3-6 pipelines:
    # every neighbour the tally turns down is, by the full unrefined score, neither faster
    # nor a tie with more micro-batches below the step time; every one it takes is no slower
    p = _problem(256)
    ev = Evaluator(p)
    B = p.micro_batches
    rng = random.Random(3)
    checked = rejected = 0
    for trial in range(10):
        groups: list[Cls] = [(1.0, 0)] * rng.randint(14, 22)
        groups += [(round(rng.uniform(1.2, 3.0), 2), 0) for _ in range(rng.randint(2, 6))]
        groups += [(round(1.9 * rng.uniform(1.0, 2.0), 2), 1) for _ in range(rng.randint(1, 5))]
        best = ev.score(_random_layout(rng, groups, rng.randint(3, 6)), refine=False)
        if best is None or best.refined:
            continue
        tally = Tally(ev, best)
        available = used_groups(best.layout)
        available[(2.5, 2)] += 2  # idle groups to re-admit
        idle = available - used_groups(best.layout)
        order = list(range(len(best.layout)))
        for move in itertools.islice(candidate_moves(best.layout, idle, order), 400):
            lay = apply_move(best.layout, move)
            if not lay or (sum(n for _, n in lay) + 2) * 4 >= B:
                continue
            verdict = tally.judge(move)
            sc = ev.score(lay, refine=False)
            checked += 1
            if sc is None or sc.time > best.time + 1e-9:
                assert not verdict, (trial, move)
                rejected += 1
                continue
            lines = []
            for key, n in lay:
                sol = ev.pipe(key)
                assert sol is not None
                lines.append((sol.bottleneck, sol.fill, n))
            # (a gain under 1e-7 of T is a tie to the tally: below line_count's tolerance)
            better = sc.time < tally.lo_t or line_count(lines, tally.lo_t) > tally.lo
            if better:
                assert verdict, (trial, move, sc.time, best.time)
            if not verdict:
                rejected += 1
    assert checked > 150 and rejected > checked // 4, (checked, rejected)


def test_the_floor_bound_is_never_above_the_refined_score() -> None:
    # Evaluator.floor_bound spares the templates' refinement and lets the climbs skip
    # neighbours unsolved: it must never exceed a layout's score, refined (exact per-m
    # pipelines, the greedy micro-batch split) or not, with few micro-batches per pipeline
    # (where 1F1B's bubble and the per-m solutions matter most) and with many, with the 70B
    # memory model (capped stages, some pipelines unable to run) and without
    rng = random.Random(11)
    checked = 0
    for world, memory, mb in ((32, False, 16), (64, False, 64), (64, True, 64), (96, True, 200)):
        p = problem_70b(world).model_copy(update={"micro_batches": mb})
        if not memory:
            p = p.model_copy(update={"memory": None})
        ev = Evaluator(p)
        paces = [1.0, 1.3, 2.0, 3.1, 7.5]
        for _ in range(60):
            groups: list[Cls] = []
            for _ in range(rng.randint(2, 14)):
                k = rng.choice([0, 0, 1, 2, 3])
                groups.append((p.model.alpha[k] * rng.choice(paces), k))
            lay = _random_layout(rng, groups, rng.randint(1, min(6, len(groups))))
            floor = ev.floor_bound(lay)
            for refine in (True, False):
                sc = ev.score(lay, refine=refine)
                if sc is None:
                    continue
                checked += 1
                assert floor <= sc.time + 1e-6, (world, memory, lay, floor, sc.time)
    assert checked > 200
