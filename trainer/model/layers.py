"""The decoder's math, shared by the single-process reference (trainer/model/decoder.py `GPT`) and
the sharded stages (trainer/parallel/stage.py), which feed it their local heads / ffn columns.

Written to compute what transformers' Llama computes, in the same order where the order decides
the last bits (rotary tables, RMSNorm), so that a Hugging Face model's logits are matched
exactly in fp32; attention is `scaled_dot_product_attention` (flash attention on GPUs).

`layer_math(compiled)` hands a stage the three functions a layer runs between its collectives,
as they are or through `torch.compile` (`spec.training.compile`): compiled once per process and
shape, shared by every layer, since a layer's weights are arguments, not state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from malleus.job import ModelConfig
from malleus.job.presets import RopeScaling

__all__ = [
    "NORM_EPS",
    "LayerMath",
    "apply_rope",
    "attention",
    "layer_math",
    "model_rope",
    "rms_norm",
    "rope_tables",
    "swiglu",
]

NORM_EPS = 1e-5
"""The presets' RMSNorm epsilon (`ModelConfig.norm_eps` is the model's own)."""


def rms_norm(x: Tensor, weight: Tensor, eps: float = NORM_EPS) -> Tensor:
    """x / rms(x) * weight over the last dimension; bf16 input is normalised in float32 and
    cast back before the weight, as transformers' LlamaRMSNorm does."""  # (B, T, C)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _llama3(inv: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1's frequency scaling, as transformers computes it (`rope_type: llama3`)."""
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    sequence: int,
    head_dim: int,
    device: torch.device | None = None,
    *,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
) -> tuple[Tensor, Tensor]:
    """cos, sin of the rotary angles, each (T, head_dim/2), computed in the order transformers
    uses (so that a Hugging Face model's logits are matched to the last bits)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float()
    inv = 1.0 / (theta ** (steps / head_dim))  # (d/2,)
    if scaling is not None:
        inv = _llama3(inv, scaling)
    positions = torch.arange(sequence, dtype=torch.int64).float()
    angles = (positions[:, None] * inv[None, :]).to(device)  # (T, d/2)
    return angles.cos(), angles.sin()


def model_rope(cfg: ModelConfig, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """The rotary tables of a model config."""
    return rope_tables(
        cfg.sequence, cfg.head_dim, device, theta=cfg.rope_theta, scaling=cfg.rope_scaling
    )


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (first half, second half) pairs of each head by position."""  # (B, h, T, d)
    T, half = x.shape[-2], x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:T].to(x.dtype), sin[:T].to(x.dtype)  # (T, d/2)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def _project(x: Tensor, w: Tensor, b: Tensor | None, head_dim: int) -> Tensor:
    B, T, _ = x.shape  # (B, T, C)
    y = x @ w.T if b is None else x @ w.T + b  # (B, T, heads*d)
    return y.view(B, T, -1, head_dim).transpose(1, 2)  # (B, heads, T, d)


def attention(
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    head_dim: int,
    rope: tuple[Tensor, Tensor],
    bias: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Causal self-attention over the query heads whose rows wq holds (all, or a TP slice) and
    the key/value heads wk/wv hold for them (grouped-query attention: consecutive query heads
    share a kv head).

    Returns this slice's contribution to the output projection: summing it over the slices of
    a layer gives the full attention output.
    """
    B, T, _ = x.shape  # (B, T, C)
    bq, bk, bv = bias if bias is not None else (None, None, None)
    q = _project(x, wq, bq, head_dim)  # (B, h, T, d)
    k = _project(x, wk, bk, head_dim)  # (B, kv, T, d)
    v = _project(x, wv, bv, head_dim)  # (B, kv, T, d)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    gqa = k.shape[1] != q.shape[1]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, h, T, d)
    y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, h*d)
    return y @ wo.T  # (B, T, C)


def swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """SwiGLU MLP over the ffn columns w1/w3 hold; summing slices gives the full output."""
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T  # (B, T, C)


@dataclass(frozen=True)
class LayerMath:
    """What a layer computes between its collectives (and the final norm before the head)."""

    rms_norm: Callable[..., Tensor]
    attention: Callable[..., Tensor]
    swiglu: Callable[..., Tensor]


def layer_math(compiled: bool = False) -> LayerMath:
    """The functions as they are, or compiled (`_compiled`: once per process)."""
    return _compiled() if compiled else LayerMath(rms_norm, attention, swiglu)


@functools.cache
def _compiled() -> LayerMath:
    # Each function is compiled at its first call, once per input shape and dtype; the
    # collectives stay outside (trainer/parallel/stage.py), so nothing breaks the graphs.
    return LayerMath(torch.compile(rms_norm), torch.compile(attention), torch.compile(swiglu))
