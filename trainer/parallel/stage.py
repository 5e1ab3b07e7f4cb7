"""`StageModel`: one GPU's share of a pipeline stage, computed from its pieces.

The GPU holds shards [a, b) of every layer of its stage; it concatenates its pieces into local
weights (its heads, its ffn columns, its hidden columns of the embedding/head) and runs the
shared model math between the TP collectives. The pieces dict is not owned here: the trainer
(and later migration) swaps pieces in and out, the stage only reads them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from malleus.job import ModelConfig
from malleus.trainer.model.decoder import local_names, spec_table
from malleus.trainer.model.layers import layer_math, model_rope
from malleus.trainer.model.precision import loss_logits

from .layout import Place
from .tensor import TPGroup, copy_to_group, gather_from_group, reduce_from_group

__all__ = ["StageModel"]


class StageModel:
    """The stage's layers (and ends) on this GPU; `degree` is the job's tp, the logical shards
    per layer (the GPU's TP group `tp` may be smaller and hold several of them)."""

    def __init__(
        self,
        cfg: ModelConfig,
        degree: int,
        place: Place,
        params: Mapping[str, Tensor],
        tp: TPGroup,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        *,
        compiled: bool = False,
    ) -> None:
        self.cfg, self.place, self.params, self.tp = cfg, place, params, tp
        self.math = layer_math(compiled)  # `spec.training.compile`
        self.degree, self.specs = degree, spec_table(cfg)
        self.shards = place.shards
        # computed in float32, applied in the compute dtype (as transformers does)
        cos, sin = model_rope(cfg, device)
        self.rope = (cos.to(dtype), sin.to(dtype))
        width = cfg.hidden // degree  # hidden columns per logical shard (embedding / head)
        self.columns = slice(self.shards.start * width, self.shards.stop * width)

    def _local(self, name: str, dim: int) -> Tensor:
        """This GPU's slice of a sharded weight: its pieces concatenated along `dim` (a kv
        head serving several of its shards is one piece, taken once)."""
        names = local_names(self.specs[name], self.shards, self.degree)
        parts = [self.params[n] for n in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def embed(self, tokens: Tensor) -> Tensor:
        """Token embeddings, whole on every GPU of the group."""  # (b, T) -> (b, T, C)
        local = F.embedding(tokens, self._local("embed.weight", 1))  # (b, T, C_local)
        return gather_from_group(local, self.tp)  # (b, T, C)

    def layer(self, layer: int, x: Tensor) -> Tensor:
        """One transformer block on this GPU's heads and ffn columns."""  # (b, T, C)
        p, tp = f"layers.{layer}.", self.tp
        eps = self.cfg.norm_eps
        h = copy_to_group(
            self.math.rms_norm(x, self.params[p + "attn_norm.weight"], eps), tp
        )  # (b, T, C)
        bias = None
        if self.cfg.attention_bias:  # (h_local*d,), (kv_local*d,) x 2
            bq, bk, bv = (self._local(p + f"attn.w{n}.bias", 0) for n in "qkv")
            bias = (bq, bk, bv)
        a = self.math.attention(
            h,
            self._local(p + "attn.wq.weight", 0),  # (h_local*d, C)
            self._local(p + "attn.wk.weight", 0),  # (kv_local*d, C)
            self._local(p + "attn.wv.weight", 0),
            self._local(p + "attn.wo.weight", 1),  # (C, h_local*d)
            self.cfg.head_dim,
            self.rope,
            bias,
        )  # (b, T, C) partial over heads
        x = x + reduce_from_group(a, tp)  # (b, T, C)
        h = copy_to_group(self.math.rms_norm(x, self.params[p + "mlp_norm.weight"], eps), tp)
        m = self.math.swiglu(
            h,
            self._local(p + "mlp.w1.weight", 0),  # (F_local, C)
            self._local(p + "mlp.w3.weight", 0),
            self._local(p + "mlp.w2.weight", 1),  # (C, F_local)
        )  # (b, T, C) partial over ffn columns
        return x + reduce_from_group(m, tp)  # (b, T, C)

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """Final norm, head (partial logits over hidden columns, summed) and mean CE."""
        h = copy_to_group(
            self.math.rms_norm(x, self.params["norm.weight"], self.cfg.norm_eps), self.tp
        )
        head = "embed.weight" if self.cfg.tied_embeddings else "head.weight"
        w = self._local(head, 1)  # (V, C_local)
        logits = reduce_from_group(h[..., self.columns] @ w.T, self.tp)  # (b, T, V)
        return F.cross_entropy(loss_logits(logits).flatten(0, 1), targets.flatten())
