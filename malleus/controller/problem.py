"""From a MalleusJob and measured rates to the planner's input (a PlanningProblem, DESIGN §4.1).

The memory model is derived from the model's sizes, per *logical shard* (one of the `tp` pieces
every layer is cut into), because the cost model multiplies it by the shards a GPU holds:

- state of one layer-shard: fp32 parameters, gradients and Adam's two moments, 16 bytes per
  parameter (4 + 4 + 4 + 4), over the layer's parameters / tp. A layer has 4 h^2 + 4 h attention
  weights and biases, `MLP_MATRICES` h x ffn MLP matrices plus biases, and two norms.
- activations kept for one layer-shard and one in-flight micro-batch:
  micro_batch x sequence x hidden x 34 bytes / tp. This is Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", eq. 1-4): `sbh(34 + 5as/h)` bytes per
  layer with 16-bit activations, divided by t with tensor and sequence parallelism. The `5as/h`
  term (the attention score matrix) is left out: fused attention (PyTorch SDPA, FlashAttention)
  does not keep it. An fp32 trainer keeps twice this; the fixed overhead absorbs small models.
- embedding (first stage) or head (last stage): vocab x hidden x 16 bytes / tp (vocab-parallel).
- fixed: CUDA context, NCCL buffers, allocator slack, logits (~2000 MB).
- capacity: `resources.gpuMemoryMiB`.

The job is read duck-typed (`job.spec.nodes`, `job.spec.parallelism.tp`, ...) so that the
operator's parsed CR, `malleus.jobspec.load_job` and tests all fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from malleus.planner.plan import Plan
from malleus.planner.problem import MemorySpec, PlanningProblem

from .decision import MIB

__all__ = [
    "ACTIVATION_BYTES",
    "FIXED_MB",
    "MLP_MATRICES",
    "STATE_BYTES_PER_PARAM",
    "build_problem",
    "clean_rates",
    "layer_parameters",
    "memory_model",
]

STATE_BYTES_PER_PARAM = 16
"""fp32 parameter + gradient + Adam first and second moments."""
ACTIVATION_BYTES = 34
"""Bytes per (token x hidden unit) kept per layer for the backward pass (Korthikanti et al.)."""
MLP_MATRICES = 3
"""h x ffn matrices in a block's MLP: 3 for SwiGLU (the presets' ffn sizes); 2 for a GPT MLP,
which this then over-estimates by a third of the MLP, on the safe side."""
FIXED_MB = 2000.0


def layer_parameters(cfg: Any) -> int:
    """Parameters of one transformer block (attention + MLP + two norms)."""
    h, f = cfg.hidden, cfg.ffn
    attention = 4 * h * h + 4 * h
    mlp = MLP_MATRICES * h * f + f + h
    norms = 4 * h
    return attention + mlp + norms


def memory_model(
    cfg: Any,
    *,
    tp: int,
    micro_batch_size: int,
    capacity_mib: float,
    fixed_mb: float = FIXED_MB,
) -> MemorySpec:
    """The per-logical-shard memory model of a model config (`layers, hidden, ffn, vocab, ...`)."""
    layer = layer_parameters(cfg) * STATE_BYTES_PER_PARAM / tp
    activation = micro_batch_size * cfg.sequence * cfg.hidden * ACTIVATION_BYTES / tp
    embedding = cfg.vocab * cfg.hidden * STATE_BYTES_PER_PARAM / tp
    return MemorySpec(
        capacity_mb=float(capacity_mib),
        layer_mb=layer / MIB,
        activation_mb=activation / MIB,
        embedding_mb=embedding / MIB,
        fixed_mb=fixed_mb,
    )


def clean_rates(rates: Mapping[int, float | None], world: int) -> dict[int, float | None]:
    """Rates the planner accepts: in-range ranks, >= 1.0 (a GPU measured a little faster than the
    reference is healthy), and None for anything not finite."""
    out: dict[int, float | None] = {}
    for rank, rate in rates.items():
        if not 0 <= rank < world:
            continue
        if rate is None or not math.isfinite(rate):
            out[rank] = None
        elif rate > 1.0:
            out[rank] = float(rate)
    return out


def _resolve_model(model_spec: Any) -> Any:
    """The model's sizes: `malleus.jobspec.resolve_model` for presets, else the spec itself."""
    try:
        from malleus.jobspec import resolve_model
    except ImportError:  # pragma: no cover - jobspec ships with the package
        return model_spec
    try:
        return resolve_model(model_spec)
    except (AttributeError, KeyError, TypeError):
        return model_spec  # already a resolved ModelConfig-like object


def build_problem(
    job: Any,
    rates: Mapping[int, float | None],
    previous_plan: Plan | None = None,
    *,
    model: Any | None = None,
    allow_exclusion: bool | None = None,
) -> PlanningProblem:
    """The PlanningProblem of `job` under `rates`, with the plan in force as `previous_plan`.

    `model` overrides the sizes resolved from `job.spec.model`. `allow_exclusion` (default: the
    job's stragglerPolicy) is passed on if PlanningProblem has such a field; it does not in v1, so
    the controller enforces it by refusing a plan that excludes usable GPUs. `parallelism.pp` is
    not passed: PlanningProblem has no way to pin the number of stages.
    """
    spec = job.spec
    cfg = model if model is not None else _resolve_model(spec.model)
    tp = spec.parallelism.tp
    training = spec.training
    micro_batches = training.global_batch_size // training.micro_batch_size
    resources = getattr(spec, "resources", None)
    capacity = getattr(resources, "gpu_memory_mib", None)
    memory = (
        memory_model(cfg, tp=tp, micro_batch_size=training.micro_batch_size, capacity_mib=capacity)
        if capacity
        else None
    )
    world = spec.nodes * spec.gpus_per_node
    fields: dict[str, Any] = {
        "nodes": spec.nodes,
        "gpus_per_node": spec.gpus_per_node,
        "rates": clean_rates(rates, world),
        "model": {"layers": cfg.layers, "tp": tp},
        "micro_batches": micro_batches,
        "memory": memory,
        "dp": getattr(spec.parallelism, "dp", None),
        "previous_plan": previous_plan,
    }
    if "allow_exclusion" in PlanningProblem.model_fields:  # pragma: no cover - not in v1
        if allow_exclusion is None:
            policy = getattr(spec, "straggler_policy", None)
            allow_exclusion = getattr(policy, "allow_exclusion", True)
        fields["allow_exclusion"] = allow_exclusion
    return PlanningProblem(**fields)
