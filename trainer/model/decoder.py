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
- Because the ends are cut by hidden columns, the vocabulary is never padded: any vocabulary
  size shards, and no padding row is trained or exported.
- Grouped-query attention: `wk`/`wv` (and Qwen2's k/v biases) hold kv_heads heads. With at
  least tp of them they are cut into tp shards like `wq`; with fewer, each piece is one kv
  head that the tp/kv_heads consecutive shards of its query heads compute with (Megatron's
  replicated K/V): all its holders contribute to its gradient (`ParamSpec.units`).
- `norm.weight` (final RMSNorm) lives on every GPU of the last stage; `layers.L.*_norm.weight`
  on every GPU holding layer L. Their gradients are identical inside a TP group and summed
  across pipelines (grad_sync.py).

The math (`rms_norm`, `attention`, `swiglu`, rotary tables) is trainer/model/layers.py, shared by the
single-process reference `GPT` here and the sharded stages (re-exported here for both).

Sizes come from `malleus.job.ModelConfig` and the number of logical shards from the job's `tp`
(`ResolvedJob.model`, `ResolvedJob.tp`); the shapes are judged there (`ResolvedJob.faults`), so
the code here assumes heads, ffn and hidden divide by `tp`, kv heads and tp divide one another
and the head size is even.
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

from .layers import NORM_EPS, apply_rope, attention, model_rope, rms_norm, rope_tables, swiglu
from .precision import loss_logits

__all__ = [
    "GPT",
    "NORM_EPS",
    "ParamSpec",
    "Piece",
    "apply_rope",
    "attention",
    "init_piece",
    "join_pieces",
    "local_names",
    "model_rope",
    "param_specs",
    "pieces",
    "rms_norm",
    "rope_tables",
    "spec_table",
    "split_full",
    "swiglu",
]


@dataclass(frozen=True)
class ParamSpec:
    """A full (logical) parameter: shape, the dimension cut into tp shards, init and decay.

    `units` caps the pieces: K/V projections have only kv_heads heads to cut, so with fewer
    kv heads than tp each piece is one kv head serving tp/kv_heads consecutive shards
    (Megatron's replicated K/V). Every holder of such a piece computes its gradient from its own
    query heads; summing over holders (grad_sync.py) gives the whole gradient.
    """

    name: str
    shape: tuple[int, ...]
    split: int | None  # None: replicated (one piece, the full tensor)
    std: float | None  # None: ones (norm weights); 0.0: zeros (biases)
    layer: int | None  # transformer layer, None for embed / norm / head
    units: int | None = None  # at most this many pieces (kv heads); None: tp

    @property
    def decay(self) -> bool:
        """Weight decay on matrices only (nanoGPT's rule), never on norm weights or biases."""
        return len(self.shape) >= 2

    def count(self, tp: int) -> int:
        """Pieces this parameter is cut into under `tp` logical shards."""
        if self.split is None:
            return 1
        return tp if self.units is None else min(tp, self.units)

    def piece_of(self, shard: int, tp: int) -> int:
        """Index of the piece that logical shard `shard` computes with."""
        return shard * self.count(tp) // tp


@dataclass(frozen=True)
class Piece:
    """One logical shard of a parameter (or a replicated parameter): the unit of state."""

    spec: ParamSpec
    shard: int | None  # piece index (= logical shard unless kv heads are replicated)

    @property
    def name(self) -> str:
        return self.spec.name if self.shard is None else f"{self.spec.name}@{self.shard}"

    def shape(self, tp: int) -> tuple[int, ...]:
        if self.spec.split is None:
            return self.spec.shape
        shape = list(self.spec.shape)
        shape[self.spec.split] //= self.spec.count(tp)
        return tuple(shape)

    def serves(self, tp: int) -> range:
        """The logical shards that compute with this piece."""
        if self.shard is None:
            return range(tp)
        per = tp // self.spec.count(tp)
        return range(self.shard * per, (self.shard + 1) * per)


def _layer_specs(cfg: ModelConfig, layer: int) -> list[ParamSpec]:
    C, F_, Q, KV, kv = cfg.hidden, cfg.ffn, cfg.q_width, cfg.kv_width, cfg.kv_heads
    out_std = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2: residual projections scaled by depth
    p = f"layers.{layer}."
    specs = [
        ParamSpec(p + "attn_norm.weight", (C,), None, None, layer),
        ParamSpec(p + "attn.wq.weight", (Q, C), 0, 0.02, layer),  # rows = heads
        ParamSpec(p + "attn.wk.weight", (KV, C), 0, 0.02, layer, kv),  # rows = kv heads
        ParamSpec(p + "attn.wv.weight", (KV, C), 0, 0.02, layer, kv),
        ParamSpec(p + "attn.wo.weight", (C, Q), 1, out_std, layer),  # columns = heads
    ]
    if cfg.attention_bias:  # Qwen2: q/k/v biases, cut like their projections' rows
        specs += [
            ParamSpec(p + "attn.wq.bias", (Q,), 0, 0.0, layer),
            ParamSpec(p + "attn.wk.bias", (KV,), 0, 0.0, layer, kv),
            ParamSpec(p + "attn.wv.bias", (KV,), 0, 0.0, layer, kv),
        ]
    return [
        *specs,
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
def spec_table(cfg: ModelConfig) -> Mapping[str, ParamSpec]:
    """Full parameters by canonical name."""
    return {s.name: s for s in param_specs(cfg)}


@functools.cache
def pieces(cfg: ModelConfig, tp: int) -> tuple[Piece, ...]:
    """Every piece of the model cut into `tp` logical shards, in the global order used for
    collectives: by layer, then shard.

    Embedding shards first, then per layer its sharded pieces shard by shard (a replicated kv
    piece at the first shard it serves) and its replicated norms, then the final norm and the
    head shards.
    """
    return tuple(_pieces(cfg, tp))


def _pieces(cfg: ModelConfig, tp: int) -> Iterator[Piece]:
    specs = param_specs(cfg)
    ends = [sp for sp in specs if sp.layer is None]  # embed, norm, head (in that order)
    yield from _shards_of(ends[0], tp)
    for layer in range(cfg.layers):
        inner = _layer_specs(cfg, layer)
        for s in range(tp):
            for sp in inner:
                if sp.split is not None and s * sp.count(tp) % tp == 0:  # first shard served
                    yield Piece(sp, sp.piece_of(s, tp))
        yield from (Piece(sp, None) for sp in inner if sp.split is None)
    for spec in ends[1:]:
        yield from _shards_of(spec, tp)


def _shards_of(spec: ParamSpec, tp: int) -> Iterator[Piece]:
    if spec.split is None:
        yield Piece(spec, None)
    else:
        yield from (Piece(spec, s) for s in range(spec.count(tp)))


def local_names(spec: ParamSpec, shards: range, tp: int) -> list[str]:
    """The pieces, in order, that a GPU computing logical shards `shards` holds of `spec`."""
    if spec.split is None:
        return [spec.name]
    index = sorted({spec.piece_of(s, tp) for s in shards})
    return [f"{spec.name}@{i}" for i in index]


def init_piece(piece: Piece, tp: int, seed: int) -> Tensor:
    """A piece's initial value, drawn from its own generator: the same under every plan."""
    shape = piece.shape(tp)
    if piece.spec.std is None:
        return torch.ones(shape)
    if piece.spec.std == 0.0:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(piece.name.encode())) % 2**62)
    return torch.empty(shape).normal_(0.0, piece.spec.std, generator=g)


