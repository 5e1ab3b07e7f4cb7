"""`spec.model.path`: a Hugging Face config.json read and judged without torch.

Configs are written here as transformers writes them (plain JSON: this side never imports
torch or transformers); what the trainer cannot compute exactly is refused naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from malleus.errors import BadInput
from malleus.job import ResolvedJob
from malleus.job.hf import model_config
from malleus.job.memory import memory_model
from malleus.job.presets import ModelConfig, RopeScaling
from tests.job.tiny_llama import EXAMPLE, LLAMA, model_manifest, write_config


def job(folder: Path, **model: Any) -> ResolvedJob:
    return ResolvedJob.load(model_manifest(folder, **model))


def test_a_llama_config_resolves_every_field(tmp_path: Path) -> None:
    cfg = job(write_config(tmp_path, LLAMA)).check().model
    assert cfg == ModelConfig(
        layers=2,
        hidden=64,
        heads=8,
        ffn=96,
        vocab=97,
        sequence=16,
        tied_embeddings=True,
        kv_heads=2,
        head_dim=8,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8),
        norm_eps=1e-6,
    )


def test_transformers_4_rope_fields_are_read_too() -> None:
    old = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    old |= {"rope_theta": 1e6, "rope_scaling": None}
    cfg = model_config(old, 16)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            "config.json architectures: ['GPT2LMHeadModel'] (model_type 'gpt2'); supported: "
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        (
            {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
            "architectures: ['MixtralForCausalLM']",
        ),
        (
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8},
            "sliding_window: 8 < sequence(16); supported: no sliding window",
        ),
        ({"attention_bias": True}, "attention_bias: Llama's attention biases include o_proj's"),
        ({"mlp_bias": True}, "mlp_bias: MLP biases are not supported"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu'; supported: silu"),
        ({"num_local_experts": 8}, "num_experts: mixture-of-experts layers are not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            "rope_parameters: rope_type 'yarn'; supported: default, llama3",
        ),
        ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor: rotary positions on part"),
        ({"vocab_size": "many"}, "vocab_size: 'many' is not an integer >= 2"),
    ],
)
def test_what_the_trainer_cannot_compute_is_refused_naming_the_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadInput) as caught:
        job(write_config(tmp_path, LLAMA | change))
    assert [f.path for f in caught.value.faults] == ["spec.model.path"]
    assert message in str(caught.value)


def test_mistral_without_a_window_and_qwen2_with_biases_are_accepted(tmp_path: Path) -> None:
    mistral = LLAMA | {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert not job(write_config(tmp_path, mistral | {"sliding_window": None})).model.attention_bias
    assert job(write_config(tmp_path, mistral | {"sliding_window": 4096})).check()
    qwen = LLAMA | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    assert job(write_config(tmp_path, qwen | {"use_sliding_window": False})).model.attention_bias


def test_pickled_weights_are_refused_not_replaced_by_random_ones(tmp_path: Path) -> None:
    folder = write_config(tmp_path, LLAMA)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(BadInput, match=r"holds \*\.bin weights and no \*\.safetensors"):
        job(folder)
    (folder / "model.safetensors").write_bytes(b"")  # safetensors present: those are read
    assert job(folder).check()


def test_a_sequence_longer_than_the_model_knows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"spec\.model\.sequence: 64 exceeds max_position_emb"):
        job(write_config(tmp_path, LLAMA), sequence=64)


def test_sizes_beside_the_path_must_agree_with_config_json(tmp_path: Path) -> None:
    folder = write_config(tmp_path, LLAMA)
    agreeing = dict(layers=2, hidden=64, heads=8, kvHeads=2, ffn=96, vocab=97)
    assert job(folder, **agreeing, tiedEmbeddings=True).check()
    with pytest.raises(BadInput) as caught:
        job(folder, **agreeing | {"kvHeads": 8, "layers": 3})
    assert [f.path for f in caught.value.faults] == ["spec.model.layers", "spec.model.kvHeads"]
    assert "3 disagrees with" in str(caught.value)
    untied = write_config(tmp_path, LLAMA | {"tie_word_embeddings": False})
    with pytest.raises(BadInput, match=r"spec\.model\.tiedEmbeddings: true disagrees"):
        job(untied, tiedEmbeddings=True)


def test_where_the_folder_is_unreadable_the_stated_sizes_are_the_model(tmp_path: Path) -> None:
    # The operator's case: the folder lives on the pods' volume.
    missing = tmp_path / "elsewhere"
    with pytest.raises(BadInput) as caught:
        job(missing)
    assert "config.json is not readable here, so the sizes must be stated" in str(caught.value)
    stated = job(missing, layers=2, hidden=64, heads=8, kvHeads=2, ffn=96, vocab=97).check()
    assert (stated.model.kv_heads, stated.model.head_dim) == (2, 8)


def test_kv_heads_and_tp_must_tile(tmp_path: Path) -> None:
    config = LLAMA | {"num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 8}
    with pytest.raises(BadInput, match=r"spec\.model\.kvHeads: kvHeads\(6\) and tp\(4\)"):
        manifest = yaml.safe_load(EXAMPLE.read_text())
        manifest["spec"]["model"] = {"path": str(write_config(tmp_path, config)), "sequence": 16}
        manifest["spec"]["parallelism"] = {"tp": 4}
        ResolvedJob.load(manifest).check()


def test_grouped_query_attention_shrinks_the_memory_model() -> None:
    full = ModelConfig(layers=2, hidden=4096, heads=32, ffn=11008, vocab=32000, sequence=4096)
    gqa = ModelConfig(2, 4096, 32, 11008, 32000, 4096, kv_heads=8)
    mha_mb = memory_model(full, tp=8, micro_batch_size=1, capacity_mib=80000).layer_mb
    gqa_mb = memory_model(gqa, tp=8, micro_batch_size=1, capacity_mib=80000).layer_mb
    saved = 2 * 4096 * 4096 * (1 - 8 / 32) * 16 / 8 / 2**20  # K and V, 16 bytes, per shard
    assert mha_mb - gqa_mb == pytest.approx(saved)
    # With fewer kv heads than tp each shard holds a whole kv head (replicated).
    mqa = ModelConfig(2, 4096, 32, 11008, 32000, 4096, kv_heads=1)
    kv_shard = 2 * 4096 * 128 * 16 / 2**20
    rest = memory_model(full, tp=8, micro_batch_size=1, capacity_mib=80000).layer_mb
    rest -= 2 * 4096 * 4096 * 16 / 8 / 2**20
    mqa_mb = memory_model(mqa, tp=8, micro_batch_size=1, capacity_mib=80000).layer_mb
    assert mqa_mb == pytest.approx(rest + kv_shard)
