"""The planner's memory model of a job, derived from the model's sizes.

The memory model is derived from the model's sizes, per *logical shard* (one of the `tp` pieces
every layer is cut into), because the cost model multiplies it by the shards a GPU holds:

- state of one layer-shard: fp32 parameters, gradients and Adam's two moments, 16 bytes per
  parameter (4 + 4 + 4 + 4), over the layer's parameters / tp. A layer has 2 h (q + kv) + 4 h
  attention weights and biases (q = heads x head_dim, kv = kv_heads x head_dim: 4 h^2 without
  grouped-query attention), `MLP_MATRICES` h x ffn MLP matrices plus biases, and two norms.
- activations kept for one layer-shard and one in-flight micro-batch:
  micro_batch x sequence x hidden x 34 bytes / tp. This is Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", eq. 1-4): `sbh(34 + 5as/h)` bytes per
  layer with 16-bit activations, divided by t with tensor and sequence parallelism. The `5as/h`
  term (the attention score matrix) is left out: fused attention (PyTorch SDPA, FlashAttention)
  does not keep it. An fp32 trainer keeps twice this; the fixed overhead absorbs small models.
- embedding (first stage) or head (last stage): vocab x hidden x 16 bytes / tp (vocab-parallel).
- fixed: CUDA context, NCCL buffers, allocator slack, logits (~2000 MB).
- capacity: `resources.gpuMemoryMiB`.

"""

from __future__ import annotations

from malleus.planner.problem import MemorySpec

from .presets import ModelConfig

__all__ = [
    "ACTIVATION_BYTES",
    "FIXED_MB",
    "MIB",
    "MLP_MATRICES",
    "STATE_BYTES_PER_PARAM",
    "decoder_parameters",
    "layer_parameters",
    "memory_model",
    "model_parameters",
]

MIB = 1 << 20
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter + gradient + Adam first and second moments."""
ACTIVATION_BYTES = 34
"""Bytes per (token x hidden unit) kept per layer for the backward pass (Korthikanti et al.)."""
MLP_MATRICES = 3
"""h x ffn matrices in a block's MLP: 3 for SwiGLU (the presets' ffn sizes); 2 for a GPT MLP,
which this then over-estimates by a third of the MLP, on the safe side."""
FIXED_MB = 2000.0


def layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (attention + MLP + two norms)."""
    h, f = cfg.hidden, cfg.ffn
    # q and o: h x heads*head_dim each; k and v: h x kv_heads*head_dim each (smaller with GQA)
    attention = 2 * h * cfg.q_width + 2 * h * cfg.kv_width + 4 * h
    mlp = MLP_MATRICES * h * f + f + h
    norms = 4 * h
    return attention + mlp + norms


def memory_model(
    cfg: ModelConfig,
    *,
    tp: int,
    micro_batch_size: int,
    capacity_mib: float,
    fixed_mb: float = FIXED_MB,
) -> MemorySpec:
    """The per-logical-shard memory model of a model config (`layers, hidden, ffn, vocab, ...`)."""
    # With fewer kv heads than tp each shard holds a whole (replicated) kv head: tp of them.
    replicated = 2 * cfg.hidden * cfg.head_dim * max(tp - cfg.kv_heads, 0)
    layer = (layer_parameters(cfg) + replicated) * STATE_BYTES_PER_PARAM / tp
    activation = micro_batch_size * cfg.sequence * cfg.hidden * ACTIVATION_BYTES / tp
    embedding = cfg.vocab * cfg.hidden * STATE_BYTES_PER_PARAM / tp
    return MemorySpec(
        capacity_mb=float(capacity_mib),
        layer_mb=layer / MIB,
        activation_mb=activation / MIB,
        embedding_mb=embedding / MIB,
        fixed_mb=fixed_mb,
    )


def model_parameters(cfg: ModelConfig) -> int:
    """Parameters of the whole model (blocks, embedding and head) as the memory model counts
    them: an estimate on the safe side (`layer_parameters` counts biases and norms the decoder
    may not have); `decoder_parameters` is the exact count."""
    head = 0 if cfg.tied_embeddings else cfg.vocab * cfg.hidden
    return cfg.layers * layer_parameters(cfg) + cfg.vocab * cfg.hidden + head


def decoder_parameters(cfg: ModelConfig) -> int:
    """Exactly the parameters the trainer's decoder holds (trainer/model/decoder.py
    `param_specs`; a test holds the two equal): per block q, k, v, o, the SwiGLU's three
    matrices, two RMSNorm weights and Qwen2's q/k/v biases; the embedding, the final norm and
    the head unless tied."""
    h = cfg.hidden
    block = 2 * h * cfg.q_width + 2 * h * cfg.kv_width + 3 * h * cfg.ffn + 2 * h
    if cfg.attention_bias:
        block += cfg.q_width + 2 * cfg.kv_width
    head = 0 if cfg.tied_embeddings else cfg.vocab * h
    return cfg.layers * block + cfg.vocab * h + h + head
