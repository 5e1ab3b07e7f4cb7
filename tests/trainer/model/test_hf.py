"""Exactness against transformers, in one process, and Hugging Face folders in and out.

Tiny random Llama / Mistral / Qwen2 models are made here (never the hub), saved with
`save_pretrained`, and read as a job's `spec.model.path`: the single-process reference
(trainer/model/decoder.py `GPT`, the yardstick every plan is held to) must give transformers' logits,
loss and every gradient; `save_hf` must give back the input's bytes and a folder
`from_pretrained` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
)

from malleus.errors import BadInput
from malleus.trainer.model import hf as hf_module
from malleus.trainer.model.decoder import (
    GPT,
    apply_rope,
    attention,
    join_pieces,
    param_specs,
    pieces,
    rope_tables,
    split_full,
)
from malleus.trainer.model.hf import (
    INDEX,
    hf_name,
    initial_full,
    initial_pieces,
    save_hf,
)
from tests.job.tiny_llama import SEQUENCE
from tests.trainer.hf_models import LLAMA3, hf_model, job_for, rel

CASES = {
    "gqa8-2_tied_llama3": dict(tie_word_embeddings=True, rope_scaling=LLAMA3),
    "mha4-4_untied": dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=101),
    "gqa8-2_untied_llama3_theta": dict(rope_scaling=LLAMA3 | {"rope_theta": 500000.0}),
    "mqa4-1_tied_odd_vocab": dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=61
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_equals_transformers_logits_loss_and_every_gradient(
    tmp_path: Path, name: str
) -> None:
    hf = hf_model(**CASES[name])
    hf.save_pretrained(tmp_path)
    job = job_for(tmp_path)
    ours = GPT.from_full(job.model, initial_full(job))
    x = torch.randint(0, job.model.vocab, (2, SEQUENCE), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    theirs = hf(input_ids=x).logits  # (B, T, V)
    mine = ours.logits(x)
    assert rel(mine, theirs) <= 1e-5
    loss = F.cross_entropy(theirs.flatten(0, 1), y.flatten())
    assert float(ours(x, y).detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
    loss.backward()
    ours(x, y).backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    mine_grads = {n: p.grad for n, p in ours.named_parameters()}
    assert len(mine_grads) == len(grads)  # every parameter, the tied head once
    for n, g in mine_grads.items():
        assert g is not None and float(g.abs().max()) > 0, n
        assert rel(g, grads[hf_name(n)]) <= 1e-5, n


@pytest.mark.parametrize(
    ("kind", "config"),
    [(MistralForCausalLM, {"sliding_window": None}), (Qwen2ForCausalLM, {})],
)
def test_mistral_and_qwen2_with_biases_match(tmp_path: Path, kind: type, config: dict) -> None:
    hf = hf_model(kind, **config)
    hf.save_pretrained(tmp_path)
    job = job_for(tmp_path)
    assert job.model.attention_bias == (kind is Qwen2ForCausalLM)
    ours = GPT.from_full(job.model, initial_full(job))
    x = torch.randint(0, job.model.vocab, (2, SEQUENCE), generator=torch.Generator().manual_seed(2))
    assert rel(ours.logits(x), hf(input_ids=x).logits) <= 1e-5


def test_sdpa_equals_the_explicit_attention_math() -> None:
    torch.manual_seed(0)
    B, T, C, h, kv, d = 2, 16, 32, 8, 2, 4
    x = torch.randn(B, T, C)
    wq, wk, wv = torch.randn(h * d, C), torch.randn(kv * d, C), torch.randn(kv * d, C)
    wo = torch.randn(C, h * d)
    rope = rope_tables(T, d)
    got = attention(x, wq, wk, wv, wo, d, rope)  # (B, T, C)

    q = apply_rope((x @ wq.T).view(B, T, h, d).transpose(1, 2), *rope)  # (B, h, T, d)
    k = apply_rope((x @ wk.T).view(B, T, kv, d).transpose(1, 2), *rope)  # (B, kv, T, d)
    v = (x @ wv.T).view(B, T, kv, d).transpose(1, 2)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    scores = q @ k.transpose(-1, -2) / d**0.5  # (B, h, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, h * d)  # (B, T, h*d)
    assert rel(got, y @ wo.T) <= 1e-6


class _SpyFile:
    """`safe_open` recording the elements every tensor read returns."""

    opener: ClassVar[Any] = None  # the real safe_open
    reads: ClassVar[list[int]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.file = _SpyFile.opener(*args, **kwargs)

    def __enter__(self) -> _SpyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.file.keys())

    def get_slice(self, name: str) -> Any:
        view, reads = self.file.get_slice(name), self.reads

        class View:
            def get_shape(self) -> list[int]:
                return view.get_shape()

            def __getitem__(self, key: Any) -> torch.Tensor:
                tensor = view[key]
                reads.append(tensor.numel())
                return tensor

        return View()


def test_each_rank_reads_only_its_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = hf_model(num_attention_heads=4, num_key_value_heads=1)  # kv heads < tp: replicated
    hf.save_pretrained(tmp_path)
    job = job_for(tmp_path, tp=4)
    every = pieces(job.model, 4)
    kv = [p.name for p in every if p.spec.name == "layers.0.attn.wk.weight"]
    assert kv == ["layers.0.attn.wk.weight@0"]  # one kv head, served to all 4 shards
    mine = [p for p in every if p.shard in (None, 1)]
    _SpyFile.opener, _SpyFile.reads = hf_module.safe_open, []
    monkeypatch.setattr(hf_module, "safe_open", _SpyFile)
    parts = initial_pieces(job, mine)
    assert sum(_SpyFile.reads) == sum(t.numel() for t in parts.values())  # no more was read
    monkeypatch.undo()
    assert parts["layers.1.attn.wq.weight@1"].shape == (16, 64)  # its 2 heads' rows, only
    assert parts["embed.weight@1"].shape == (97, 16)  # its hidden columns, only
    state = hf.state_dict()
    full = {s.name: state[hf_name(s.name)] for s in param_specs(job.model)}
    want = split_full(job.model, 4, full)
    assert all(torch.equal(parts[n], want[n]) for n in parts)
    whole = join_pieces(job.model, 4, initial_pieces(job, every))
    assert all(torch.equal(whole[n], full[n]) for n in full)


def test_load_and_save_with_zero_steps_is_bitwise_and_loads_in_transformers(
    tmp_path: Path,
) -> None:
    source, out = tmp_path / "in", tmp_path / "out"
    hf = hf_model(rope_scaling=LLAMA3)
    hf.save_pretrained(source)
    job = job_for(source)
    written = save_hf(job, initial_full(job), out, max_shard_bytes=60_000)
    assert (out / INDEX) in written and len(written) > 3  # sharded above the size, with index
    before = load_file(source / "model.safetensors")
    after: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        after |= load_file(file)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    back = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 97, (1, SEQUENCE))
    assert torch.equal(back(input_ids=x).logits, hf(input_ids=x).logits)
    start, again = initial_full(job), initial_full(job_for(out))  # a sharded folder reads too
    assert all(torch.equal(start[n], again[n]) for n in start)


def test_a_config_alone_is_no_random_start_but_seeded_weights_export_for_transformers(
    tmp_path: Path,
) -> None:
    hf_model(num_attention_heads=4, num_key_value_heads=2).config.save_pretrained(tmp_path)
    job = job_for(tmp_path)
    with pytest.raises(BadInput, match=r"holds config\.json but no weights"):
        initial_full(job)  # a folder without weights is refused, never a silent random start
    seeded = GPT.from_seed(job.model, job.tp, job.spec.training.seed)
    full = seeded.full_state()
    save_hf(job, full, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    x = torch.randint(0, 97, (1, SEQUENCE))
    assert rel(seeded.logits(x), back(input_ids=x).logits) <= 1e-5


def test_weights_that_disagree_with_config_json_are_refused(tmp_path: Path) -> None:
    hf_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128  # the safetensors hold 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    job = job_for(tmp_path)
    with pytest.raises(BadInput, match=r"mlp.gate_proj.weight is \(96, 64\), config.json says"):
        initial_full(job)
