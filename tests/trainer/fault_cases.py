"""Helpers for the failure tests: a spawned fault-tolerant job that trains through failures.

Not collected by pytest (no test_ prefix); imported by path so spawned children can unpickle it.
"""

from __future__ import annotations

import functools
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_cases import stop_rank
from trainer_cases import plan as make_plan

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.engine.services import Services
from malleus.trainer.launch.distributed import DistEnv
from malleus.trainer.launch.spawn import spawn_local
from malleus.trainer.recovery.ledger import Ledger
from malleus.trainer.run.loop import run_rank
from malleus.trainer.run.options import RunOptions
from malleus.trainer.run.reference import train_reference
from malleus.trainer.run.start import enter_job


def run(
    job: ResolvedJob,
    plan: Plan,
    opts: RunOptions,
    out: str,
    ports: list[int] | None = None,
    replace: int | None = None,
    hosts: list[str] | None = None,
) -> int:
    """Spawned-job body: `run_rank` under `plan`; every rank that finishes writes
    OUT/rank-G.json (its step, members, recoveries, the plan in force, the status' `out` and
    `last_recovery`; with `ports`, what its own control endpoint serves at /status and /plan
    when it is the coordinator, on `hosts[G]` when given, as a pod listens on its IP); the
    coordinator writes the final model to `opts.save_model`."""
    env = DistEnv.from_env()
    joiner = False
    if replace is not None:  # spawned one more than the job: the last is GPU `replace` again
        joiner = env.rank == job.world
        os.environ.update(WORLD_SIZE=str(job.world), RANK=str(replace if joiner else env.rank))
        env = DistEnv.from_env()
    if joiner:  # GPU `replace` again (its RANK), once its predecessor is gone
        _wait_for_death(env, env.rank)
    entered = enter_job(env, job, plan, init_timeout_s=120, join=joiner)
    world, device, plan, admission = entered.world, entered.device, entered.plan, entered.admission
    seen: dict[str, Any] = {}
    ledger = Ledger()
    steps = opts.total_steps(job)
    if ports is None:
        services = Services.null(job, env.rank, steps=steps, coordinator=world.coordinator())
    else:
        services = Services.create(
            job,
            env.rank,
            control_port=ports[env.rank],
            steps=steps,
            host=hosts[env.rank] if hosts is not None else None,
            serve_when_coordinator=True,
            coordinator=world.coordinator(),
        )
    try:
        run_rank(
            job,
            plan,
            opts,
            rank=env.rank,
            world=world,
            device=device,
            services=services,
            trainer_hook=lambda t: seen.setdefault("trainer", t),
            admission=admission,
            ledger=ledger,
        )
        trainer = seen["trainer"]
        m = world.current
        status = services.status()
        result = {
            "rank": env.rank,
            "step": trainer.step,
            "members": list(m.members) if m else None,
            "epoch": m.epoch if m else 0,
            "recoveries": ledger.recoveries,
            "spurious": {str(s): n for s, n in ledger.spurious.items()},  # redone, nobody failed
            "plan": json.loads(trainer.plan.to_json()),
            "out": {str(g): w for g, w in status.out.items()},
            "last_recovery": status.last_recovery.model_dump(mode="json")
            if status.last_recovery
            else None,
            "last_failure": status.last_failure.model_dump(mode="json")
            if status.last_failure
            else None,
            "finished": time.time(),
            "served": _served(services),
        }
        (Path(out) / f"rank-{env.rank}.json").write_text(json.dumps(result))
    finally:
        services.close()
        stop_rank()
    return 0


