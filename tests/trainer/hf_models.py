"""Tiny Hugging Face models for the tests: a random transformers model, the job that trains it,
and a relative error (tests/trainer/model/test_hf.py, test_hf_parallel.py, run/test_hf_cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from malleus.job import ResolvedJob
from tests.job.tiny_llama import SIZES, model_manifest

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def hf_model(kind: type = LlamaForCausalLM, seed: int = 0, **config: Any) -> torch.nn.Module:
    """A tiny random transformers model (weights drawn wider than the default 0.02, so that
    attention is not uniform and every gradient matters)."""
    sizes = SIZES | dict(initializer_range=0.1, rms_norm_eps=1e-6)
    configs = {LlamaForCausalLM: LlamaConfig, MistralForCausalLM: MistralConfig}
    configs[Qwen2ForCausalLM] = Qwen2Config
    torch.manual_seed(seed)
    model = kind(configs[kind](**(sizes | config))).float()
    with torch.no_grad():  # norms and biases away from their 1 / 0 init: they must be read too
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def job_for(folder: Path, tp: int = 2, **spec: Any) -> ResolvedJob:
    manifest = model_manifest(folder, tp=tp)
    manifest["spec"].update(spec)
    return ResolvedJob.load(manifest).check()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
