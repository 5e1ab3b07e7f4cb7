"""AdamW over named pieces, the learning-rate schedule, and gradient clipping.

State is keyed by piece name (not by tensor object, not by GPU slice), so it can be saved,
loaded and migrated piece by piece whatever the plan. The update is elementwise and mirrors
torch.optim.AdamW exactly; the single-process reference uses torch's and the tests compare.
Like torch's, it updates every piece at once with the `torch._foreach_*` kernels when all of
them are on a GPU (a few launches per step instead of ten per piece) and piece by piece
elsewhere: the same operations with the same scalars in the same order, so on the CPU both
ways give the same bits (tests/trainer/parallel/test_optim_data.py). torch's *fused* AdamW is
not used: it evaluates the moments as `b * m + (1 - b) * g` rather than `lerp`, and the update
as one expression, so its results differ from the reference's in the last bits.
It updates the master pieces; the moments take their dtype (float32 under `precision: bf16`,
float64 in the float64 tests), and the bf16 copies follow after each step (trainer/model/precision.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AdamState", "PieceAdamW", "clip_coefficient", "lr_at"]

MIN_LR_RATIO = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to MIN_LR_RATIO * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = MIN_LR_RATIO * peak
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1; 0 = off."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@dataclass
class AdamState:
    """Adam moments and step count of one piece."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: int = 0


class PieceAdamW:
    """AdamW over a dict of named parameters; `decay[name]` says whether weight decay applies."""

    def __init__(
        self,
        params: Mapping[str, Tensor],
        decay: Mapping[str, bool],
        weight_decay: float,
        betas: tuple[float, float] = BETAS,
        eps: float = EPS,
        foreach: bool | None = None,
    ) -> None:
        self.params = dict(params)
        self.decay = dict(decay)
        self.weight_decay, self.betas, self.eps = weight_decay, betas, eps
        self.foreach = foreach  # None: when every piece is on a GPU, as torch's default
        self.state: dict[str, AdamState] = {
            name: AdamState(torch.zeros_like(p), torch.zeros_like(p))
            for name, p in self.params.items()
        }

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update of every piece, its gradient first multiplied by `grad_scale` (clipping)."""
        live = {name: p for name, p in self.params.items() if p.grad is not None}
        foreach = self.foreach
        if foreach is None:
            foreach = bool(live) and all(p.is_cuda for p in live.values())
        if foreach:
            self._step_foreach(live, lr, grad_scale)
            return
        beta1, beta2 = self.betas
        for name, p in live.items():
            assert p.grad is not None
            grad = p.grad if grad_scale == 1.0 else p.grad * grad_scale
            st = self.state[name]
            st.step += 1
            if self.decay[name]:
                p.mul_(1.0 - lr * self.weight_decay)
            st.exp_avg.lerp_(grad, 1.0 - beta1)
            st.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            bias1 = 1.0 - beta1**st.step
            bias2_sqrt = math.sqrt(1.0 - beta2**st.step)
            denom = (st.exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
            p.addcdiv_(st.exp_avg, denom, value=-lr / bias1)

    def _step_foreach(self, live: Mapping[str, Tensor], lr: float, grad_scale: float) -> None:
        """`step` over all pieces at once: each line is the loop's, applied to every piece."""
        if not live:
            return
        beta1, beta2 = self.betas
        names, params = list(live), list(live.values())
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads)
        if grad_scale != 1.0:
            grads = torch._foreach_mul(grads, grad_scale)  # new tensors, as `p.grad * scale`
        states = [self.state[name] for name in names]
        for st in states:
            st.step += 1
        decayed = [p for name, p in live.items() if self.decay[name]]
        if decayed:
            torch._foreach_mul_(decayed, 1.0 - lr * self.weight_decay)
        exp_avgs = [st.exp_avg for st in states]
        exp_avg_sqs = [st.exp_avg_sq for st in states]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        bias2_sqrt = [math.sqrt(1.0 - beta2**st.step) for st in states]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        step_sizes = [-lr / (1.0 - beta1**st.step) for st in states]
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    def rebind(
        self,
        params: Mapping[str, Tensor],
        decay: Mapping[str, bool],
        state: Mapping[str, AdamState],
    ) -> None:
        """Take over another set of pieces with their Adam state (after a migration): pieces
        kept keep their tensors, pieces no longer held are dropped with their moments."""
        missing = set(params) - set(state)
        if missing:
            raise ValueError(f"no Adam state for {sorted(missing)[:4]}")
        self.params, self.decay = dict(params), dict(decay)
        self.state = {name: state[name] for name in self.params}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
