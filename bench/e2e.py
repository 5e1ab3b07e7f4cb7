"""End-to-end benchmark: one straggler scenario run three ways with `malleus run`.

Run: .venv/bin/python bench/e2e.py [--job examples/quickstart.yaml] [--modes static,restart,live]
     [--out DIR] [--no-write]      (--out DIR --reuse: re-render from the reports already there)

- static:  the first plan for the whole run (what a framework without re-planning does);
- restart: the same controller, each new plan applied by checkpoint, stop and relaunch of every
           process (the TorchElastic / DLRover way);
- live:    Malleus: each new plan applied in place at a step boundary, state migrated.

Each mode is a separate `malleus run` process, one after the other (they would compete for the
CPUs otherwise). Reported per mode: wall time (launch to exit), training time (first step to
last), mean tokens/s over the training time, and the ratio of the cost model's ideal bound to
the training time (all usable GPUs busy at their emulated speed, no bubbles, no overhead: the
physical limit). Per live re-plan: what it changed, its predicted speedup (cost-model units,
and the controller's calibrated seconds) against the measured one; per re-plan window the old
plan against the new under the same rates; and the static baseline the live run predicts for
itself against the static run's measured steps. Writes the "End to end" section of
docs/benchmarks.md; the section's text is bench/e2e_report.py's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchdoc import replace_section  # bench/ is on sys.path when run as a script
from e2e_report import render

from malleus.job import ResolvedJob
from malleus.planner.cost import plan_step_time
from malleus.planner.plan import Plan
from malleus.runner.prepare import true_rates
from malleus.runner.report import replan_windows, static_baseline_of

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
MODES = ("static", "restart", "live")


def run_mode(job: Path, mode: str, out: Path, steps: int | None) -> dict[str, Any]:
    """One `malleus run` in its own process; its report."""
    report = out / f"{mode}.json"
    cmd = [sys.executable, "-m", "malleus.cli", "run", str(job), "--mode", mode]
    cmd += [
        "--workdir",
        str(out / mode),
        "--report",
        str(report),
        "--plot",
        str(out / f"{mode}.png"),
    ]
    cmd += ["--progress", "lines", "--progress-interval", "30"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    print(f"== {mode}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"malleus run --mode {mode} failed with exit code {proc.returncode}")
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def modeled_seconds(job: Path, report: dict[str, Any]) -> float | None:
    """Training time if only the emulated compute counted: every step's cost-model time under the
    plan it ran and the rates the schedule gave it. The gap to the measured time is overhead."""
    unit = report["unit_seconds"]
    if unit is None:
        return None
    resolved = ResolvedJob.load(job)
    initial = Plan.model_validate(report["initial_plan"])
    plans = {initial.generation: initial}
    for c in report["plan_changes"]:
        plans[c["generation"]] = Plan.model_validate({"tp": resolved.tp, **c["plan"]})
    schedule = tuple((s["step"], s["rank"], s["factor"]) for s in report["schedule"])
    total = 0.0
    for r in report["per_step"]:
        problem = resolved.problem(true_rates(schedule, r["step"]))
        total += plan_step_time(problem, plans[r["generation"]]) * unit
    return total


def row(report: dict[str, Any], job: Path) -> dict[str, Any]:
    changes = report["plan_changes"]
    return {
        "mode": report["mode"],
        "wall": report["wall_seconds"],
        "training": report["training_seconds"],
        "tps": report["mean_tokens_per_second"],
        "ideal": report["ideal_ratio"],
        "replans": len(changes),
        "switch_seconds": sum(c["migration_seconds"] or 0.0 for c in changes),
        "loss": report["final_loss"],
        "modeled": modeled_seconds(job, report),
        "declined": sum(
            1
            for e in report["events"]
            if e["kind"] == "ReplanSkipped" and "less than the migration" in e["message"]
        ),
    }


def write_doc(section: str) -> None:
    """Replace (or append) the "## End to end" section, leaving the others' sections alone."""
    replace_section("End to end", section, DOC)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, in order")
    ap.add_argument("--steps", type=int, help="override the job's steps")
    ap.add_argument("--out", type=Path, help="reports, plots, logs (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument(
        "--reuse", action="store_true", help="re-render from the reports already in --out"
    )
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if args.reuse and args.out is None:
        ap.error("--reuse needs --out")
    out = args.out or Path(tempfile.mkdtemp(prefix="malleus-e2e-"))
    out.mkdir(parents=True, exist_ok=True)
    job = args.job.resolve()
    if args.reuse:
        meta = json.loads((out / "meta.json").read_text())
        reports = {m: json.loads((out / f"{m}.json").read_text()) for m in modes}
    else:
        meta = {"date": dt.date.today().isoformat(), "load_before": os.getloadavg()[0]}
        reports = {m: run_mode(job, m, out, args.steps) for m in modes}
        meta["load_after"] = os.getloadavg()[0]
        (out / "meta.json").write_text(json.dumps(meta))
    # The static baseline and windows by this version's arithmetic (older reports get them too).
    resolved = ResolvedJob.load(job)
    for report in reports.values():
        report["static_baseline"] = static_baseline_of(report, resolved.problem)
        report["windows"] = replan_windows(
            report["plan_changes"],
            report["per_step"],
            [(s["step"], s["rank"], s["factor"]) for s in report["schedule"]],
            resolved.policy.window_steps,
            report["tokens_per_step"],
        )
    rows = [row(reports[m], job) for m in modes]
    for r in rows:
        print(
            f"{r['mode']:>8}: wall {r['wall']:.1f} s, training {r['training']:.1f} s, "
            f"{r['tps']:,.0f} tok/s, ideal/actual {r['ideal']:.2f}, {r['replans']} re-plans"
        )
    try:
        job_arg = args.job.resolve().relative_to(ROOT)
    except ValueError:
        job_arg = args.job
    command = f"python bench/e2e.py --job {job_arg}"
    if args.modes != ",".join(MODES):
        command += f" --modes {args.modes}"
    if args.steps:
        command += f" --steps {args.steps}"
    section = render(rows, reports, command, meta)
    (out / "e2e.md").write_text(section)
    print(f"reports and plots in {out}")
    if not args.no_write:
        write_doc(section)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
