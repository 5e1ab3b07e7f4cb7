"""Pieces, initialisation and the model math, in one process."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from malleus.job import BadInput, ModelConfig
from malleus.trainer.model.decoder import (
    GPT,
    attention,
    init_piece,
    join_pieces,
    param_specs,
    pieces,
    rope_tables,
    split_full,
    swiglu,
)

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")

CFG = ModelConfig(layers=2, hidden=32, heads=4, ffn=64, vocab=256, sequence=16)
TP = 4


def test_pieces_cover_every_parameter_once_in_layer_then_shard_order() -> None:
    names = [p.name for p in pieces(CFG, TP)]
    assert len(names) == len(set(names))
    assert names[:4] == [f"embed.weight@{s}" for s in range(4)]
    layer0 = [n for n in names if n.startswith("layers.0.")]
    # sharded pieces shard by shard, then the replicated norms
    assert layer0[:7] == [
        f"layers.0.{w}.weight@0"
        for w in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w3", "mlp.w2")
    ]
    assert layer0[-2:] == ["layers.0.attn_norm.weight", "layers.0.mlp_norm.weight"]
    assert names[-5:] == ["norm.weight"] + [f"head.weight@{s}" for s in range(4)]
    full = {s.name for s in param_specs(CFG)}
    assert {n.split("@")[0] for n in names} == full


def test_split_and_join_are_inverse_and_cut_the_documented_dims() -> None:
    parts = {p.name: init_piece(p, TP, 7) for p in pieces(CFG, TP)}
    full = join_pieces(CFG, TP, parts)
    assert full["layers.1.attn.wq.weight"].shape == (32, 32)
    assert parts["layers.1.attn.wq.weight@2"].shape == (8, 32)  # one head's rows
    assert parts["layers.1.attn.wo.weight@2"].shape == (32, 8)  # its columns of wo
    assert parts["layers.1.mlp.w2.weight@3"].shape == (32, 16)  # ffn rows of w2
    assert parts["embed.weight@1"].shape == (256, 8)  # hidden columns
    back = split_full(CFG, TP, full)
    assert back.keys() == parts.keys()
    assert all(torch.equal(back[k], parts[k]) for k in parts)


def test_initialisation_is_per_piece_and_deterministic() -> None:
    p = next(x for x in pieces(CFG, TP) if x.name == "layers.1.mlp.w1.weight@3")
    assert torch.equal(init_piece(p, TP, 1), init_piece(p, TP, 1))
    assert not torch.equal(init_piece(p, TP, 1), init_piece(p, TP, 2))
    other = next(x for x in pieces(CFG, TP) if x.name == "layers.1.mlp.w1.weight@2")
    assert not torch.equal(init_piece(p, TP, 1), init_piece(other, TP, 1))
    norm = next(x for x in pieces(CFG, TP) if x.name == "norm.weight")
    assert torch.equal(init_piece(norm, TP, 1), torch.ones(32))


def test_attention_and_mlp_split_into_shards_sum_to_the_whole() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)  # (B, T, C)
    w = {n: torch.randn(32, 32) * 0.2 for n in ("q", "k", "v", "o")}
    rope = rope_tables(16, 8)
    whole = attention(x, w["q"], w["k"], w["v"], w["o"], 8, rope)
    parts = sum(
        attention(x, w["q"][r], w["k"][r], w["v"][r], w["o"][:, r], 8, rope)
        for r in (slice(0, 16), slice(16, 32))
    )
    assert torch.allclose(whole, parts, atol=1e-5)
    w1, w3, w2 = torch.randn(64, 32), torch.randn(64, 32), torch.randn(32, 64)
    halves = sum(swiglu(x, w1[r], w3[r], w2[:, r]) for r in (slice(0, 32), slice(32, 64)))
    assert torch.allclose(swiglu(x, w1, w3, w2), halves, atol=1e-4)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT.from_seed(CFG, TP, 3)
    x = torch.randint(0, 256, (1, 16))
    y = torch.randint(0, 256, (1, 16))
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % 256
    rope = (model.rope_cos, model.rope_sin)
    a = model.layers[0](model.embed(x), rope)
    b = model.layers[0](model.embed(changed), rope)
    assert torch.allclose(a[:, :-1], b[:, :-1]) and not torch.allclose(a[:, -1], b[:, -1])
    assert model(x, y).item() == pytest.approx(5.545, abs=0.1)  # ~ln(256) at init


def test_tied_model_shares_the_embedding_and_saves_it_once() -> None:
    cfg = ModelConfig(2, 32, 4, 64, 256, 16, tied_embeddings=True)
    model = GPT.from_seed(cfg, 2, 1)
    assert model.head.weight is model.embed.weight
    assert "head.weight" not in model.full_state()
    assert all(not p.name.startswith("head.") for p in pieces(cfg, 2))


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (dict(hidden=30, heads=4), "divisible by spec.model.heads"),
        (dict(heads=6, hidden=36), "spec.parallelism.tp must divide spec.model.heads"),
        (dict(ffn=66), "ffn(66) is not divisible by tp(4)"),
        (dict(hidden=12, heads=4), "must be even"),
    ],
)
def test_shapes_the_model_cannot_cut_are_refused_by_the_job(shape: dict, message: str) -> None:
    # The model code assumes what `ResolvedJob.faults` guarantees: no job with these runs.
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        tc.small_job(1, 4, tp=4, model=shape)
