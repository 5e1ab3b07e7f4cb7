"""Layout: places, P2P peers, piece roles, buckets and group order, derived from the plan alone."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from malleus.job import ModelConfig
from malleus.planner import PlanError, check_plan
from malleus.trainer.parallel.layout import Layout

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")

CFG = ModelConfig(layers=6, hidden=32, heads=4, ffn=64, vocab=256, sequence=16)
TIED = ModelConfig(6, 32, 4, 64, 256, 16, tied_embeddings=True)
HETERO = tc.plan(
    [(7, [([0, 1], (0, 2)), ([2], (2, 6))]), (5, [([4], (0, 4)), ([5, 6], (4, 6))])],
    excluded=[3, 7],
)


def layouts(plan, cfg=CFG, world=8):
    return [Layout.from_plan(plan, cfg, r, world) for r in range(world)]


def test_places_shards_and_micro_batch_offsets() -> None:
    L = layouts(HETERO)
    p1 = L[1].place
    assert (p1.pipeline, p1.stage, p1.index, p1.shards, p1.layers) == (
        0,
        0,
        1,
        range(1, 2),
        range(0, 2),
    )
    p2 = L[2].place
    assert p2.shards == range(0, 2) and p2.last and not p2.first
    p5 = L[5].place
    assert p5.micro_offset == 7 and p5.micro_batches == 5
    assert L[3].place is None and L[3].role == "excluded"
    assert L[0].total_micro_batches == 12


def test_peers_take_from_sender_i_mod_sender_size_both_ways() -> None:
    L = layouts(HETERO)
    # pipeline 0: [0, 1] -> [2]: rank 2 takes its input from rank 0; both senders get grads
    assert L[0].place.fwd_dsts == (2,) and L[1].place.fwd_dsts == ()
    assert L[2].place.fwd_src == 0
    assert L[2].place.bwd_dsts == (0, 1)
    assert L[0].place.bwd_src == 2 and L[1].place.bwd_src == 2
    # pipeline 1: [4] -> [5, 6]: rank 4 feeds both, takes its gradient from rank 5
    assert L[4].place.fwd_dsts == (5, 6)
    assert L[5].place.fwd_src == 4 and L[6].place.fwd_src == 4
    assert L[4].place.bwd_src == 5
    assert L[5].place.bwd_dsts == (4,) and L[6].place.bwd_dsts == ()


def test_roles_of_sharded_replicated_and_tied_pieces() -> None:
    roles = layouts(HETERO)[0].roles
    # shard 1 of layer 3: rank 2 (holds both shards) and rank 4 (a group of one)
    assert roles["layers.3.attn.wq.weight@1"].holders == (2, 4)
    # a replicated norm: every GPU holding the layer, but one contributor per pipeline
    assert roles["layers.0.attn_norm.weight"].holders == (0, 1, 4)
    assert roles["layers.0.attn_norm.weight"].contributors == (0, 4)
    assert roles["norm.weight"].contributors == (2, 5)
    tied = Layout.from_plan(HETERO, TIED, 0, 8).roles
    # tied embedding shard 1: first stages (1, 4) and last stages (2, 6) all add their part
    assert set(tied["embed.weight@1"].holders) == {1, 2, 4, 6}
    assert set(tied["embed.weight@1"].contributors) == {1, 2, 4, 6}


def test_every_piece_owned_once_and_held_pieces_per_rank() -> None:
    L = layouts(HETERO)
    owned = [n for lay in L for n in lay.owned()]
    assert len(owned) == len(set(owned)) == len(L[0].roles)
    assert L[3].held() == [] and L[3].owned() == []
    held4 = {p.name for p in L[4].held()}
    assert "embed.weight@0" in held4 and "embed.weight@1" in held4
    assert "layers.4.attn.wq.weight@0" not in held4 and "norm.weight" not in held4


def test_buckets_group_by_holder_set_in_layer_then_shard_order() -> None:
    lay = layouts(HETERO)[0]
    firsts = [b.pieces[0] for b in lay.buckets]
    assert firsts[0] == "embed.weight@0"
    for b in lay.buckets:
        holders = {tuple(sorted(lay.roles[n].holders)) for n in b.pieces}
        assert holders == {b.members}
    # one pipeline only: nothing to sum except a tied embedding across its first and last stage
    single = tc.plan([(12, [([0, 1], (0, 3)), ([2, 3], (3, 6))])], excluded=[4, 5, 6, 7])
    assert not any(b.collective for b in layouts(single)[0].buckets)
    coll = [b for b in Layout.from_plan(single, TIED, 0, 8).buckets if b.collective]
    assert [b.members for b in coll] == [(0, 2), (1, 3)]


def test_all_ranks_derive_the_same_group_order() -> None:
    L = layouts(HETERO)
    orders = {tuple(lay.member_sets()) for lay in L}
    assert len(orders) == 1
    order = orders.pop()
    assert order[:2] == ((0, 1), (5, 6))  # TP groups first, in stage order
    assert len(order) == len(set(order))


def test_rank_matrix_shows_the_plan() -> None:
    text = layouts(HETERO)[0].rank_matrix()
    # layer ranges inclusive, as every printer writes them (malleus.notation)
    assert (
        "pipeline 0 (7 micro-batches): ranks 0,1 layers 0-1 (1 shard each) | "
        "ranks 2 layers 2-5 (2 shards each)"
    ) in text
    assert "excluded ranks: 3,7" in text


def test_a_plan_for_another_tp_is_refused_before_any_layout() -> None:
    # The Trainer checks every plan against its job's problem first (the layout takes tp from
    # the plan): a tp-2 plan cannot run a tp-4 job.
    with pytest.raises(PlanError, match="tp: plan has 2, problem has 4"):
        check_plan(tc.small_job(tp=4).problem(), HETERO)
