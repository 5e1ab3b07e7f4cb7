"""Failure benchmark: live recovery against checkpoint + restart of every process, per fault kind.

Run: .venv/bin/python bench/faults.py [--steps 24] [--at 12] [--kinds replica,rank0,hang,rollback]
     [--jobs default,short] [--out DIR] [--reuse] [--no-write]

Each fault kind is injected into a real local job (`malleus run`, 4 emulated GPUs: tp 2, two
data-parallel replicas, a checkpoint every 5 steps) by this script itself, with a real signal to
the trainer's process once the job has committed step `--at`: SIGKILL (`kill`) or SIGSTOP
(`hang`: its heartbeat stops, and the survivors know it dead within ~2 s). Then the same
job and fault again with `malleus run --mode restart`: every process is stopped and started
again from the latest checkpoint (what TorchElastic and DLRover do; a stopped process is
noticed there by the runner's watch after the job's hang timeout, as a watchdog would: unset,
30 s). Reported per run, from the
run's report (`recoveries`, measured by the runner): seconds from the fault (the moment the
runner saw the process end, or first saw it stopped) to the first step committed after the
recovery, steps lost (committed steps trained again), bytes restored (copied from surviving
replicas, or read back from the checkpoint).

Fault kinds:
- replica:  kill GPU 3 (its replica, GPUs 0-1, holds everything it held);
- rank0:    kill GPU 0, the coordinator (its control endpoint goes with it);
- hang:     SIGSTOP GPU 3;
- rollback: kill GPUs 1 and 3, both holders of the same tensor-parallel shard: no survivor holds
            it, so the job rolls back to its last checkpoint (steps are lost).

Jobs: the same job with the default emulated layers (20 + 40 ms) and with layers 4x shorter:
both modes pay the first step after recovery in full, so the step time caps restart / live
(bench/faults_report.py says how). The runs go one after the other (they would compete for the
CPUs otherwise). Writes the "Failures" section of docs/benchmarks.md (bench/faults_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from benchdoc import LoadSampler, replace_section  # bench/ is on sys.path
from faults_report import render

ROOT = Path(__file__).resolve().parent.parent
KINDS: dict[str, tuple[str, list[int], int]] = {
    "replica": ("kill GPU 3 (a replica holds its shards)", [3], signal.SIGKILL),
    "rank0": ("kill GPU 0 (the coordinator)", [0], signal.SIGKILL),
    "hang": ("hang GPU 3 (SIGSTOP: its heartbeat stops)", [3], signal.SIGSTOP),
    "rollback": ("kill GPUs 1 and 3 (both holders of a shard)", [1, 3], signal.SIGKILL),
}


JOBS: dict[str, tuple[str, int, int]] = {
    "default": ("Emulated layers of 20 + 40 ms (forward + backward)", 20, 40),
    "short": ("Emulated layers of 5 + 10 ms", 5, 10),
}
"""Job name -> (title, layer forward ms, layer backward ms): the same job, other step times."""


def manifest(
    steps: int, hang_timeout: int | None, forward_ms: int, backward_ms: int
) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "maxRestarts": 2,
        "restartBackoffSeconds": 0,
        "gracePeriodSeconds": 30,
    }
    if hang_timeout is not None:  # unset: the job's default (10 measured steps, >= 30 s)
        policy["hangTimeoutSeconds"] = hang_timeout
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "faults-bench"},
        "spec": {
            "image": "malleus:bench",
            "nodes": 1,
            "gpusPerNode": 4,
            "model": {"preset": "tiny", "layers": 4},
            "training": {
                "globalBatchSize": 4,
                "microBatchSize": 1,
                "steps": steps,
                "learningRate": 0.003,
                "warmupSteps": 2,
            },
            "parallelism": {"tp": 2},
            "failurePolicy": policy,
            "checkpoint": {"intervalSteps": 5},
            "emulation": {
                "enabled": True,
                "layerForwardMs": forward_ms,
                "layerBackwardMs": backward_ms,
            },
        },
    }


def trainer_pids(workdir: Path) -> dict[int, int]:
    """rank -> pid of the running trainer processes of `workdir` (through /proc)."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if b"malleus.trainer" not in cmd or b"store" in cmd:
                continue
            if not any(str(workdir).encode() in c for c in cmd):
                continue
            env = dict(
                kv.split(b"=", 1)
                for kv in (proc / "environ").read_bytes().split(b"\0")
                if b"=" in kv
            )
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, IndexError):
            continue
        found[int(env[b"RANK"])] = int(proc.name)
    return found


def committed(workdir: Path, step: int) -> bool:
    logs = workdir / "logs" / "launch-1"
    return logs.is_dir() and any(
        f"[malleus] step {step - 1} ({step}/" in p.read_text(errors="replace")
        for p in logs.glob("rank-*.log")
    )


