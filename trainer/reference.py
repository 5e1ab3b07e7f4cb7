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

from malleus.job import ResolvedJob

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
    job: ResolvedJob,
    *,
    steps: int | None = None,
    until: int | None = None,
    log: Callable[[int, float], None] | None = None,
) -> ReferenceResult:
    """Train from the seeded initial model for `until` steps (default: all) of a run of `steps`
    (default: the job's; the LR schedule's length)."""
    training = job.spec.training
    run_steps = steps if steps is not None else job.steps
    torch.manual_seed(training.seed)
    model = GPT.from_seed(job.model, job.tp, training.seed)
    decay = {s.name for s in param_specs(job.model) if s.decay}
    named = dict(model.named_parameters())  # the tied head appears once, as embed.weight
    groups = [
        {
            "params": [p for n, p in named.items() if n in decay],
            "weight_decay": training.weight_decay,
        },
        {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=training.learning_rate, betas=BETAS, eps=EPS, foreach=False)
    source = make_source(training.dataset, job.model.sequence, job.model.vocab, training.seed)
    M = job.micro_batches
    losses = []
    for step in range(min(run_steps, until if until is not None else run_steps)):
        lr = lr_at(step, training.learning_rate, training.warmup_steps, run_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for j in range(M):
            x, y = micro_batch(
                source, step, j, training.global_batch_size, training.micro_batch_size
            )
            loss = model(x, y)
            (loss / M).backward()
            total += float(loss.detach())
        if training.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip, foreach=False)
        opt.step()
        losses.append(total / M)
        if log is not None:
            log(step, total / M)
    return ReferenceResult(model, losses)
