"""Exactness: under every valid plan, N steps give the single-process reference's model.

One spawned 8-rank gloo job (2 nodes x 4 GPUs, tp 2) trains every case below in turn; the
reference runs here. Plans cover hetero TP groups (2 beside 1, in both directions between
stages), different layer splits per pipeline, unequal micro-batch counts (one below the
pipeline depth), 1-3 pipelines of 1-3 stages, excluded ranks, tied embeddings, and the
emulated clock with slowdowns.
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")

from malleus.trainer.data.samples import make_source, micro_batch  # noqa: E402
from malleus.trainer.launch.spawn import spawn_local  # noqa: E402
from malleus.trainer.model.decoder import GPT  # noqa: E402
from malleus.trainer.parallel.layout import Layout  # noqa: E402
from malleus.trainer.run.reference import train_reference  # noqa: E402

JOB = tc.small_job()
TIED = tc.small_job(model={"tiedEmbeddings": True})

UNIFORM = tc.plan(
    [(6, [([0, 1], (0, 3)), ([2, 3], (3, 6))]), (6, [([4, 5], (0, 3)), ([6, 7], (3, 6))])]
)
HETERO = tc.plan(  # 2 -> 1 in pipeline 0, 1 -> 2 in pipeline 1
    [(7, [([0, 1], (0, 2)), ([2], (2, 6))]), (5, [([4], (0, 4)), ([5, 6], (4, 6))])],
    excluded=[3, 7],
)
THREE = tc.plan(  # 1, 2 and 3 stages; the 3-stage pipeline has fewer micro-batches than stages
    [
        (3, [([0, 1], (0, 6))]),
        (7, [([2], (0, 1)), ([3], (1, 6))]),
        (2, [([5, 4], (0, 3)), ([6], (3, 4)), ([7], (4, 6))]),  # ranks out of order
    ]
)
LONG = tc.plan(  # one pipeline across both nodes, most ranks excluded, ranks out of order
    [(12, [([5], (0, 1)), ([2, 1], (1, 4)), ([7, 6], (4, 6))])], excluded=[0, 3, 4]
)
EMULATED = tc.small_job(
    model={"layers": 2},
    training={"globalBatchSize": 4, "steps": 2},
    # rank 2 serves at 3x; excluded rank 3 measures 2x. Layer times long enough that a loaded
    # host's scheduling (8 processes on 2 cores here) does not overrun them: an overrun is
    # charged its real duration and would read as a slowdown of a healthy rank.
    emulation=tc.emulation(0.030, 0.060, [(0, 2, 3.0), (0, 3, 2.0)]),
)
EMULATED_PLAN = tc.plan(
    [
        (1, [([0, 1], (0, 2))]),
        (1, [([2], (0, 2))]),
        (1, [([4, 5], (0, 2))]),
        (1, [([6, 7], (0, 2))]),
    ],
    excluded=[3],
)

CASES = [
    tc.Case("uniform", JOB, UNIFORM, 3),
    tc.Case("hetero", JOB, HETERO, 3),
    tc.Case("three", JOB, THREE, 3),
    tc.Case("long", JOB, LONG, 3),
    tc.Case("tied_hetero", TIED, HETERO, 3),
    tc.Case("tied_three", TIED, THREE, 3),
    tc.Case("emulated", EMULATED, EMULATED_PLAN, 2),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("cases")
    spawn_local(8, tc.run_cases, (CASES, str(out)))
    return {c.name: torch.load(out / f"{c.name}.pt") for c in CASES}


@functools.cache
def reference(name: str):
    """The reference run of case `name` (once per case)."""
    torch.set_num_threads(1)
    return train_reference(next(c for c in CASES if c.name == name).job)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_plan_matches_reference(results: dict[str, dict], name: str) -> None:
    ref = reference(name)
    got = results[name]
    assert tc.rel_diff(got["full"], ref.full_state()) <= 1e-4
    losses = [r["loss"] for r in got["reports"]]
    assert losses == pytest.approx(ref.losses, rel=1e-5)


def test_plans_agree_with_each_other_closely(results: dict[str, dict]) -> None:
    # Not only within tolerance of the reference: the plans differ by summation order alone.
    base = results["uniform"]["full"]
    for name in ("hetero", "three", "long"):
        assert tc.rel_diff(results[name]["full"], base) <= 2e-5


def _first_step_norm(job) -> float:
    """The reference's gradient norm at step 0 (torch's clip_grad_norm_ over full tensors)."""
    tr = job.spec.training
    model = GPT.from_seed(job.model, job.tp, tr.seed)
    source = make_source(tr.dataset, job.model.sequence, job.model.vocab, tr.seed)
    for j in range(job.micro_batches):
        x, y = micro_batch(source, 0, j, tr.global_batch_size, tr.micro_batch_size)
        (model(x, y) / job.micro_batches).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


@pytest.mark.parametrize("name", ["uniform", "hetero", "long", "tied_hetero", "tied_three"])
def test_grad_norm_counts_every_piece_once(results: dict[str, dict], name: str) -> None:
    # Replicas (DP peers, TP-replicated norms, a tied head) must not be counted twice.
    case = next(c for c in CASES if c.name == name)
    assert results[name]["reports"][0]["grad_norm"] == pytest.approx(
        _first_step_norm(case.job), rel=1e-5
    )


def test_loss_falls(results: dict[str, dict]) -> None:
    reports = results["uniform"]["reports"]
    assert reports[-1]["loss"] < reports[0]["loss"] - 0.1


def test_groups_are_created_once_per_member_set_across_plans(results: dict[str, dict]) -> None:
    sets = set()
    for c in CASES:
        sets |= set(Layout.from_plan(c.plan, c.job.model, 0, 8).member_sets())
        assert results[c.name]["groups"] == len(sets)


def test_emulated_rates_show_the_slowdowns(results: dict[str, dict]) -> None:
    rates = results["emulated"]["reports"][-1]["rates"]
    assert 2.4 <= rates[2] <= 3.6, rates  # serving, 3x
    assert 1.6 <= rates[3] <= 2.4, rates  # excluded, benchmarking itself, 2x
    for r in (0, 1, 4, 5, 6, 7):
        assert 1.0 <= rates[r] <= 1.5, rates
