"""Numeric precision: what the layers compute in, and what the truth is kept in.

- `fp32` (the default): every tensor is float32.
- `bf16` (`spec.training.precision`): the layers run on bfloat16 copies of the pieces, so
  parameters and activations are bf16 (what Megatron and torchtitan do). The pieces themselves,
  the *master* weights, stay float32: each micro-batch's bf16 gradient is added into the master's
  float32 gradient as soon as it is complete (no bf16 accumulation across micro-batches), data
  parallel sums, the global norm and clipping run on those float32 gradients, and the Adam
  moments are float32. The masters are the only truth: the optimizer, gradient sync,
  checkpoints, migration and every exported weight see only them; the bf16 copies are derived
  from them after every update, load and switch, and never travel or get saved.
- `float64` (`RunOptions.float64`, tests only): every tensor is float64, so that whatever two
  plans still disagree by cannot be float32 summation order (tests/trainer/model/test_float64.py).

Losses are computed from float32 logits whatever the compute dtype (`loss_logits`), as
transformers and Megatron do: a bf16 softmax over a large vocabulary loses most of its digits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PRECISIONS", "ComputeCopies", "Precision", "loss_logits"]

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """The dtype the layers compute in and the dtype of master weights, gradients and Adam."""

    compute: torch.dtype
    master: torch.dtype

    @classmethod
    def of(cls, name: str, *, float64: bool = False) -> Precision:
        """The job's `spec.training.precision`; `float64` overrides it (tests only)."""
        if float64:
            return cls(torch.float64, torch.float64)
        return cls(PRECISIONS[name], torch.float32)

    @property
    def mixed(self) -> bool:
        """Whether the layers run on copies of the masters (bf16) or on the masters themselves."""
        return self.compute != self.master

    @property
    def master_bytes(self) -> int:
        """Bytes per element of what migrates and is saved: masters and Adam moments."""
        return self.master.itemsize


def loss_logits(logits: Tensor) -> Tensor:
    """Logits as the loss reads them: at least float32 (bf16 upcast, float64 kept)."""
    return logits.float() if logits.dtype.itemsize < 4 else logits


class ComputeCopies:
    """The pieces as the layers see them, by name.

    Not mixed: the master dict itself (no copy, no hook, the fp32 path is unchanged). Mixed: one
    compute-dtype leaf per master; a hook moves each gradient accumulated into a copy over to
    its master in the master's dtype and clears the copy's, so gradients add up in float32
    whatever happens between two micro-batches. `copies` adopts existing leaves (the
    reference's bf16 module parameters) instead of making new ones.
    """

    def __init__(
        self,
        masters: Mapping[str, Tensor],
        precision: Precision,
        copies: Mapping[str, Tensor] | None = None,
    ) -> None:
        self.masters = masters
        if not precision.mixed:
            self.tensors: Mapping[str, Tensor] = masters
            return
        if copies is None:
            copies = {
                n: m.detach().to(precision.compute).requires_grad_() for n, m in masters.items()
            }
        self.tensors = dict(copies)
        for name, copy in self.tensors.items():
            copy.register_post_accumulate_grad_hook(self._to_master(masters[name]))
        self.refresh()

    @staticmethod
    def _to_master(master: Tensor) -> Callable[[Tensor], None]:
        def hook(copy: Tensor) -> None:
            assert copy.grad is not None
            if master.grad is None:
                master.grad = copy.grad.to(master.dtype)
            else:  # summed in the master's dtype, no temporary
                master.grad.add_(copy.grad)
            copy.grad = None

        return hook

    @torch.no_grad()
    def refresh(self) -> None:
        """Derive the copies from the masters again (after an update, a load, a migration)."""
        if self.tensors is self.masters:
            return
        for name, copy in self.tensors.items():
            copy.copy_(self.masters[name])
