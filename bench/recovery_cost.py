"""Recovery cost benchmark: what one live recovery costs the job's store as the world grows.

Run: .venv/bin/python bench/recovery_cost.py [--sizes 4,8,16,32,64] [--layer-ms 2] [--steps 4]
     [--at 2] [--out DIR] [--reuse FILE] [--no-write]

For each world size N, a real fault-tolerant job of N emulated ranks (gloo on this host, the
launcher's store, `spawn_local`) trains a tiny model as N data-parallel replicas (tp 1, one
stage each, layers of `--layer-ms` ms forward and twice that backward); rank N-1 is SIGKILLed
in the middle of step `--at` (the job's own fault schedule), the N-1 survivors recover from
replicas and finish. Every store call of each survivor's recovery is counted on its own client
(trainer/recovery/tally.py `Tally`: calls by operation and key kind, round trips, bytes written
and read; torch's rendezvous of the next process group included) and lands in its recovery
record; this script reads the records and reports, per N, the leader's cost, a member's, the
total through the one store, the decision's size, the leader's wait and decision times, and
the recovery's seconds (fault to the first committed step after it). Then it fits each figure's
growth (a power law over the sizes run) and extrapolates to 1,024 and 4,096 ranks.

Only the store's side is counted: the data moved to restore the lost replica's pieces goes
through the process group (as much as one rank holds, whatever N) and the alarm's polling and
heartbeats are the steady price of detection (trainer/world/alarm.py bounds them per second).
The runs go one after the other; every one starts N Python processes importing torch, which on
a small machine is what limits N (memory: ~0.3 GB each).

Writes the "Failures: recovery cost" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchdoc import LoadSampler, machine, replace_section  # bench/ is on sys.path

TITLE = "Failures: recovery cost"
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}
SCALES = (1024, 4096)
"""The world sizes each figure is extrapolated to."""


def job_for(n: int, *, steps: int, at: int, layer_ms: float) -> Any:
    """N GPUs (nodes of up to 8), tp 1, a 2-layer model, rank N-1 killed mid-step `at`."""
    from malleus.job import ResolvedJob

    gpn = min(n, 8)
    manifest = {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": f"recovery-cost-{n}"},
        "spec": {
            "image": "malleus:bench",
            "nodes": n // gpn,
            "gpusPerNode": gpn,
            "model": dict(MODEL),
            "training": {
                "globalBatchSize": n,
                "microBatchSize": 1,
                "steps": steps,
                "learningRate": 3e-3,
                "warmupSteps": 1,
            },
            "parallelism": {"tp": 1},
            "emulation": {
                "enabled": True,
                "layerForwardMs": layer_ms,
                "layerBackwardMs": 2 * layer_ms,
                "schedule": [{"step": at, "rank": n - 1, "fail": "kill"}],
            },
            "failurePolicy": {"hangTimeoutSeconds": 120},
        },
    }
    return ResolvedJob.load(manifest).check()


def replicas(n: int) -> Any:
    """N data-parallel replicas: one single-stage pipeline per GPU (every piece held N times)."""
    from malleus.planner import Plan

    stage = {"layers": [0, MODEL["layers"]]}
    pipes = [{"micro_batches": 1, "stages": [{"ranks": [g], **stage}]} for g in range(n)]
    return Plan.model_validate({"tp": 1, "pipelines": pipes, "excluded": []})


def body(job: Any, plan: Any, out: str) -> int:
    """One rank of the spawned job: train through the failure, write OUT/rank-G.json. The
    rank enters its job as `malleus-trainer` does (trainer/run/start.py)."""
    from malleus.trainer.engine.services import Services
    from malleus.trainer.launch.distributed import DistEnv
    from malleus.trainer.recovery.ledger import Ledger
    from malleus.trainer.run.loop import run_rank
    from malleus.trainer.run.options import RunOptions
    from malleus.trainer.run.start import enter_job

    env = DistEnv.from_env()
    entered = enter_job(env, job, plan, init_timeout_s=600)
    world, device, plan = entered.world, entered.device, entered.plan
    ledger, seen = Ledger(), {}
    opts = RunOptions()
    services = Services.null(job, env.rank, steps=job.steps, coordinator=world.coordinator())
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
            ledger=ledger,
        )
        m = world.current
        result = {
            "rank": env.rank,
            "step": seen["trainer"].step,
            "members": list(m.members) if m else None,
            "recoveries": ledger.recoveries,
        }
        (Path(out) / f"rank-{env.rank}.json").write_text(json.dumps(result))
    finally:
        services.close()
    return 0


def run_size(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One job of `n` ranks through one kill; the recovery's cost as its survivors counted it."""
    from malleus.trainer.launch.spawn import spawn_local

    out = root / f"n{n}"
    out.mkdir(parents=True, exist_ok=True)
    job = job_for(n, steps=args.steps, at=args.at, layer_ms=args.layer_ms)
    t0 = time.monotonic()
    codes = spawn_local(n, body, (job, replicas(n), str(out)), fault_tolerant=True)
    wall = time.monotonic() - t0
    if codes[:-1] != [0] * (n - 1):
        raise RuntimeError(f"N={n}: the survivors did not all finish: codes {codes}")
    return summarize(n, read_records(out, n, args.steps), wall)


