"""Migration benchmark: a straggler appears; switch live (Malleus) or checkpoint and restart.

Run: .venv/bin/python bench/migration.py [--no-write]

Eight ranks (2 nodes x 4 emulated GPUs, tp 2) train a small GPT under the emulated GPU clock:
every layer-shard forward/backward is charged a fixed time, so step times follow the layout even
on a shared CPU box, while the real math, the real gloo transfers and the real process starts
run as they are. Rank 5 becomes 8x slower at step 4; the planner (given the new rates and the
plan in force) picks a new layout, in force from step 6 in both runs:

- live: `malleus train --switch 6:new.json`: every process stays, state migrates in place;
- restart: `malleus train --until 6 --checkpoint-dir D` (checkpoint, every process exits), then
  `malleus train --resume --plan new.json` (relaunch, join, load, continue): what
  restart-based elastic systems do.

Seconds lost to the change = wall time from the end of step 5 to the end of step 7, minus what
steps 6 (old plan, as measured) and 7 (new plan, at its steady median) take when nothing happens. A third run switches through a series of planner plans and records migration seconds
against the bytes moved and the minimal bytes the layout change requires.

Writes the "Migration" section of docs/benchmarks.md (command, machine, date, tables).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from benchdoc import machine, replace_section  # bench/ is on sys.path when run as a script

from malleus.notation import layer_range, parse_size, size, size_mib
from malleus.planner import Plan, PlanningProblem, migration_mb

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"

STEPS, STRAGGLE_AT, SWITCH_AT = 16, 4, 6
SLOW_RANK, SLOW_FACTOR = 5, 8.0
MODEL = {"layers": 4, "hidden": 128, "heads": 8, "ffn": 512, "vocab": 1024, "sequence": 16}
FORWARD_MS, BACKWARD_MS = 10.0, 20.0
SWEEP_RATES: list[dict[int, float | None]] = [  # the plans the sweep switches through, in order
    {5: 8.0},
    {},
    {0: None, 1: None},
    {1: 4.0, 6: 4.0},
    {},
    {3: None, 4: None, 5: None},
    {2: 2.0, 3: 2.0, 4: 2.0},
    {7: 8.0, 0: 8.0},
]

# The trainer's lines (malleus.notation): `[malleus] step 4 (5/30) loss ... 0.846s ...` keyed here
# by steps done; sizes in binary units, read back to their precision (0.1 of the unit).
STEP_RE = re.compile(r"\[malleus\] step \d+ \((\d+)/\d+\) loss \S+ norm \S+ lr \S+ ([\d.]+)s")
SWITCH_RE = re.compile(
    r"switched to plan generation (\d+) from step (\d+): moved ([\d.,]+ \w+) "
    r"\(minimal ([\d.,]+ \w+)\) in ([\d.]+) s"
)


def manifest(steps: int, schedule: list[dict[str, Any]], emulation: bool = True) -> dict:
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "migration-bench"},
        "spec": {
            "image": "malleus:bench",
            "nodes": 2,
            "gpusPerNode": 4,
            "model": MODEL,
            "training": {
                "globalBatchSize": 16,
                "microBatchSize": 1,
                "steps": steps,
                "learningRate": 0.003,
                "warmupSteps": 2,
            },
            "parallelism": {"tp": 2},
            "emulation": {
                "enabled": emulation,
                "layerForwardMs": FORWARD_MS,
                "layerBackwardMs": BACKWARD_MS,
                "schedule": schedule,
            },
        },
    }


def planner(problem: PlanningProblem) -> Plan:
    from malleus.planner import plan

    return plan(problem, time_limit=5.0)


# ---- running `malleus train` and reading its log ---------------------------------------------
@dataclass
class Log:
    """Rank 0's lines with the bench's clock: step ends and switches."""

    step_at: dict[int, float] = field(default_factory=dict)  # step count -> monotonic seconds
    step_seconds: dict[int, float] = field(default_factory=dict)  # the trainer's own figure
    switches: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0


def train(args: list[str], log: Log) -> None:
    """Run `malleus train ARGS` to the end, timestamping rank 0's lines into `log`."""
    cmd = [sys.executable, "-m", "malleus.cli", "train", *args, "--log-every", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log.started = log.started or time.monotonic()
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    ) as proc:
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            now = time.monotonic()
            tail.append(line)
            if m := STEP_RE.search(line):
                log.step_at[int(m[1])] = now
                log.step_seconds[int(m[1])] = float(m[2])
            elif m := SWITCH_RE.search(line):
                log.switches.append(
                    {
                        "generation": int(m[1]),
                        "step": int(m[2]),
                        "bytes": round(parse_size(m[3])),
                        "minimal": round(parse_size(m[4])),
                        "seconds": float(m[5]),
                    }
                )
    if proc.returncode:
        sys.stderr.write("".join(line for line in tail[-300:] if "Terminating process" not in line))
        raise SystemExit(f"malleus train failed ({proc.returncode}): {' '.join(cmd)}")
    log.ended = time.monotonic()


