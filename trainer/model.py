"""The decoder (LLaMA-style: RMSNorm, rotary positions, SwiGLU) and its logical shards.

Every parameter has a canonical *full* name (`layers.3.attn.wq.weight`), the same whatever the
plan. Sharded parameters are cut into `tp` logical shards along one dimension and stored as
*pieces* named `full@shard`; replicated parameters (the RMSNorm weights) are one piece named
like the full tensor. A GPU holding 2^k shards holds 2^k pieces of each sharded weight and
concatenates them to compute. Pieces are what the optimizer, gradient sync, checkpoints and
migration handle, so none of them depends on the plan.

Ownership of the ends (chosen so that tied and untied heads shard alike):
- `embed.weight` (V, C) and `head.weight` (V, C) are split by *hidden* (dim 1) into tp shards:
  the embedding's output columns are gathered across the TP group, the head's partial logits
  are summed across it. With tied embeddings the head is `embed.weight`, held by the first and
  the last stage, whose gradients are summed like any data-parallel replica's.
- `norm.weight` (final RMSNorm) lives on every GPU of the last stage; `layers.L.*_norm.weight`
  on every GPU holding layer L. Their gradients are identical inside a TP group and summed
  across pipelines (grad_sync.py).

The math (`rms_norm`, `attention`, `swiglu`) is shared by the single-process reference `GPT`
and the sharded stages, which feed it their local heads / ffn columns.

Sizes come from `malleus.job.ModelConfig` and the number of logical shards from the job's `tp`
(`ResolvedJob.model`, `ResolvedJob.tp`); the shapes are judged there (`ResolvedJob.faults`), so
the code here assumes heads, ffn and hidden divide by `tp` and the head size is even.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from malleus.job import ModelConfig

__all__ = [
    "GPT",
    "NORM_EPS",
    "ParamSpec",
    "Piece",
    "apply_rope",
    "attention",
    "init_piece",
    "join_pieces",
    "param_specs",
    "pieces",
    "rms_norm",
    "rope_tables",
    "split_full",
    "swiglu",
]

NORM_EPS = 1e-5
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ParamSpec:
    """A full (logical) parameter: shape, the dimension cut into tp shards, init and decay."""

    name: str
    shape: tuple[int, ...]
    split: int | None  # None: replicated (one piece, the full tensor)
    std: float | None  # None: ones (norm weights)
    layer: int | None  # transformer layer, None for embed / norm / head

    @property
    def decay(self) -> bool:
        """Weight decay on matrices only (nanoGPT's rule), never on norm weights."""
        return len(self.shape) >= 2


@dataclass(frozen=True)
class Piece:
    """One logical shard of a parameter (or a replicated parameter): the unit of state."""

    spec: ParamSpec
    shard: int | None

    @property
    def name(self) -> str:
        return self.spec.name if self.shard is None else f"{self.spec.name}@{self.shard}"

    def shape(self, tp: int) -> tuple[int, ...]:
        if self.spec.split is None:
            return self.spec.shape
        shape = list(self.spec.shape)
        shape[self.spec.split] //= tp
        return tuple(shape)


def _layer_specs(cfg: ModelConfig, layer: int) -> list[ParamSpec]:
    C, F_ = cfg.hidden, cfg.ffn
    out_std = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2: residual projections scaled by depth
    p = f"layers.{layer}."
    return [
        ParamSpec(p + "attn_norm.weight", (C,), None, None, layer),
        ParamSpec(p + "attn.wq.weight", (C, C), 0, 0.02, layer),  # rows = heads
        ParamSpec(p + "attn.wk.weight", (C, C), 0, 0.02, layer),
        ParamSpec(p + "attn.wv.weight", (C, C), 0, 0.02, layer),
        ParamSpec(p + "attn.wo.weight", (C, C), 1, out_std, layer),  # columns = heads
        ParamSpec(p + "mlp_norm.weight", (C,), None, None, layer),
        ParamSpec(p + "mlp.w1.weight", (F_, C), 0, 0.02, layer),  # rows = ffn columns
        ParamSpec(p + "mlp.w3.weight", (F_, C), 0, 0.02, layer),
        ParamSpec(p + "mlp.w2.weight", (C, F_), 1, out_std, layer),
    ]


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every full parameter in canonical order (embedding, layers, final norm, head)."""
    specs = [ParamSpec("embed.weight", (cfg.vocab, cfg.hidden), 1, 0.02, None)]
    for layer in range(cfg.layers):
        specs += _layer_specs(cfg, layer)
    specs.append(ParamSpec("norm.weight", (cfg.hidden,), None, None, None))
    if not cfg.tied_embeddings:
        specs.append(ParamSpec("head.weight", (cfg.vocab, cfg.hidden), 1, 0.02, None))
    return specs


@functools.cache
def pieces(cfg: ModelConfig, tp: int) -> tuple[Piece, ...]:
    """Every piece of the model cut into `tp` logical shards, in the global order used for
    collectives: by layer, then shard.

    Embedding shards first, then per layer its sharded pieces shard by shard and its replicated
    norms, then the final norm and the head shards.
    """
    return tuple(_pieces(cfg, tp))


def _pieces(cfg: ModelConfig, tp: int) -> Iterator[Piece]:
    specs = param_specs(cfg)
    ends = [sp for sp in specs if sp.layer is None]  # embed, norm, head (in that order)
    yield from _shards_of(ends[0], tp)
    for layer in range(cfg.layers):
        inner = _layer_specs(cfg, layer)
        for s in range(tp):
            yield from (Piece(sp, s) for sp in inner if sp.split is not None)
        yield from (Piece(sp, None) for sp in inner if sp.split is None)
    for spec in ends[1:]:
        yield from _shards_of(spec, tp)


def _shards_of(spec: ParamSpec, tp: int) -> Iterator[Piece]:
    if spec.split is None:
        yield Piece(spec, None)
    else:
        yield from (Piece(spec, s) for s in range(tp))


def init_piece(piece: Piece, tp: int, seed: int) -> Tensor:
    """A piece's initial value, drawn from its own generator: the same under every plan."""
    shape = piece.shape(tp)
    if piece.spec.std is None:
        return torch.ones(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(piece.name.encode())) % 2**62)
    return torch.empty(shape).normal_(0.0, piece.spec.std, generator=g)