def read_records(out: Path, n: int, steps: int) -> dict[int, dict[str, Any]]:
    """Each survivor's record of the recovery, from the files its rank wrote."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    survivors = list(range(n - 1))
    if sorted(r["rank"] for r in ranks) != survivors:
        raise RuntimeError(f"N={n}: survivors {sorted(r['rank'] for r in ranks)} wrote results")
    assert all(r["members"] == survivors and r["step"] == steps for r in ranks), ranks
    return {r["rank"]: r["recoveries"][-1] for r in ranks}


def summarize(n: int, records: dict[int, dict[str, Any]], wall: float) -> dict[str, Any]:
    """The figures of one size from the survivors' recovery records."""
    stores = {g: rec["store"] for g, rec in records.items()}
    (leader,) = [g for g, s in stores.items() if s["led"]]
    others = [s for g, s in stores.items() if g != leader]
    lead = stores[leader]

    def pg_calls(s: dict[str, Any]) -> int:
        return sum(c for k, c in s["keys"].items() if "pg/" in k)

    def calls(s: dict[str, Any], kinds: tuple[str, ...]) -> int:
        return sum(c for k, c in s["keys"].items() if k in kinds)

    def fixed(s: dict[str, Any], waiting: int) -> int:
        # round trips that do not depend on how long the wait lasted
        return s["round_trips"] - waiting

    rec = records[leader]
    member_wait = [calls(s, MEMBER_WAIT) for s in others]
    # the leader's polls of the arrivals' count (its own arrival's `add` is not one)
    counter = lead["keys"].get("add rec/#/arrivals", 1) - 1
    lead_wait = calls(lead, LEADER_WAIT) + calls(lead, MEMBER_WAIT) + counter
    return {
        "n": n,
        "leader": leader,
        "leader_fixed": fixed(lead, lead_wait),
        "leader_polling": lead_wait,
        "leader_arrivals_read": lead["keys"].get("get rec/#/alive/#", 0),
        "member_fixed": statistics.median(
            fixed(s, w) for s, w in zip(others, member_wait, strict=True)
        ),
        "member_polling": statistics.median(member_wait),
        "total_fixed": fixed(lead, lead_wait)
        + sum(fixed(s, w) for s, w in zip(others, member_wait, strict=True)),
        "leader_round_trips": lead["round_trips"],
        "leader_bytes_read": lead["bytes_read"],
        "leader_bytes_written": lead["bytes_written"],
        "member_round_trips": statistics.median(s["round_trips"] for s in others),
        "member_round_trips_max": max(s["round_trips"] for s in others),
        "member_bytes_read": statistics.median(s["bytes_read"] for s in others),
        "member_pg_calls": statistics.median(pg_calls(s) for s in others),
        "total_round_trips": sum(s["round_trips"] for s in stores.values()),
        "total_bytes": sum(s["bytes_read"] + s["bytes_written"] for s in stores.values()),
        "decision_bytes": lead["decision_bytes"],
        "leader_wait_s": sum(x["wait_s"] for x in lead["led"]),
        "leader_decide_s": sum(x["decide_s"] for x in lead["led"]),
        "seconds": rec["seconds"],
        "epochs": lead["epochs"],
        "mode": rec["mode"],
        "steps_lost": rec["steps_lost"],
        "wall_s": wall,
        "leader_keys": lead["keys"],
    }


MEMBER_WAIT = ("check rec/#/decision", "check rec/dead/#", "add rec/beat/#")
"""A survivor's calls while it waits for the decision (one `check` of the decision and of the
leader's dead mark per poll, a heartbeat read now and then): they grow with the wait, not N."""
LEADER_WAIT = ("get rec/dead/#", "check rec/#/released/#")
"""The leader's calls while it waits for the arrivals, besides those of `MEMBER_WAIT` (its
dead-mark checks and heartbeat reads of the members still missing are counted there) and its
polls of the arrivals' count (`add rec/E/arrivals`, all but its own arrival's)."""

