"""bf16 against transformers: the reference's bf16 training equals a bf16 transformers run.

One process, no hub: a tiny random `LlamaForCausalLM` (grouped-query attention, untied head) is
saved with `save_pretrained` and read as the job's `spec.model.path`. The reference
(`train_reference`, `precision: bf16`: a bf16 copy of the model, float32 masters and AdamW
state) and the recipe written here on transformers' own modules (the bf16 model computes,
each micro-batch's gradients are added into a float32 copy, `clip_grad_norm_` and
`torch.optim.AdamW` on it, the bf16 weights copied back) must train alike. Since the trainer's
plans are held to the reference (test_precision.py), this ties the trainer's bf16 to an
implementation nobody here wrote.

Tolerances, from what bf16 is: both sides round every matmul, norm and residual to bf16
(8 significant bits), in kernels that sum in different orders, so each bf16 forward sits about
1% (relative L2 of the logits) from the float32 one, and the two bf16 forwards 0.7% from each
other (measured): the bound is 2e-2. Losses over 6 steps: measured 4e-4 relative, bound 1e-3.
Parameters are compared by each tensor's update, |ours - theirs| / |theirs - start|, as in
test_precision.py (AdamW makes elementwise comparisons meaningless in bf16): measured 0.075,
bound 0.15, the distance at which bf16 and fp32 training part after 6 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from malleus.job import ResolvedJob
from malleus.trainer.data.samples import make_source, micro_batch
from malleus.trainer.model.decoder import GPT
from malleus.trainer.model.hf import hf_name, initial_full
from malleus.trainer.parallel.optim import BETAS, EPS, lr_at
from malleus.trainer.run.reference import train_reference
from tests.job.tiny_llama import SEQUENCE, SIZES, model_manifest

STEPS = 6


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> ResolvedJob:
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES, initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(folder)
    manifest = model_manifest(folder)
    spec = manifest["spec"]
    spec["training"] = {
        "globalBatchSize": 4,
        "microBatchSize": 2,
        "steps": STEPS,
        "learningRate": 3e-3,
        "warmupSteps": 1,
        "dataset": "synthetic",
        "precision": "bf16",
    }
    return ResolvedJob.load(manifest).check()


def transformers_bf16(
    job: ResolvedJob,
) -> tuple[dict[str, torch.Tensor], list[float], torch.Tensor]:
    """The mixed-precision recipe on transformers' modules: final float32 masters (canonical
    names), losses, and the first forward's logits."""
    tr, folder = job.spec.training, job.spec.model.path
    master = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    compute = copy.deepcopy(master).to(torch.bfloat16)
    pairs = list(zip(master.parameters(), compute.parameters(), strict=True))
    decay = [m for m, _ in pairs if m.dim() >= 2]
    rest = [m for m, _ in pairs if m.dim() < 2]
    groups = [{"params": decay, "weight_decay": tr.weight_decay}, {"params": rest}]
    opt = torch.optim.AdamW(groups, lr=tr.learning_rate, betas=BETAS, eps=EPS, weight_decay=0.0)
    source = make_source(tr.dataset, SEQUENCE, job.model.vocab, tr.seed)
    M, losses, first = job.micro_batches, [], None
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tr.learning_rate, tr.warmup_steps, STEPS)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(M):
            x, y = micro_batch(source, step, j, tr.global_batch_size, tr.micro_batch_size)
            logits = compute(input_ids=x).logits  # (b, T, V) bf16
            first = logits.detach() if first is None else first
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (loss / M).backward()
            total += float(loss.detach())
            for m, c in pairs:  # this micro-batch's bf16 gradient into the float32 master
                assert c.grad is not None
                g = c.grad.float()
                m.grad = g if m.grad is None else m.grad + g
                c.grad = None
        torch.nn.utils.clip_grad_norm_(master.parameters(), tr.grad_clip)
        opt.step()
        with torch.no_grad():
            for m, c in pairs:
                c.copy_(m)
        losses.append(total / M)
    state = master.state_dict()
    assert first is not None
    return state, losses, first


def test_bf16_reference_trains_like_transformers_in_bf16(job: ResolvedJob) -> None:
    torch.set_num_threads(1)
    theirs, their_losses, their_logits = transformers_bf16(job)
    ours = train_reference(job)
    # the first forward, before any update: the same bf16 operations
    start = initial_full(job)
    model = GPT.from_full(job.model, start).to(torch.bfloat16)
    source = make_source("synthetic", SEQUENCE, job.model.vocab, job.spec.training.seed)
    x, _ = micro_batch(source, 0, 0, 4, 2)
    mine = model.logits(x)
    diff = (mine.float() - their_logits.float()).norm() / their_logits.float().norm()
    assert float(diff) <= 2e-2
    assert ours.losses == pytest.approx(their_losses, rel=1e-3)
    got = ours.full_state()
    for name, value in got.items():
        want = theirs[hf_name(name)]
        moved = (want - start[name]).norm()
        assert float((value - want).norm() / moved) <= 0.15, name
        assert value.dtype == torch.float32
