"""GPU throughput: tokens/s and MFU of a ~1B Llama in bf16 under the trainer, alone and shared,
and the same model in a plain transformers training loop.

Run by bench/gpu.sh (one NVIDIA GPU); by hand:

    python bench/gpu.py solo --out gpu-results            # one rank, the whole GPU
    python bench/gpu.py plain --out gpu-results           # the plain loop, the whole GPU
    python bench/gpu.py share --ranks 4 --out gpu-results # 4 one-rank jobs on the same GPU
    python bench/gpu.py compiled --out gpu-results        # solo with `training.compile`
    python bench/gpu.py solo --dry-run --out /tmp/x       # the same code, tiny model, CPU

*solo*: one rank (a world of one, NCCL) trains a Llama-shaped model of ~1.1B parameters
(16 layers, hidden 2048, 32 heads / 8 kv heads, ffn 8192, vocab 32000, sequence 2048) in
`precision: bf16` under the one-GPU plan, with random weights and synthetic tokens; the
median step after warm-up gives tokens/s, and MFU = model FLOPs per token x tokens/s / the
GPU's dense bf16 peak (model FLOPs: 6 x the parameters the matmuls touch, embedding lookup
excluded, + 12 x layers x heads x head_dim x sequence for attention, as PaLM counts them).

*plain*: the same model, sizes, micro-batches and samples in the loop a transformers user
writes, as the transformers Trainer runs it with `bf16=True`: a `LlamaForCausalLM` (sdpa
attention) with float32 weights under bf16 autocast, a forward and backward per micro-batch,
`clip_grad_norm_`, `torch.optim.AdamW` (fused on CUDA, the Trainer's default optimizer), the
job's LR schedule; the losses stay on the device until the end, as the Trainer keeps them.
Trainer step time / plain step time is the trainer's overhead on the GPU (target <= 1.10).

*compiled*: solo with `spec.training.compile` (the layers' math through `torch.compile`); the
first warm-up step pays the compilation, which the median leaves out.

*share*: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected",
NCCL >= 2.5), so ranks of one job cannot share a GPU; what can is several jobs. `share` starts
`--ranks` one-rank jobs at once on the same GPU, each with 1/ranks of the solo batch (and of
its micro-batch, so that all of them fit in the GPU's memory at once), and
reports each one's tokens/s and their sum against solo: what co-located work costs a rank
(a straggler's origin the operator must live with).

Writes OUT/gpu-<mode>.json and prints one line per result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from malleus.job import ResolvedJob
from malleus.trainer.data.samples import make_source, micro_batch
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.model.hf import hf_config
from malleus.trainer.parallel.optim import BETAS, EPS, lr_at
from malleus.trainer.world.world import World

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-cpu.yaml"
LLAMA_1B = {
    "layers": 16,
    "hidden": 2048,
    "heads": 32,
    "kvHeads": 8,
    "ffn": 8192,
    "vocab": 32000,
    "sequence": 2048,
}
DRY = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kvHeads": 2,
    "ffn": 128,
    "vocab": 256,
    "sequence": 32,
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peaks (SXM parts), matched by substring of the device name."""


def make_job(
    model: dict[str, int], global_batch: int, micro: int, gpu_mib: int, *, compiled: bool = False
) -> ResolvedJob:
    manifest = yaml.safe_load(TINY.read_text())
    spec = manifest["spec"]
    spec.update(nodes=1, gpusPerNode=1, parallelism={"tp": 1}, emulation={"enabled": False})
    spec["model"] = dict(model)
    spec["training"] = {
        "globalBatchSize": global_batch,
        "microBatchSize": micro,
        "steps": 1000,
        "learningRate": 3e-4,
        "warmupSteps": 10,
        "dataset": "synthetic",
        "precision": "bf16",
        "compile": compiled,
    }
    spec["resources"] = {"gpuMemoryMiB": gpu_mib}
    return ResolvedJob.load(manifest).check()