def run_one(
    job: Path, mode: str, kind: str, at: int, out: Path, reuse: bool = False
) -> dict[str, Any]:
    """One `malleus run` with the fault injected after step `at`; its report."""
    _, ranks, sig = KINDS[kind]
    work = out / f"{kind}-{mode}"
    report = out / f"{kind}-{mode}.json"
    if reuse and report.exists():  # an earlier invocation's run of this kind and mode
        data = json.loads(report.read_text())
        data["_code"] = data["exit"]["code"]
        return data
    cmd = [sys.executable, "-m", "malleus.cli", "run", str(job), "--mode", mode]
    cmd += ["--workdir", str(work), "--report", str(report), "--progress", "lines"]
    cmd += ["--progress-interval", "30"]
    print(f"== {kind} / {mode}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 600
    while not committed(work, at):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            print(f"{kind}/{mode}: the run ended before step {at}", file=sys.stderr)
            why = f"the run ended before step {at} (exit {proc.returncode}), before the fault"
            return {"_code": proc.returncode, "steps": 0, "exit": {"code": 1, "reason": why}}
        time.sleep(0.05)
    pids = trainer_pids(work)
    for rank in ranks:
        os.kill(pids[rank], sig)
    code = proc.wait(timeout=900)
    data: dict[str, Any] = json.loads(report.read_text())
    data["_code"] = code
    return data


def detection(report: dict[str, Any]) -> float | None:
    """Seconds from the fault to its detection: the trainers' (live: the fault to the first
    survivor's failed collective = runner's figure less the coordinator's) or the runner's
    (restart: when it acted on the failure)."""
    recs, fails = report.get("recoveries") or [], report.get("failures") or []
    if not recs:
        return None
    first = recs[0]
    if first.get("trainer_seconds") is not None and first.get("seconds") is not None:
        return max(0.0, first["seconds"] - first["trainer_seconds"])
    if fails and fails[0].get("seen") is not None:
        return max(0.0, fails[0]["seen"] - fails[0]["time"])
    return None


def outcome(report: dict[str, Any], at: int) -> dict[str, Any]:
    recs = report.get("recoveries") or []
    first = recs[0] if recs else {}
    rows = report.get("per_step") or []
    own = [  # the first committed step's own time: it runs on the GPUs left
        r.get("seconds") for r in rows if r.get("step") == first.get("step")
    ]
    return {
        "detection": detection(report),
        "first_step": own[0] if own else None,
        # before the fault, past the first plan's calibration window (CAL_WARMUP + CAL_STEPS)
        "healthy_steps": [r["seconds"] for r in rows if 5 <= r["step"] < at and r.get("seconds")],
        "code": report["_code"],
        "steps": report.get("steps"),
        "seconds": first.get("seconds"),
        "trainer_seconds": first.get("trainer_seconds"),
        "steps_lost": first.get("steps_lost"),
        "bytes": first.get("bytes_restored"),
        "mode": first.get("mode"),
        "wall": report.get("wall_seconds"),
        "loss": report.get("final_loss"),
        "reason": report["exit"]["reason"].splitlines()[0] if report["exit"]["code"] else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--at", type=int, default=12, help="inject after this step")
    parser.add_argument(
        "--hang-timeout", type=int, default=None, help="hangTimeoutSeconds (default: unset)"
    )
    parser.add_argument(
        "--kinds", type=lambda s: s.split(","), default=list(KINDS), help=",".join(KINDS)
    )
    parser.add_argument(
        "--jobs", type=lambda s: s.split(","), default=list(JOBS), help=",".join(JOBS)
    )
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["live", "restart"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--reuse", action="store_true", help="keep the reports already in --out (run the rest)"
    )
    args = parser.parse_args(argv)
    unknown = sorted({*args.kinds} - {*KINDS}) + sorted({*args.jobs} - {*JOBS})
    if unknown:
        parser.error(f"unknown kinds or jobs {unknown}: kinds {list(KINDS)}, jobs {list(JOBS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="malleus-faults-"))
    jobs: dict[str, list[dict[str, Any]]] = {}
    with LoadSampler() as load:
        for name in args.jobs:
            where = out / name
            where.mkdir(parents=True, exist_ok=True)
            job = where / "job.yaml"
            if not (args.reuse and job.exists()):
                spec = manifest(args.steps, args.hang_timeout, *JOBS[name][1:])
                job.write_text(yaml.safe_dump(spec, sort_keys=False))
            jobs[name] = [_row(job, kind, args, where) for kind in args.kinds]
    labels = {k: v[0] for k, v in KINDS.items()}
    section = render(jobs, {k: v[0] for k, v in JOBS.items()}, labels, args, load.summary())
    print(section)
    (out / "faults.json").write_text(json.dumps(jobs, indent=1))
    if not args.no_write:
        replace_section("Failures", section)
    return 0


def _row(job: Path, kind: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One fault kind on one job: its live and restart outcomes ("-" for a mode not run)."""
    row: dict[str, Any] = {"kind": kind}
    for mode in ("live", "restart"):
        if mode in args.modes:
            row[mode] = outcome(run_one(job, mode, kind, args.at, out, args.reuse), args.at)
        else:
            keys = ("seconds", "steps_lost", "bytes", "mode", "detection", "first_step")
            row[mode] = {**dict.fromkeys(keys), "code": "-", "reason": ""}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
