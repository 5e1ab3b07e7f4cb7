"""The same training in one process, with no parallelism: the yardstick for exactness.

Independent of the parallel code path on purpose: full tensors in an nn.Module, torch's own
AdamW and clip_grad_norm_. It shares only what defines the training (the model math and
initial pieces, the sample order, the LR schedule), so any plan must land on its result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import TrainConfig
from .data import make_source, micro_batch
from .model import GPT, param_specs
from .parallel.optim import BETAS, EPS, lr_at

__all__ = ["ReferenceResult", "train_reference"]


@dataclass
class ReferenceResult:
    model: GPT
    losses: list[float]  # mean micro-batch loss of every step run

    def full_state(self) -> dict[str, Tensor]:
        return self.model.full_state()


def train_reference(
    cfg: TrainConfig, until: int | None = None, log: Callable[[int, float], None] | None = None
) -> ReferenceResult:
    """Train from the seeded initial model for `until` (default cfg.steps) steps."""
    torch.manual_seed(cfg.seed)
    model = GPT.from_seed(cfg.model, cfg.seed)
    decay = {s.name for s in param_specs(cfg.model) if s.decay}
    named = dict(model.named_parameters())  # the tied head appears once, as embed.weight
    groups = [
        {"params": [p for n, p in named.items() if n in decay], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=BETAS, eps=EPS, foreach=False)
    source = make_source(cfg.dataset, cfg.model.sequence, cfg.model.vocab, cfg.seed)
    M = cfg.micro_batches
    losses = []
    for step in range(min(cfg.steps, until if until is not None else cfg.steps)):
        lr = lr_at(step, cfg.learning_rate, cfg.warmup_steps, cfg.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for j in range(M):
            x, y = micro_batch(source, step, j, cfg.global_batch, cfg.micro_batch)
            loss = model(x, y)
            (loss / M).backward()
            total += float(loss.detach())
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
        opt.step()
        losses.append(total / M)
        if log is not None:
            log(step, total / M)
    return ReferenceResult(model, losses)