def flops_per_token(job: ResolvedJob) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention (PaLM's count)."""
    m = job.model
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    per_layer = m.hidden * (2 * q + 2 * kv) + 3 * m.hidden * m.ffn  # wq, wo, wk, wv; w1, w3, w2
    matmul = m.layers * per_layer + m.vocab * m.hidden  # + the head
    return 6.0 * matmul + 12.0 * m.layers * q * m.sequence


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS.items() if key in name), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(args: argparse.Namespace, global_batch: int) -> dict[str, Any]:
    """One rank, a world of one: the median step of `args.steps` after `args.warmup`."""
    world = World(1)
    device = init_distributed(DistEnv(0, 1, 0, "127.0.0.1", _free_port()), world, init_timeout_s=60)
    cuda = device.type == "cuda"
    gpu_mib = torch.cuda.get_device_properties(device).total_memory >> 20 if cuda else 81559
    model = DRY if args.dry_run else LLAMA_1B
    job = make_job(model, global_batch, args.micro, gpu_mib, compiled=args.mode == "compiled")
    trainer = Trainer(job, job.initial_plan(), rank=0, world=world, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        report = trainer.train_step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    torch.distributed.destroy_process_group()
    params = sum(p.numel() for p in trainer.params.values())
    return _result(args, job, device, times, params, report.loss)


def plain(args: argparse.Namespace) -> dict[str, Any]:
    """The same model in a plain transformers loop on the same device (module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    gpu_mib = torch.cuda.get_device_properties(device).total_memory >> 20 if cuda else 81559
    job = make_job(DRY if args.dry_run else LLAMA_1B, args.global_batch, args.micro, gpu_mib)
    tr, M = job.spec.training, job.micro_batches
    config = LlamaConfig(**hf_config(job), attn_implementation="sdpa")
    torch.manual_seed(tr.seed)
    with device:  # initialised where it trains: no 4 GiB copy from the host
        model = LlamaForCausalLM(config)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tr.weight_decay}, {"params": rest}]
    opt = torch.optim.AdamW(
        groups, lr=tr.learning_rate, betas=BETAS, eps=EPS, weight_decay=0.0, fused=cuda
    )
    source = make_source(tr.dataset, job.model.sequence, job.model.vocab, tr.seed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(i, tr.learning_rate, tr.warmup_steps, job.steps)
        total = torch.zeros((), device=device)
        for j in range(M):
            x, y = micro_batch(source, i, j, tr.global_batch_size, tr.micro_batch_size)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=x).logits  # (b, T, V)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / M).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / M)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    return _result(args, job, device, times, params, float(losses[-1]))


def _result(
    args: argparse.Namespace,
    job: ResolvedJob,
    device: torch.device,
    times: list[float],
    params: int,
    loss: float,
) -> dict[str, Any]:
    """The figures of one measured loop: the median step after the warm-up."""
    cuda = device.type == "cuda"
    step = statistics.median(times)
    tokens = job.tokens_per_step / step
    peak = peak_flops(device, args.peak_tflops)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dry_run": args.dry_run,
        "parameters": params,
        "tokens_per_step": job.tokens_per_step,
        "step_seconds": step,
        "tokens_per_second": tokens,
        "mfu": None if peak is None else flops_per_token(job) * tokens / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "last_loss": loss,
    }


def share(args: argparse.Namespace) -> dict[str, Any]:
    """`--ranks` one-rank jobs at once on the same GPU, each with 1/ranks of the batch and of
    the micro-batch (four ~1.1B jobs hold ~27 GiB each at micro-batch 2)."""
    cmd = [sys.executable, __file__, "solo", "--out", str(args.out), "--child"]
    micro = max(1, args.micro // args.ranks)  # the activations of all jobs must fit at once
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--micro", str(micro)]
    cmd += ["--global-batch", str(max(micro, args.global_batch // args.ranks))]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops is not None else []
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(args.ranks)]
    runs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a sharing job failed with exit code {p.returncode}")
        runs.append(json.loads(out.strip().splitlines()[-1]))
    total = sum(r["tokens_per_second"] for r in runs)
    mfus = [r["mfu"] for r in runs]
    return {
        "dry_run": args.dry_run,
        "ranks": args.ranks,
        "jobs": runs,
        "tokens_per_second": total,
        "mfu": None if None in mfus else sum(mfus),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["solo", "plain", "share", "compiled"])
    ap.add_argument("--out", type=Path, default=Path("gpu-results"))
    ap.add_argument("--ranks", type=int, default=4, help="share: one-rank jobs on the GPU")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if not known")
    ap.add_argument("--dry-run", action="store_true", help="tiny model, runs on CPU")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.global_batch, args.micro = min(args.global_batch, 4), min(args.micro, 2)
        # A dry run checks that the code runs and reports, not the rate: a median of two
        # steps after one warm-up is enough (on a loaded CPU a step took up to 2 s).
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.mode in ("solo", "compiled"):
        result = measure(args, args.global_batch)
        if args.child:
            print(json.dumps(result))
            return 0
    elif args.mode == "plain":
        result = plain(args)
    else:
        result = share(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu-{args.mode}.json").write_text(json.dumps(result, indent=1))
    mfu = "n/a" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    print(f"{args.mode}: {result['tokens_per_second']:,.0f} tokens/s, MFU {mfu}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