def _wait_for_death(env: DistEnv, gpu: int) -> None:
    """A replacement starts once its predecessor is gone (the launcher marks it dead)."""
    store = dist.PrefixStore(
        "malleus/0/", dist.TCPStore(env.master_addr, env.master_port, None, False)
    )
    deadline = time.monotonic() + 120
    while not store.check([f"rec/dead/{gpu}"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"GPU {gpu} never died")
        time.sleep(0.1)


def _served(services: Services) -> dict[str, Any] | None:
    if services.server is None:
        return None
    got = {}
    auth = {"Authorization": f"Bearer {services.server.token}"}  # reads need the token too
    for path in ("/status", "/plan"):
        request = urllib.request.Request(services.server.url + path, headers=auth)
        with urllib.request.urlopen(request, timeout=10) as r:
            got[path] = json.loads(r.read())
    return got


TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
MODEL = {"layers": 4, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}
TRAINING = {
    "globalBatchSize": 8,
    "microBatchSize": 1,
    "steps": 5,
    "learningRate": 3e-3,
    "warmupSteps": 1,
}


def fault_job(
    failures: list[tuple[int, int, str]] = (),  # type: ignore[assignment]
    *,
    hang_timeout: int | None = None,
    steps: int = 5,
    layer_ms: float = 2,
    slow: list[tuple[int, int, float]] = (),  # type: ignore[assignment]
) -> ResolvedJob:
    """2 nodes x 2 GPUs, tp 2, a 4-layer model, emulated clock (2/4 ms per layer-shard) with
    these (step, rank, kill|hang) failures and (step, rank, factor) slowdowns, and
    spec.failurePolicy.hangTimeoutSeconds."""
    import yaml

    manifest = yaml.safe_load(TINY.read_text())
    manifest["metadata"]["name"] = "faults"
    spec = manifest["spec"]
    spec.update(nodes=2, gpusPerNode=2, parallelism={"tp": 2})
    spec["model"] = dict(MODEL)
    spec["training"] = TRAINING | {"steps": steps}
    spec["emulation"] = {
        "enabled": True,
        "layerForwardMs": layer_ms,
        "layerBackwardMs": 2 * layer_ms,
        "schedule": [{"step": s, "rank": r, "fail": f} for s, r, f in failures]
        + [{"step": s, "rank": r, "factor": x} for s, r, x in slow],
    }
    if hang_timeout is not None:
        spec["failurePolicy"] = {"hangTimeoutSeconds": hang_timeout}
    return ResolvedJob.load(manifest).check()


STEPS = 5
REPLICAS = make_plan([(4, [([0, 1], (0, 4))]), (4, [([2, 3], (0, 4))])])
"""Two data-parallel copies of the whole model: GPUs 0-1 and 2-3."""


@functools.cache
def reference(until: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The single-process model after `until` of `steps` steps (float64)."""
    torch.set_num_threads(1)
    return train_reference(fault_job(steps=steps), until=until, float64=True).full_state()


def train_job(
    tmp: Path,
    job: Any,
    plan: Any,
    *,
    ports: list[int] | None = None,
    replace: int | None = None,
    **options: Any,
) -> tuple[list[int | None], dict[int, dict[str, Any]], dict[str, torch.Tensor], float]:
    """Spawn the 4-rank fault-tolerant job (5 with `replace`: a replacement for that GPU) and
    return the exit codes, each finishing rank's OUT/rank-G.json, the final model, the seconds."""
    out = tmp / "out"
    out.mkdir()
    opts = RunOptions(float64=True, save_model=str(out / "model.pt"), **options)
    t0 = time.monotonic()
    n = 4 if replace is None else 5
    body = (job, plan, opts, str(out), ports, replace)
    codes = spawn_local(n, run, body, fault_tolerant=True)
    seconds = time.monotonic() - t0
    results = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")
    }
    return codes, results, torch.load(out / "model.pt"), seconds


def one_recovery(
    results: dict[int, dict[str, Any]], survivors: list[int], steps: int = STEPS
) -> dict[str, Any]:
    """The one recovery every survivor went through (the same on all), checked."""
    assert sorted(results) == survivors
    for r in results.values():
        assert r["members"] == survivors and r["step"] == steps
        assert len(r["recoveries"]) == 1, r["recoveries"]
    rec = results[survivors[0]]["recoveries"][0]
    assert all(r["recoveries"][0]["generation"] == rec["generation"] for r in results.values())
    return rec