FIGURES: dict[str, tuple[str, str | None]] = {
    "leader_fixed": ("leader: round trips besides polling", "linear"),
    "leader_arrivals_read": ("leader: arrivals read (`get rec/E/alive/G`)", "linear"),
    "leader_polling": ("leader: round trips polling the arrivals", None),
    "leader_bytes_read": ("leader: bytes read", "linear"),
    "member_fixed": ("a member (median): round trips besides polling", "linear"),
    "member_pg_calls": ("a member: of which the gloo group's rendezvous (`pg/`)", "linear"),
    "member_polling": ("a member (median): round trips polling for the decision", None),
    "member_bytes_read": ("a member (median): bytes read", "linear"),
    "total_fixed": ("all survivors: round trips besides polling", "per-rank"),
    "total_round_trips": ("all survivors: round trips, polling included", None),
    "total_bytes": ("all survivors: bytes through the store", "per-rank"),
    "decision_bytes": ("the decision (bytes)", "linear"),
    "leader_wait_s": ("leader: waiting for the arrivals (s)", None),
    "leader_decide_s": ("leader: deciding, planning included (s)", None),
    "seconds": ("recovery: fault to first committed step (s)", None),
}
"""Figure -> (label, how it is extrapolated): `linear` (a + b N, least squares over the sizes
run: what one rank or the decision holds), `per-rank` (N times a linear fit of the figure per
survivor: totals through the one store), None (set by how long the wait lasted on this host,
at a rate the protocol bounds: measured, not extrapolated; docs/reference/trainer.md)."""


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x by least squares."""
    b, a = statistics.linear_regression(xs, ys)
    return a, b


def extrapolate(model: str | None, sizes: list[float], ys: list[float], n: float) -> float | None:
    if model == "linear":
        a, b = linear_fit(sizes, ys)
        return a + b * n
    if model == "per-rank":
        a, b = linear_fit(sizes, [y / (x - 1) for x, y in zip(sizes, ys, strict=True)])
        return (a + b * n) * (n - 1)
    return None


def power_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, k) of y = a * x**k by least squares in log-log (ys > 0)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    den = sum((x - mx) ** 2 for x in lx)
    k = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / den if den else 0.0
    return math.exp(my - k * mx), k


def _fmt(v: float) -> str:
    if isinstance(v, float) and v < 100:
        return f"{v:.2f}" if v < 10 else f"{v:.1f}"
    v = float(v)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}"


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    sizes = [r["n"] for r in rows]
    head = "| figure | " + " | ".join(f"N={n}" for n in sizes)
    head += (
        " | growth N^k (largest 3) | "
        + " | ".join(f"N={s:,} (extrapolated)" for s in SCALES)
        + " |"
    )
    lines = [head, "|" + " --- |" * (len(sizes) + 2 + len(SCALES))]
    xs = [float(n) for n in sizes]
    for key, (label, model) in FIGURES.items():
        ys = [float(r[key]) for r in rows]
        cells = [_fmt(y) for y in ys]
        grow, ext = "-", ["-"] * len(SCALES)
        if len(rows) >= 3 and min(ys) > 0:
            _, k = power_fit(xs[-3:], ys[-3:])  # over the largest sizes: the offsets fade
            grow = f"k = {k:.2f}"
            got = [extrapolate(model, xs, ys, float(s)) for s in SCALES]
            ext = [_fmt(g) if g is not None else "not extrapolated" for g in got]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {grow} | " + " | ".join(ext) + " |")
    keys = rows[-1]["leader_keys"]
    top = sorted(keys.items(), key=lambda kv: -kv[1])[:8]
    said = ", ".join(f"`{k}` {c}" for k, c in top)
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            "What one live recovery costs the job's store as the world grows "
            "(`bench/recovery_cost.py`; how to read it: docs/reference/trainer.md, "
            '"Recovery cost"). N emulated ranks as N data-parallel replicas (tp 1, a '
            f"{MODEL['layers']}-layer tiny model, layers of {meta['layer_ms']:g} + "
            f"{2 * meta['layer_ms']:g} ms), rank N-1 SIGKILLed mid-step {meta['at']}; every "
            "store call of each survivor's recovery counted on its own client "
            "(trainer/recovery/tally.py; a `set` is two round trips: it is confirmed). "
            "Recovered from replicas, 0 steps lost, in one epoch at every size.",
            "",
            f"Command: `{meta['command']}`. Machine: {meta['machine']}. Load (1-min average "
            f"while it ran): {meta['load']}. Date: {meta['date']}.",
            "",
            *lines,
            "",
            f"The leader's calls at N={rows[-1]['n']}, by key kind (the most): {said}.",
            "",
            NOTES,
            "",
        ]
    )


NOTES = """How to read it. Per rank, every count and byte figure grows linearly (k ~ 1) or
close to it; the totals through the one store grow as N times that (k ~ 2), which is what limits
the protocol first at scale (docs/reference/trainer.md, "Recovery cost": gloo's rendezvous of
the re-formed groups, one address read per peer of each group a rank joins, where NCCL needs one
id; the decision, O(N) bytes, read by every member). The rendezvous rows (and the bytes, mostly
gloo's addresses) follow the sizes of the groups the recovery plan forms, which the planner
chooses anew at each size: a plan with larger gradient-sync groups at one size moves their
fitted k without the protocol doing more per peer (the leader's calls by key, below, show each
group's reads). The rows marked "not extrapolated" are set by how long the wait lasted on this
host, at rates the protocol bounds: the leader polls one counter and one multi-key check per
20 ms however many members are missing; a member polls the decision every max(20 ms, N/5,000 s),
so all members together stay within 10,000 calls a second (at 4,096 ranks: one poll per 0.82 s
each). The seconds are dominated by planning: the leader plans for the N-1 GPUs left within
min(5 s, `planningTimeoutSeconds`), a budget the search uses whole from a few tens of GPUs on;
on this 2-CPU host N processes share two cores, so the times (and the load) grow with N for
reasons a cluster does not have.

Before the counts were taken (2026-12-03, N = 4, 8, 16): every arrival carried its plan, world
vector and rates, and the decision every survivor's plan: the leader read 10.1k, 36.1k, 137k
bytes and the decision was 4.4k, 15.5k, 58.8k bytes (x4 per doubling: O(N^2)); the leader
checked every member's dead mark and arrival at every poll (825 polling calls in a 0.93 s wait
at N=32), and every member laid out every survivor's plan to find the pieces' holders (O(N^2)
work). The same day after the fix, at 4-32 ranks: the leader read 6.9k-54k bytes and the
decision was 2.4k-15k bytes, both linear, as in the table above."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="What one live recovery costs the job's store, by world size.",
    )
    parser.add_argument("--sizes", default="4,8,16,32,64", help="world sizes (comma-separated)")
    parser.add_argument("--layer-ms", type=float, default=2.0, help="a layer's forward, ms")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--at", type=int, default=2, help="the step rank N-1 dies in")
    parser.add_argument("--out", help="keep the runs' files here (default: a temporary folder)")
    parser.add_argument(
        "--reuse", help="render the runs kept in this folder (an earlier --out) instead of running"
    )
    parser.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.reuse:
        saved = json.loads((Path(args.reuse) / "rows.json").read_text())
        meta = saved["meta"]
        rows = [
            summarize(
                r["n"],
                read_records(Path(args.reuse) / f"n{r['n']}", r["n"], meta["steps"]),
                r["wall_s"],
            )
            for r in saved["rows"]
        ]
    else:
        root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="recovery-cost-"))
        rows = []
        with LoadSampler() as load:
            for n in sizes:
                print(f"[recovery-cost] N={n}: starting {n} ranks ...", flush=True)
                row = run_size(n, args, root)
                rows.append(row)
                print(
                    f"[recovery-cost] N={n}: leader {row['leader_round_trips']} round trips, "
                    f"{row['leader_bytes_read']} B read; a member {row['member_round_trips']}; "
                    f"decision {row['decision_bytes']} B; recovery {row['seconds']:.2f} s "
                    f"(run {row['wall_s']:.0f} s)",
                    flush=True,
                )
        meta = {
            "command": "python bench/recovery_cost.py " + " ".join(argv or sys.argv[1:]),
            "machine": machine(),
            "load": load.summary(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "layer_ms": args.layer_ms,
            "at": args.at,
            "steps": args.steps,
        }
        (root / "rows.json").write_text(json.dumps({"rows": rows, "meta": meta}, indent=1))
        print(f"[recovery-cost] rows: {root / 'rows.json'}", flush=True)
    section = render(rows, meta)
    print(section)
    if not args.no_write:
        replace_section(TITLE, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
