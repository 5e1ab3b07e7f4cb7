"""The per-piece AdamW against torch's, the LR schedule, and the plan-independent data order."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from malleus.trainer.data.samples import (
    CORPUS_PATH,
    CorpusSource,
    SyntheticSource,
    make_source,
    micro_batch,
    sample_index,
)
from malleus.trainer.parallel.optim import BETAS, EPS, PieceAdamW, clip_coefficient, lr_at


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    lrs = [lr_at(s, 1.0, 4, 20) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    assert lr_at(0, 1.0, 0, 10) == 1.0


def test_clip_coefficient_matches_torch() -> None:
    g = torch.full((4,), 3.0)
    p = torch.zeros(4, requires_grad=True)
    p.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_([p], 1.0))
    assert torch.allclose(p.grad, g * clip_coefficient(norm, 1.0))
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(9.0, 0.0) == 1.0


def test_piece_adamw_equals_torch_adamw_split_or_whole() -> None:
    torch.manual_seed(0)
    w0, b0 = torch.randn(6, 4), torch.randn(4)
    ref_w, ref_b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref = torch.optim.AdamW(
        [{"params": [ref_w], "weight_decay": 0.1}, {"params": [ref_b], "weight_decay": 0.0}],
        lr=1e-2,
        betas=BETAS,
        eps=EPS,
        foreach=False,
    )
    pieces = {"w@0": w0[:3].clone(), "w@1": w0[3:].clone(), "b": b0.clone()}
    for t in pieces.values():
        t.requires_grad_()
    mine = PieceAdamW(pieces, {"w@0": True, "w@1": True, "b": False}, weight_decay=0.1)
    for step in range(5):
        gw, gb = torch.randn(6, 4), torch.randn(4)
        lr = 1e-2 * (step + 1)
        for g in ref.param_groups:
            g["lr"] = lr
        ref_w.grad, ref_b.grad = gw * 0.5, gb * 0.5  # the clipped gradient
        ref.step()
        pieces["w@0"].grad, pieces["w@1"].grad, pieces["b"].grad = gw[:3], gw[3:], gb
        mine.step(lr, grad_scale=0.5)
    assert torch.allclose(torch.cat([pieces["w@0"], pieces["w@1"]]), ref_w, atol=1e-6)
    assert torch.allclose(pieces["b"], ref_b, atol=1e-6)
    assert mine.state["w@1"].step == 5
    st = ref.state[ref_w]
    assert torch.allclose(mine.state["w@0"].exp_avg, st["exp_avg"][:3])
    assert torch.allclose(mine.state["w@1"].exp_avg_sq, st["exp_avg_sq"][3:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_piece_adamw_foreach_gives_the_same_bits(dtype: torch.dtype) -> None:
    """The all-pieces-at-once update (what a GPU runs) is the piece-by-piece one, bit for bit,
    with clipping, decayed and undecayed pieces and a piece without a gradient in one step;
    and stays within float rounding of torch's own foreach AdamW."""
    torch.manual_seed(1)
    start = {"w@0": torch.randn(5, 3), "w@1": torch.randn(7), "b": torch.randn(3)}
    decay = {"w@0": True, "w@1": True, "b": False}
    copies = {
        way: {n: t.to(dtype).clone().requires_grad_() for n, t in start.items()}
        for way in ("loop", "foreach", "torch")
    }
    loop = PieceAdamW(copies["loop"], decay, 0.1, foreach=False)
    each = PieceAdamW(copies["foreach"], decay, 0.1, foreach=True)
    ref_params = copies["torch"]
    ref = torch.optim.AdamW(
        [
            {"params": [ref_params["w@0"], ref_params["w@1"]], "weight_decay": 0.1},
            {"params": [ref_params["b"]], "weight_decay": 0.0},
        ],
        lr=1e-2, betas=BETAS, eps=EPS, foreach=True,
    )  # fmt: skip
    for step in range(6):
        grads = {n: torch.randn_like(t).to(dtype) for n, t in start.items()}
        lr, scale = 1e-2 * (step + 1), (0.5 if step % 2 else 1.0)
        for g in ref.param_groups:
            g["lr"] = lr
        for way in ("loop", "foreach", "torch"):
            for n, p in copies[way].items():
                skip = step == 3 and n == "b"  # a piece without a gradient this step
                p.grad = None if skip else grads[n] * (scale if way == "torch" else 1.0)
        loop.step(lr, grad_scale=scale)
        each.step(lr, grad_scale=scale)
        ref.step()
    for n in start:
        assert torch.equal(copies["loop"][n], copies["foreach"][n]), n
        assert torch.equal(loop.state[n].exp_avg, each.state[n].exp_avg), n
        assert torch.equal(loop.state[n].exp_avg_sq, each.state[n].exp_avg_sq), n
        assert loop.state[n].step == each.state[n].step
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        assert torch.allclose(copies["foreach"][n], copies["torch"][n], atol=tol, rtol=0), n
    assert each.state["b"].step == 5 and each.state["w@0"].step == 6


def test_sample_order_is_a_property_of_the_step() -> None:
    # micro-batch j of step s holds samples s*G + j*b .. + b-1 whoever runs it
    assert sample_index(3, 2, 1, global_batch=12, micro_batch=2) == 3 * 12 + 2 * 2 + 1
    src = make_source("tiny-corpus", 16, 256, seed=5)
    x1, y1 = micro_batch(src, 3, 2, 12, 2)
    x2, y2 = micro_batch(make_source("tiny-corpus", 16, 256, seed=5), 3, 2, 12, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (2, 16) and torch.equal(x1[:, 1:], y1[:, :-1])
    whole, _ = micro_batch(src, 3, 0, 12, 12)  # the step as one batch: the same rows
    assert torch.equal(whole[4:6], x1)
    x3, _ = micro_batch(make_source("tiny-corpus", 16, 256, seed=6), 3, 2, 12, 2)
    assert not torch.equal(x1, x3)


def test_corpus_is_byte_text_of_useful_size() -> None:
    data = CORPUS_PATH.read_bytes()
    assert 100_000 <= len(data) <= 300_000
    assert data.decode("ascii").count(". ") > 1000
    src = CorpusSource(64, seed=1)
    starts = {int(src.sample(i)[0]) for i in range(200)}
    assert len(starts) > 20  # windows spread over the corpus


def test_synthetic_samples_repeat_a_motif() -> None:
    src = SyntheticSource(32, 256, seed=1)
    s = src.sample(7)
    assert s.shape == (33,) and torch.equal(s, src.sample(7))
    period = next(p for p in range(2, 9) if torch.equal(s[p:], s[:-p]))
    assert 2 <= period <= 8
    assert int(s.max()) < 256


def test_unknown_dataset_and_small_vocab_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        make_source("imagenet", 16, 256, 1)
    with pytest.raises(ValueError, match="vocab >= 256"):
        make_source("tiny-corpus", 16, 100, 1)
    assert math.isfinite(float(make_source("synthetic", 16, 100, 1).sample(0).max()))
