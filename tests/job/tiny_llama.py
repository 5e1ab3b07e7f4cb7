"""The tiny Hugging Face Llama of the `spec.model.path` tests, and a job that reads it.

Torch-free (tests/job reads config.json without torch or transformers): `SIZES` are the model's
sizes as transformers' config classes take them (the trainer tests make the model with them and
`save_pretrained` it), `LLAMA` is its config.json as transformers writes it, `write_config`
writes one, and `model_manifest` is examples/tiny-cpu.yaml reading a model folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = ["EXAMPLE", "LLAMA", "SEQUENCE", "SIZES", "model_manifest", "write_config"]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
SEQUENCE = 16

SIZES: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}
"""GQA 8q/2kv, head_dim 8: `LlamaConfig(**SIZES)` (Mistral and Qwen2 take them too)."""

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **SIZES,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 500000.0,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
}
"""The model's config.json, tied and with llama3 rope scaling."""


def write_config(folder: Path, config: Mapping[str, Any] = LLAMA) -> Path:
    """`config` as `folder`/config.json; returns `folder`."""
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def model_manifest(folder: Path, *, tp: int = 2, **model: Any) -> dict[str, Any]:
    """examples/tiny-cpu.yaml with spec.model.path `folder` (sequence `SEQUENCE`, then the
    `model` fields given), tp `tp` and synthetic data."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["model"] = {"path": str(folder), "sequence": SEQUENCE} | model
    manifest["spec"]["parallelism"] = {"tp": tp}
    manifest["spec"]["training"]["dataset"] = "synthetic"
    return manifest
