"""Trainer overhead: the trainer under a one-GPU plan against a plain transformers training loop.

Run: .venv/bin/python bench/overhead.py [--steps 12] [--threads 1] [--no-write]

One process, CPU. A random `transformers.LlamaForCausalLM` (config below, saved with
`save_pretrained`) is trained for the same steps on the same samples, with the same threads,
two ways: by `malleus.trainer.engine.trainer.Trainer` with the model as its `spec.model.path` under the
one-GPU plan (world 1, gloo), and by the plain loop everyone writes (`from_pretrained`, forward
per micro-batch, `clip_grad_norm_`, `torch.optim.AdamW`, the job's LR schedule). Their steps
alternate, so both see the same machine load; the ratio of median step times is the overhead
(target <= 1.10). Peak memory is measured apart, in one fresh child process per loop: the peak
resident set (ru_maxrss) minus the resident set after the imports, before the model is read
(target ratio <= 1.20). The first-step losses must agree (the same model, the same data).

Writes the "Trainer overhead" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from benchdoc import machine, replace_section  # bench/ is on sys.path when run as a script
from transformers import LlamaConfig, LlamaForCausalLM

from malleus.job import ResolvedJob
from malleus.trainer.data.samples import make_source, micro_batch
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.parallel.optim import BETAS, EPS, lr_at
from malleus.trainer.world.world import World

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-cpu.yaml"
CONFIG = {  # a small Llama: GQA, untied head, every part of the real architecture
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SEQUENCE, MICRO, GLOBAL = 128, 4, 16  # 4 micro-batches of 4 x 128 tokens per step


def write_model(folder: Path) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(folder)


def make_job(folder: Path, steps: int) -> ResolvedJob:
    manifest = yaml.safe_load(TINY.read_text())
    spec = manifest["spec"]
    spec.update(nodes=1, gpusPerNode=1, parallelism={"tp": 1}, emulation={"enabled": False})
    spec["model"] = {"path": str(folder), "sequence": SEQUENCE}
    spec["training"] = {
        "globalBatchSize": GLOBAL,
        "microBatchSize": MICRO,
        "steps": steps,
        "learningRate": 1e-3,
        "warmupSteps": 2,
        "dataset": "synthetic",
    }
    return ResolvedJob.load(manifest).check()


class PlainLoop:
    """The loop a user writes around transformers: the yardstick."""

    def __init__(self, job: ResolvedJob, folder: Path) -> None:
        self.job, tr = job, job.spec.training
        self.model = LlamaForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        )
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": tr.weight_decay}, {"params": rest}]
        self.opt = torch.optim.AdamW(
            groups, lr=tr.learning_rate, betas=BETAS, eps=EPS, weight_decay=0.0
        )
        self.source = make_source(tr.dataset, job.model.sequence, job.model.vocab, tr.seed)
        self.step = 0

    def train_step(self) -> float:
        tr, M = self.job.spec.training, self.job.micro_batches
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, tr.learning_rate, tr.warmup_steps, self.job.steps)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(M):
            x, y = micro_batch(self.source, self.step, j, tr.global_batch_size, tr.micro_batch_size)
            logits = self.model(input_ids=x).logits  # (b, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / M).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), tr.grad_clip)
        self.opt.step()
        self.step += 1
        return total / M


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_gpu_trainer(job: ResolvedJob) -> Trainer:
    """The trainer as one rank of a world of one (gloo on 127.0.0.1)."""
    world = World(1)  # failures fatal: any World of one is the one the group was formed with
    if not torch.distributed.is_initialized():
        init_distributed(DistEnv(0, 1, 0, "127.0.0.1", _free_port()), world, init_timeout_s=30)
    return Trainer(job, job.initial_plan(), rank=0, world=world, device=torch.device("cpu"))


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(kind: str, folder: Path, steps: int, threads: int) -> dict[str, Any]:
    """One loop alone in this process: peak resident set above the post-import baseline."""
    torch.set_num_threads(threads)
    base = _rss_bytes()
    job = make_job(folder, steps)
    loop: Any = one_gpu_trainer(job) if kind == "trainer" else PlainLoop(job, folder)
    for _ in range(steps):
        loop.train_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": kind, "peak_mb": (peak - base) / 2**20}


def timed(job: ResolvedJob, folder: Path, steps: int, warmup: int) -> dict[str, Any]:
    trainer, plain = one_gpu_trainer(job), PlainLoop(job, folder)
    times: dict[str, list[float]] = {"trainer": [], "plain": []}
    losses: dict[str, list[float]] = {"trainer": [], "plain": []}
    for i in range(steps):
        for name in ("trainer", "plain") if i % 2 == 0 else ("plain", "trainer"):
            t0 = time.perf_counter()
            loss = trainer.train_step().loss if name == "trainer" else plain.train_step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    return {"times": times, "losses": losses}


def section(args: argparse.Namespace, run: dict[str, Any], mem: dict[str, float]) -> str:
    t = {k: statistics.median(v) for k, v in run["times"].items()}
    step_ratio, mem_ratio = t["trainer"] / t["plain"], mem["trainer"] / mem["plain"]
    l0 = run["losses"]
    n_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**CONFIG)).parameters())
    ok = lambda v, limit: "met" if v <= limit else "NOT met"  # noqa: E731
    return "\n".join(
        [
            "## Trainer overhead",
            "",
            f"Command: `.venv/bin/python bench/overhead.py --steps {args.steps} "
            f"--threads {args.threads}`  ",
            f"Machine: {machine()}; load average {args.load[0]:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end (the machine is shared with other engineers' "
            "tests: both loops alternate step by step, so they see the same load)  ",
            f"Date: {dt.date.today().isoformat()}",
            "",
            f"One process, {args.threads} thread(s), CPU: a random `LlamaForCausalLM` "
            f"({n_params:,} parameters: hidden {CONFIG['hidden_size']}, "
            f"{CONFIG['num_hidden_layers']} layers, {CONFIG['num_attention_heads']} heads / "
            f"{CONFIG['num_key_value_heads']} kv heads, ffn {CONFIG['intermediate_size']}, "
            f"vocab {CONFIG['vocab_size']}), sequence {SEQUENCE}, {GLOBAL // MICRO} "
            f"micro-batches of {MICRO} per step, fp32. *trainer*: `Trainer` under the one-GPU "
            "plan, the model read from its `save_pretrained` folder (`spec.model.path`); "
            "*plain*: `from_pretrained`, a forward and backward per micro-batch, "
            "`clip_grad_norm_`, `torch.optim.AdamW`, the same LR schedule and samples. "
            f"Steps alternate; medians of {args.steps - args.warmup} steps after "
            f"{args.warmup} warm-up. Peak memory: one fresh process per loop, "
            f"{args.mem_steps} steps, peak RSS above the RSS after the imports.",
            "",
            "| | trainer | plain loop | ratio | target |",
            "|---|---:|---:|---:|---|",
            f"| step s (median) | {t['trainer']:.3f} | {t['plain']:.3f} | {step_ratio:.3f} | "
            f"<= 1.10: {ok(step_ratio, 1.10)} |",
            f"| peak memory MB | {mem['trainer']:.0f} | {mem['plain']:.0f} | {mem_ratio:.3f} | "
            f"<= 1.20: {ok(mem_ratio, 1.20)} |",
            "",
            f"First-step loss: trainer {l0['trainer'][0]:.6f}, plain {l0['plain'][0]:.6f} "
            f"(the same model and samples); after {args.steps} steps "
            f"{l0['trainer'][-1]:.6f} and {l0['plain'][-1]:.6f}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", choices=["trainer", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.mem_steps, args.threads)))
        return 0
    args.load = os.getloadavg()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        write_model(folder)
        mem = {}
        for kind in ("trainer", "plain"):
            cmd = [sys.executable, __file__, "--child", kind, "--folder", str(folder)]
            cmd += ["--mem-steps", str(args.mem_steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            mem[kind] = json.loads(out.strip().splitlines()[-1])["peak_mb"]
        run = timed(make_job(folder, args.steps), folder, args.steps, args.warmup)
    text = section(args, run, mem)
    print(text)
    if not args.no_write:
        replace_section("Trainer overhead", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
