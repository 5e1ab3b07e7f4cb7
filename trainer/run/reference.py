"""The same training in one process, with no parallelism: the yardstick for exactness.

Independent of the parallel code path on purpose: full tensors in an nn.Module, torch's own
AdamW and clip_grad_norm_. It shares only what defines the training (the model math and
initial pieces, the sample order, the LR schedule, the precision), so any plan must land on
its result. Under `precision: bf16` it computes on a bf16 copy of the model and keeps float32
masters, gradients and torch's AdamW state, as the trainer does (trainer/model/precision.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from malleus.job import ResolvedJob
from malleus.trainer.data.samples import make_source, micro_batch
from malleus.trainer.model.decoder import GPT, param_specs
from malleus.trainer.model.hf import initial_full
from malleus.trainer.model.precision import ComputeCopies, Precision
from malleus.trainer.parallel.optim import BETAS, EPS, lr_at

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
    float64: bool = False,
) -> ReferenceResult:
    """Train from the job's initial model (seeded, or its Hugging Face weights) for `until` steps (default: all) of a run of `steps`
    (default: the job's; the LR schedule's length); `float64`: in float64 throughout."""
    training = job.spec.training
    run_steps = steps if steps is not None else job.steps
    torch.manual_seed(training.seed)
    precision = Precision.of(training.precision, float64=float64)
    # the seeded pieces, or the job's Hugging Face weights
    model = GPT.from_full(job.model, initial_full(job)).to(precision.master)
    compute = copy.deepcopy(model).to(precision.compute) if precision.mixed else model
    copies = ComputeCopies(
        dict(model.named_parameters()), precision, dict(compute.named_parameters())
    )
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
    source = make_source(
        training.dataset, job.model.sequence, job.model.vocab, training.seed, training.data
    )
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
            loss = compute(x, y)
            (loss / M).backward()  # bf16: each micro-batch's gradients go to the fp32 masters
            total += float(loss.detach())
        if training.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip, foreach=False)
        opt.step()
        copies.refresh()
        losses.append(total / M)
        if log is not None:
            log(step, total / M)
    return ReferenceResult(model, losses)
