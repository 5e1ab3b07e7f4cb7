"""Named model sizes and named GPU profiles: the one place both are declared.

The CRD's enums and CEL preset tables, the planner's memory model, the trainer's model and its
emulated clock all read these (tests keep the CRD equal to them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "GPU_PROFILES",
    "PRESETS",
    "GpuProfile",
    "ModelConfig",
    "Preset",
    "RopeScaling",
    "estimate_layer_shard_seconds",
]

Preset = Literal["tiny", "small", "gpt-125m", "llama-7b", "llama-70b"]
GpuProfile = Literal["h100-llama-70b-tp8", "h100-llama-13b-tp4", "a100-llama-7b-tp1", "cpu-tiny"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Hugging Face ``rope_type: llama3``): long wavelengths
    are divided by `factor`, short ones kept, the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Resolved transformer sizes (vocab 256 = bytes, the tiny corpus's tokenization).

    The fields after `tied_embeddings` default to the presets' multi-head attention (one K/V
    head per query head, head size hidden/heads, rotary base 10000, RMSNorm eps 1e-5); a
    Hugging Face config.json sets them all (`malleus.job.hf`).
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    sequence: int
    tied_embeddings: bool = False
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 = `heads`."""
    head_dim: int = 0
    """Width of one attention head; 0 = hidden // heads (Mistral-style configs may differ)."""
    rope_theta: float = 10000.0
    """Rotary base wavelength."""
    rope_scaling: RopeScaling | None = None
    """Llama 3 frequency scaling; None = plain rotary positions."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2); never on the output projection."""

    def __post_init__(self) -> None:
        # Normalise the "same as" defaults so that equal models compare (and hash) equal.
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // max(self.heads, 1))

    @property
    def q_width(self) -> int:
        """Rows of the query projection: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Rows of the key (and of the value) projection: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim


PRESETS: Mapping[str, ModelConfig] = MappingProxyType(
    {
        "tiny": ModelConfig(layers=8, hidden=64, heads=4, ffn=128, vocab=256, sequence=64),
        "small": ModelConfig(layers=12, hidden=256, heads=8, ffn=688, vocab=256, sequence=128),
        "gpt-125m": ModelConfig(
            layers=12, hidden=768, heads=12, ffn=3072, vocab=50304, sequence=1024
        ),
        "llama-7b": ModelConfig(
            layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, sequence=4096
        ),
        "llama-70b": ModelConfig(
            layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000, sequence=4096
        ),
    }
)
"""Named model sizes; the CRD's CEL rules carry their heads and hidden (a test keeps them equal)."""


def estimate_layer_shard_seconds(
    *,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    seq: int,
    micro_batch: int,
    tp: int,
    tflops: float,
    gated_mlp: bool = True,
) -> tuple[float, float]:
    """(forward_s, backward_s) of one of a layer's `tp` shards for one micro-batch.

    FLOPs per token of a transformer layer: 2 x its matmul parameters (Q, O: h^2 each; K, V:
    h^2 * kv/heads each; MLP: 3 h f gated, 2 h f plain) plus 4 x seq x h for QK^T and AV.
    Divided by `tp` and by the *achievable* dense throughput (not the datasheet peak); the
    backward is twice the forward (gradients w.r.t. inputs and weights).
    """
    attn_params = 2 * hidden * hidden + 2 * hidden * hidden * kv_heads // heads
    mlp_params = (3 if gated_mlp else 2) * hidden * ffn
    per_token = 2 * (attn_params + mlp_params) + 4 * seq * hidden
    forward = per_token * seq * micro_batch / tp / (tflops * 1e12)
    return forward, 2 * forward


# Per-layer-shard (forward_s, backward_s) for one micro-batch on a healthy GPU, estimated as
# FLOPs / achievable TFLOP/s (`estimate_layer_shard_seconds`): H100 SXM bf16 ~400 TFLOP/s
# achieved (~40% of the 989 peak), A100 bf16 ~150 (~48% of 312); sequence 4096, micro-batch 1.
# "cpu-tiny" is not a GPU: it is sized for the tiny CPU model so that 8+ ranks on 2 cores spend
# their time waiting, not computing (the real math of a tiny layer takes well under 1 ms).
GPU_PROFILES: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "h100-llama-70b-tp8": estimate_layer_shard_seconds(
            hidden=8192, ffn=28672, heads=64, kv_heads=8, seq=4096, micro_batch=1, tp=8, tflops=400
        ),
        "h100-llama-13b-tp4": estimate_layer_shard_seconds(
            hidden=5120, ffn=13824, heads=40, kv_heads=40, seq=4096, micro_batch=1, tp=4, tflops=400
        ),
        "a100-llama-7b-tp1": estimate_layer_shard_seconds(
            hidden=4096, ffn=11008, heads=32, kv_heads=32, seq=4096, micro_batch=1, tp=1, tflops=150
        ),
        "cpu-tiny": (0.010, 0.020),
    }
)