# ---- the two ways through a straggler --------------------------------------------------------
@dataclass
class Outcome:
    name: str
    old_step: float  # median step seconds on the old plan with the straggler
    new_step: float  # median step seconds on the new plan
    lost: float  # seconds lost to the change
    total: float  # wall seconds of the whole run (launches included)


def outcome(name: str, log: Log) -> Outcome:
    """Seconds lost: the wall time from the end of step K-1 to the end of step K+1 (K = the
    last step on the old plan), less what those two steps take when nothing happens: step K as
    the trainer measured it, step K+1 at the new plan's steady median. What remains is the
    change itself (migration; or checkpoint, exit, relaunch, join, load) plus any warm-up it
    causes in step K+1."""
    old = statistics.median(log.step_seconds[k] for k in range(STRAGGLE_AT + 1, SWITCH_AT + 1))
    new = statistics.median(log.step_seconds[k] for k in range(SWITCH_AT + 3, STEPS + 1))
    around = log.step_at[SWITCH_AT + 1] - log.step_at[SWITCH_AT - 1]
    lost = around - log.step_seconds[SWITCH_AT] - new
    return Outcome(name, old, new, lost, log.ended - log.started)


def straggler_runs(work: Path) -> tuple[Plan, Plan, Log, Log]:
    from malleus.job import ResolvedJob

    schedule = [{"step": STRAGGLE_AT, "rank": SLOW_RANK, "factor": SLOW_FACTOR}]
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(manifest(STEPS, schedule)))
    resolved = ResolvedJob.load(str(job)).check()
    old = planner(resolved.problem())  # healthy: the uniform layout
    problem = resolved.problem({SLOW_RANK: SLOW_FACTOR}, previous_plan=old)
    new = planner(problem).model_copy(update={"generation": 1})
    (work / "old.json").write_text(old.to_json())
    (work / "new.json").write_text(new.to_json())

    live = Log()
    switch = f"{SWITCH_AT}:{work / 'new.json'}"
    train([str(job), "--plan", str(work / "old.json"), "--switch", switch], live)
    restart, ckpt = Log(), work / "ckpt"
    keep = ["--checkpoint-dir", str(ckpt)]
    train([str(job), "--plan", str(work / "old.json"), "--until", str(SWITCH_AT), *keep], restart)
    train([str(job), "--plan", str(work / "new.json"), "--resume", *keep], restart)
    return old, new, live, restart


def sweep(work: Path) -> list[dict[str, Any]]:
    """One run switching through planner plans for SWEEP_RATES; each switch's figures."""
    from malleus.job import ResolvedJob

    job = work / "sweep.yaml"
    job.write_text(yaml.safe_dump(manifest(len(SWEEP_RATES) + 2, [], emulation=False)))
    resolved = ResolvedJob.load(str(job)).check()
    previous = planner(resolved.problem())
    (work / "sweep-0.json").write_text(previous.to_json())
    # Real timings, 8 ranks on fewer cores: the rates would measure contention (what the
    # resource check refuses), but this run measures migrations, not rates.
    args = [str(job), "--plan", str(work / "sweep-0.json"), "--no-resource-check"]
    estimates = []
    for i, rates in enumerate(SWEEP_RATES, start=1):
        problem = resolved.problem(rates, previous_plan=previous)
        plan = planner(problem).model_copy(update={"generation": i})
        estimates.append((rates, migration_mb(problem, previous, plan)))
        (work / f"sweep-{i}.json").write_text(plan.to_json())
        args += ["--switch", f"{i}:{work / f'sweep-{i}.json'}"]
        previous = plan
    log = Log()
    train(args, log)
    rows = []
    for s, (rates, mb) in zip(log.switches, estimates, strict=True):
        rows.append({**s, "rates": rates, "planner_mb": mb})
    return rows