def join_pieces(cfg: ModelConfig, tp: int, parts: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Full tensors (canonical names) from a complete set of pieces."""
    out: dict[str, Tensor] = {}
    for spec in param_specs(cfg):
        if spec.split is None:
            out[spec.name] = parts[spec.name]
        else:
            shards = [parts[f"{spec.name}@{s}"] for s in range(tp)]
            out[spec.name] = torch.cat(shards, dim=spec.split)
    return out


def split_full(cfg: ModelConfig, tp: int, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Pieces from full tensors (inverse of `join_pieces`)."""
    specs = {s.name: s for s in param_specs(cfg)}
    out: dict[str, Tensor] = {}
    for piece in pieces(cfg, tp):
        t = full[piece.spec.name]
        if piece.shard is None:
            out[piece.name] = t
        else:
            out[piece.name] = t.chunk(tp, dim=specs[piece.spec.name].split)[piece.shard]
    return out


# ---- the math, shared by the reference and the sharded stages ---------------------------------


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    """x / rms(x) * weight over the last dimension."""  # (B, T, C) -> (B, T, C)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight


def rope_tables(
    sequence: int, head_dim: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin of the rotary angles, each (T, head_dim/2)."""
    inv = ROPE_BASE ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    )
    angles = torch.outer(torch.arange(sequence, dtype=torch.float32, device=device), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (first half, second half) pairs of each head by position."""  # (B, h, T, d)
    T, half = x.shape[-2], x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:T], sin[:T]  # (T, d/2)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def attention(
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    head_dim: int,
    rope: tuple[Tensor, Tensor],
) -> Tensor:
    """Causal self-attention over the heads whose rows wq/wk/wv hold (all, or a TP slice).

    Returns this slice's contribution to the output projection: summing it over the slices of
    a layer gives the full attention output.
    """
    B, T, _ = x.shape  # (B, T, C)
    h = wq.shape[0] // head_dim  # local heads
    q = (x @ wq.T).view(B, T, h, head_dim).transpose(1, 2)  # (B, h, T, d)
    k = (x @ wk.T).view(B, T, h, head_dim).transpose(1, 2)  # (B, h, T, d)
    v = (x @ wv.T).view(B, T, h, head_dim).transpose(1, 2)  # (B, h, T, d)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, d)
    y = y.transpose(1, 2).reshape(B, T, h * head_dim)  # (B, T, h*d)
    return y @ wo.T  # (B, T, C)


def swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """SwiGLU MLP over the ffn columns w1/w3 hold; summing slices gives the full output."""
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T  # (B, T, C)


# ---- the single-process reference model -------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        C = cfg.hidden
        self.head_dim = cfg.head_dim
        self.wq, self.wk = nn.Linear(C, C, bias=False), nn.Linear(C, C, bias=False)
        self.wv, self.wo = nn.Linear(C, C, bias=False), nn.Linear(C, C, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        w = (self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)
        return attention(x, *w, self.head_dim, rope)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.hidden), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.hidden), MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class GPT(nn.Module):
    """The whole model in one process, with the canonical parameter names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.sequence, cfg.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_seed(cls, cfg: ModelConfig, tp: int, seed: int) -> GPT:
        """The model every plan of a `tp`-sharded job starts from: full tensors joined from the
        seeded pieces (each piece draws its own values, so they depend on `tp`)."""
        model = cls(cfg)
        parts = {p.name: init_piece(p, tp, seed) for p in pieces(cfg, tp)}
        full = join_pieces(cfg, tp, parts)
        model.load_full_state(full)
        return model

    def full_state(self) -> dict[str, Tensor]:
        """Canonical full tensors (the tied head is not repeated)."""
        names = {s.name for s in param_specs(self.cfg)}
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k in names}

    def load_full_state(self, full: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(full[name])

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of next-token prediction."""  # tokens, targets: (B, T)
        rope = (self.rope_cos, self.rope_sin)
        x = self.embed(tokens)  # (B, T, C)
        for block in self.layers:
            x = block(x, rope)  # (B, T, C)
        logits = self.head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