def join_pieces(cfg: ModelConfig, tp: int, parts: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Full tensors (canonical names) from a complete set of pieces."""
    out: dict[str, Tensor] = {}
    for spec in param_specs(cfg):
        if spec.split is None:
            out[spec.name] = parts[spec.name]
        else:
            shards = [parts[f"{spec.name}@{s}"] for s in range(spec.count(tp))]
            out[spec.name] = torch.cat(shards, dim=spec.split)
    return out


def split_full(cfg: ModelConfig, tp: int, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Pieces from full tensors (inverse of `join_pieces`)."""
    out: dict[str, Tensor] = {}
    for piece in pieces(cfg, tp):
        t, spec = full[piece.spec.name], piece.spec
        if piece.shard is None:
            out[piece.name] = t
        else:
            out[piece.name] = t.chunk(spec.count(tp), dim=spec.split)[piece.shard]
    return out


# ---- the single-process reference model -------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        C, Q, KV, bias = cfg.hidden, cfg.q_width, cfg.kv_width, cfg.attention_bias
        self.head_dim = cfg.head_dim
        self.wq, self.wk = nn.Linear(C, Q, bias=bias), nn.Linear(C, KV, bias=bias)
        self.wv, self.wo = nn.Linear(C, KV, bias=bias), nn.Linear(Q, C, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        w = (self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)
        b = (self.wq.bias, self.wk.bias, self.wv.bias) if self.wq.bias is not None else None
        return attention(x, *w, self.head_dim, rope, b)


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
        self.attn_norm, self.attn = RMSNorm(cfg.hidden, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.hidden, cfg.norm_eps), MLP(cfg)

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
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = model_rope(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_seed(cls, cfg: ModelConfig, tp: int, seed: int) -> GPT:
        """The model every plan of a `tp`-sharded job starts from: full tensors joined from the
        seeded pieces (each piece draws its own values, so they depend on `tp`)."""
        parts = {p.name: init_piece(p, tp, seed) for p in pieces(cfg, tp)}
        return cls.from_full(cfg, join_pieces(cfg, tp, parts))

    @classmethod
    def from_full(cls, cfg: ModelConfig, full: Mapping[str, Tensor]) -> GPT:
        """The model holding these full tensors (canonical names)."""
        model = cls(cfg)
        model.load_full_state(full)
        return model

    def full_state(self) -> dict[str, Tensor]:
        """Canonical full tensors (the tied head is not repeated)."""
        names = spec_table(self.cfg)
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k in names}

    def load_full_state(self, full: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(full[name])

    def logits(self, tokens: Tensor) -> Tensor:
        """Next-token logits."""  # tokens: (B, T) -> (B, T, V)
        rope = (self.rope_cos, self.rope_sin)
        x = self.embed(tokens)  # (B, T, C)
        for block in self.layers:
            x = block(x, rope)  # (B, T, C)
        return self.head(self.norm(x))  # (B, T, V)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of next-token prediction."""  # tokens, targets: (B, T)
        logits = loss_logits(self.logits(tokens))  # (B, T, V), at least float32
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
