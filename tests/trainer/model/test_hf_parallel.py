"""Exactness against transformers under heterogeneous plans: N steps of the trainer on a
Hugging Face model equal N steps of torch's AdamW + clip_grad_norm_ + the job's schedule on the
transformers model itself.

One spawned 4-rank gloo job (1 node x 4 GPUs, tp 2) trains two models, each under a plan with
TP groups of 2 and 1 GPUs side by side, unequal layer splits and micro-batch counts, then, from
step 3, under a plan with an excluded rank and a 1 -> 2 TP boundary (a live switch, migrating
pieces). The models: Llama with GQA 8q/2kv (kv heads sharded), tied, llama3 rope scaling, odd
vocabulary; Qwen2 with 4q/1kv (one kv head replicated over both shards, q/k/v biases), untied.
Each run's final checkpoint is then resumed under the first plan: the same model, bit for bit.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
hc = importlib.import_module("hf_cases")

from malleus.job import ResolvedJob  # noqa: E402
from malleus.trainer.data.samples import make_source, micro_batch  # noqa: E402
from malleus.trainer.launch.spawn import spawn_local  # noqa: E402
from malleus.trainer.model.hf import hf_name  # noqa: E402
from malleus.trainer.parallel.optim import BETAS, EPS, lr_at  # noqa: E402
from tests.trainer.hf_models import LLAMA3, hf_model, job_for  # noqa: E402

STEPS = 4
TRAINING = {
    "globalBatchSize": 8,
    "microBatchSize": 1,
    "steps": STEPS,
    "learningRate": 3e-3,
    "warmupSteps": 1,
    "gradClip": 0.5,  # low enough to clip: the norm must be the global one
    "dataset": "synthetic",
}
FIRST = tc.plan(  # TP 2 -> 1 in pipeline 0; pipeline 1 one GPU holding both shards
    [(5, [([0, 1], (0, 1)), ([2], (1, 4))]), (3, [([3], (0, 4))])]
)
SECOND = tc.plan([(8, [([1], (0, 3)), ([3, 2], (3, 4))])], excluded=[0])  # 1 -> 2, rank 0 out
MODELS = {
    "llama_gqa8-2_tied_llama3": (
        LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_scaling=LLAMA3, num_hidden_layers=4),
    ),
    "qwen2_mqa4-1_bias": (
        Qwen2ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=61, num_hidden_layers=4),
    ),
}


def hf_job(folder: Path) -> ResolvedJob:
    job = job_for(folder, tp=2, nodes=1, gpusPerNode=4, emulation={"enabled": False})
    manifest = job.job.model_dump(by_alias=True, exclude_none=True)
    manifest["spec"]["training"] = TRAINING
    return ResolvedJob.load(manifest).check()


def train_transformers(model: torch.nn.Module, job: ResolvedJob) -> list[float]:
    """The plain loop: torch's AdamW (matrices decayed), clip_grad_norm_, the job's schedule."""
    tr = job.spec.training
    params = list(model.parameters())  # a tied head once
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": tr.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=tr.learning_rate, betas=BETAS, eps=EPS, foreach=False)
    source = make_source(tr.dataset, job.model.sequence, job.model.vocab, tr.seed)
    M, losses = job.micro_batches, []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tr.learning_rate, tr.warmup_steps, STEPS)
        opt.zero_grad()
        total = 0.0
        for j in range(M):
            x, y = micro_batch(source, step, j, tr.global_batch_size, tr.micro_batch_size)
            logits = model(input_ids=x).logits  # (b, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            (loss / M).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, tr.grad_clip, foreach=False)
        opt.step()
        losses.append(total / M)
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("hf")
    made, chains = {}, []
    for name, (kind, config) in MODELS.items():
        model = hf_model(kind, **config)
        model.save_pretrained(root / name)
        job = hf_job(root / name)
        made[name] = (model, job)
        second = SECOND.model_copy(update={"generation": FIRST.generation + 1})
        chains.append(hc.Chain(name, job, FIRST, ((3, second),), STEPS))
    spawn_local(4, hc.run_chains, (chains, str(root)))
    return {n: (*made[n], torch.load(root / f"{n}.pt")) for n in MODELS}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_under_switching_plans_equals_transformers(runs: dict, name: str) -> None:
    model, job, got = runs[name]
    [(step, generation, moved, minimal)] = got["switched"]
    assert (step, generation) == (3, FIRST.generation + 1)
    assert moved == minimal > 0  # replicated kv pieces counted as the planner's units map them
    losses = train_transformers(model, job)
    assert [r["loss"] for r in got["reports"]] == pytest.approx(losses, rel=1e-5)
    assert any(r["grad_norm"] > TRAINING["gradClip"] for r in got["reports"])  # clipping ran
    state = model.state_dict()
    theirs = {n: state[hf_name(n)] for n in got["full"]}
    assert tc.rel_diff(got["full"], theirs) <= 1e-4
    assert got["resumed_step"] == STEPS  # a checkpoint of one plan resumed under another
    assert all(torch.equal(got["resumed"][n], t) for n, t in got["full"].items())
    moved = max(float((got["full"][n] - state[hf_name(n)]).abs().max()) for n in got["full"])
    assert moved > 0  # sanity: the comparison is of trained weights, not untouched ones