# ---- report ----------------------------------------------------------------------------------


def _rates(r: dict[int, float | None]) -> str:
    if not r:
        return "all healthy"
    return ", ".join(f"{k}: {'failed' if v is None else f'{v:g}x'}" for k, v in r.items())


def render(old: Plan, new: Plan, outcomes: list[Outcome], live: Log, rows: list[dict]) -> str:
    mig = live.switches[0]
    lines = [
        "## Migration",
        "",
        "Command: `.venv/bin/python bench/migration.py`  ",
        f"Machine: {machine()}, load average {os.getloadavg()[0]:.1f} at the end (shared box)  ",
        f"Date: {dt.date.today().isoformat()}",
        "",
        f"8 ranks = 2 nodes x 4 emulated GPUs, tp 2, a GPT of {MODEL['layers']} layers "
        f"(hidden {MODEL['hidden']}, ffn {MODEL['ffn']}, vocab {MODEL['vocab']}), 16 "
        f"micro-batches per step, every layer-shard charged {FORWARD_MS:g} ms forward and "
        f"{BACKWARD_MS:g} ms backward by the emulated clock (real math, real gloo transfers, real "
        f"process starts). Rank {SLOW_RANK} becomes {SLOW_FACTOR:g}x slower at step "
        f"{STRAGGLE_AT}; the planner's new plan is in force from step {SWITCH_AT} in both runs.",
        "",
        f"Old plan: {_layout(old)}. New plan: {_layout(new)}.",
        "",
        "| run | step on the old plan, straggling (s) | step on the new plan (s) | "
        "seconds lost to the change | whole run (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.name} | {o.old_step:.3f} | {o.new_step:.3f} | {o.lost:.2f} | {o.total:.1f} |"
        )
    live_o, restart_o = outcomes
    gain = live_o.old_step - live_o.new_step
    lines += [
        "",
        f"The live switch moved {size(mig['bytes'])} (minimal: {size(mig['minimal'])}) in "
        f"{mig['seconds']:.3f} s; it lost {live_o.lost:.2f} s in all (migration, then a first "
        f"step on new groups). Restarting lost {restart_o.lost:.1f} s: checkpoint, exit, "
        f"relaunch of 8 processes (each importing torch), join, load, a cold first step. "
        f"The new plan saves {gain:.2f} s per step over staying on the old one with the "
        f"straggler, so the restart needs {restart_o.lost / gain:.0f} steps to pay for itself"
        + (
            f", the live switch {live_o.lost / gain:.1f}."
            if live_o.lost > 0
            else ", the live switch none."
        ),
        "",
        "Migration seconds against bytes: one run switching through planner plans (each "
        "planned with the previous plan in force); `minimal` = every piece, with its two Adam "
        "moments and step (fp32), that a rank holds under the new plan and not under the old "
        "(malleus.planner.cost.holdings); the planner's estimate counts its memory model's "
        "16 bytes per parameter (gradient included), hence ~4/3 of the real volume.",
        "",
        "| switch to rates | moved | minimal | planner estimate | seconds | MiB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r["bytes"] / 2**20 / r["seconds"] if r["seconds"] > 0 else float("nan")
        lines.append(
            f"| {_rates(r['rates'])} | {size(r['bytes'])} | {size(r['minimal'])} | "
            f"{size_mib(r['planner_mb'])} | {r['seconds']:.3f} | {rate:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _layout(plan: Plan) -> str:
    parts = []
    for p in plan.pipelines:
        stages = " / ".join(f"{s.ranks} layers {layer_range(s.layers)}" for s in p.stages)
        parts.append(f"({stages}, m={p.micro_batches})")
    text = " ".join(parts)
    return text + (f", excluded {plan.excluded}" if plan.excluded else "")


def write_doc(section: str) -> None:
    """Replace (or append) the "## Migration" section, leaving the others' sections alone."""
    replace_section("Migration", section, DOC)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="malleus-migration-") as tmp:
        work = Path(tmp)
        old, new, live, restart = straggler_runs(work)
        outcomes = [
            outcome("live switch (Malleus)", live),
            outcome("checkpoint + restart", restart),
        ]
        rows = sweep(work)
    section = render(old, new, outcomes, live, rows)
    print(section)
    print(json.dumps([o.__dict__ for o in outcomes], indent=1))
    if not args.no_write:
        write_doc(section)
        print(f"wrote the Migration section of {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
