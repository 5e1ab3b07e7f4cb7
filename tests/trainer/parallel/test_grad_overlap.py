"""The gradient sync overlapped with the backward (trainer/parallel/grad_sync.py) is the same math.

One spawned 8-rank gloo job (2 nodes x 4 GPUs, tp 2, real timings: the sync overlaps) trains
each plan twice: with the default chunks (25 MiB: one per bucket at this size, posted when the
backward has finished the bucket's last piece) and with every piece a chunk of its own (posted
one by one while the backward goes on through the layers before them). Every data-parallel
group here has two members, whose sum does not depend on how the gradients are cut, so the two
runs must end with the same model bit for bit, and with the single-process reference's within
the plans' usual bound. The runs are also held to having posted chunks during the backward.
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

from malleus.trainer.launch.spawn import spawn_local  # noqa: E402
from malleus.trainer.parallel.grad_sync import chunks  # noqa: E402
from malleus.trainer.parallel.layout import Layout  # noqa: E402
from malleus.trainer.run.reference import train_reference  # noqa: E402

JOB = tc.small_job()
TIED = tc.small_job(model={"tiedEmbeddings": True})
UNIFORM = tc.plan(  # dp 2 over two 2-stage pipelines
    [(6, [([0, 1], (0, 3)), ([2, 3], (3, 6))]), (6, [([4, 5], (0, 3)), ([6, 7], (3, 6))])]
)
MIXED = tc.plan(  # a one-stage pipeline beside a 2-stage one: buckets per holder set, a tied
    # embedding summed between the first and the last stage
    [(5, [([0, 1], (0, 6))]), (7, [([4, 5], (0, 2)), ([6, 7], (2, 6))])],
    excluded=[2, 3],
)
CASES = [tc.Case("uniform", JOB, UNIFORM, 3), tc.Case("tied_mixed", TIED, MIXED, 3)]
CAPS = [None, 1]  # the default; 1 byte: every piece a chunk of its own


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int | None], dict]:
    out = tmp_path_factory.mktemp("chunks")
    spawn_local(8, tc.run_chunk_cases, (CASES, CAPS, str(out)))
    return {(c.name, cap): torch.load(out / f"{c.name}-{cap}.pt") for c in CASES for cap in CAPS}


@functools.cache
def reference(name: str):
    torch.set_num_threads(1)
    return train_reference(next(c for c in CASES if c.name == name).job)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_chunks_posted_during_the_backward_give_the_same_model(results, name: str) -> None:
    whole, pieces = results[(name, None)], results[(name, 1)]
    assert whole["full"].keys() == pieces["full"].keys()
    for key, value in whole["full"].items():
        assert torch.equal(value, pieces["full"][key]), key
    assert [r["loss"] for r in whole["reports"]] == [r["loss"] for r in pieces["reports"]]
    assert [r["grad_norm"] for r in whole["reports"]] == [r["grad_norm"] for r in pieces["reports"]]
    ref = reference(name)
    assert tc.rel_diff(pieces["full"], ref.full_state()) <= 1e-4


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_chunks_are_posted_while_the_backward_goes_on(results, name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    for rank, (count, early) in enumerate(results[(name, 1)]["chunks"]):
        layout = Layout.from_plan(case.plan, case.job.model, rank, case.job.world)
        assert count == len(chunks(layout, 1))  # what the test expects the rank to cut
        if layout.place is None:
            assert (count, early) == (0, 0)  # an excluded rank holds nothing
            continue
        buckets = sum(1 for _ in layout.my_buckets())
        assert count > buckets > 0
        # Every chunk but those the backward finishes last (the first layer's, the embedding's)
        # went out before the schedule ended.
        assert early >= count // 2, (rank, count, early)
    for rank, (count, _) in enumerate(results[(name, None)]["chunks"]):
        layout = Layout.from_plan(case.plan, case.job.model, rank, case.job.world)
        assert count == sum(1 for _ in layout.my_buckets())  # 25 MiB: one chunk per bucket


def test_chunks_are_whole_pieces_of_one_bucket_cut_from_its_end() -> None:
    for rank in range(8):
        layout = Layout.from_plan(MIXED, TIED.model, rank, TIED.world)
        for cap in (1, 4096, 2**20):  # every piece a chunk; a few pieces each; few chunks
            cut = chunks(layout, cap)
            for bucket in layout.my_buckets():
                mine = [c for c in cut if c.members == bucket.members]
                # each chunk in the model's order, the chunks cut from the bucket's end
                assert [n for c in reversed(mine) for n in c.pieces] == list(bucket.pieces)
                assert cap > 1 or len(mine) == len(bucket.pieces)
                orders = [c.order for c in cut]
                assert orders == sorted(orders, reverse=True)  # one order for every rank
        whole = chunks(layout)  # 25 MiB: one chunk per bucket, its pieces as they are
        assert [c.pieces for c in reversed(whole)] == [b.pieces for b in layout.my_buckets()]
