"""Trainer benchmark: the planner's plan against the uniform plan, run side by side on the
emulated GPU clock, measured speedup against the cost model's prediction.

Run: .venv/bin/python bench/trainer.py [--quick] [--scales N ...] [--only SITUATION ...]
[--no-write] [--dump DIR]

Per scale, one spawned gloo job (one process per emulated GPU) trains every straggler situation
in turn. For each situation two Trainers share the process group: one under the uniform
(Megatron-style) plan, one under the planner's plan for the injected rates; their steps
alternate (U P, P U, U P, ...) so that both see the same load on a shared machine. Stragglers
are injected through the job's emulation schedule from step 0. Measured speedup = median
uniform step time / median planner-plan step time over the steps after warm-up; predicted =
cost.plan_step_time(uniform) / cost.plan_step_time(planner's plan) under the calibrated cost
model: the calibration (and link rates) the uniform plan's trainers measured in their first steps
(trainer/engine/calibrator.py), as the controller would predict a re-plan from the plan in force;
target within 10%. The uncalibrated model's prediction (layer compute only) is shown beside it.
Writes the "Trainer" section of docs/benchmarks.md. The cases and the spawned job are
bench/trainer_cases.py's, the rows (`Row`) and the section's text bench/trainer_report.py's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchdoc import LoadSampler, replace_section  # bench/ is on sys.path when run as a script
from trainer_cases import SCALES, Job, Scale, make_jobs, run_scale, situations
from trainer_report import Row, render

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "benchmarks.md"


def _slowest_per_step(per_rank: list[list[float]]) -> list[float]:
    """Per step, the longest pipeline run over the ranks that ran one."""
    runs = [r for r in per_rank if r]
    return [max(step) for step in zip(*runs, strict=True)]


def analyse(scale: Scale, job: Job, result: dict[str, Any]) -> Row:
    from malleus.planner import plan_step_time

    unit_s = job.resolved.unit_seconds
    assert unit_s is not None
    rates = situations(scale)[job.name]
    problem = job.resolved.problem(rates)
    model = {n: plan_step_time(problem, p) for n, p in job.plans.items()}
    measured_cal = result["calibration"]
    uniform = measured_cal["uniform"]
    assert uniform["calibration"] is not None, "the uniform plan's trainers measured nothing"
    calibrated = job.resolved.problem(
        rates, calibration=uniform["calibration"], link_rates=uniform["link_rates"]
    )
    cal_model = {n: plan_step_time(calibrated, p) for n, p in job.plans.items()}
    own = {}
    for n, p in job.plans.items():
        c = measured_cal[n]
        if c["calibration"] is not None:
            mine = job.resolved.problem(
                rates, calibration=c["calibration"], link_rates=c["link_rates"]
            )
            own[n] = plan_step_time(mine, p)
    ranks = result["ranks"]
    clock = [s for r in ranks for s in r["clock"].values()]
    calls = sum(c["calls"] for c in clock) or 1
    pipelines = {
        n: statistics.median(_slowest_per_step([r["pipeline"][n] for r in ranks])) for n in model
    }
    measured_rates = {
        int(r): v for r, v in result["rates"]["uniform"].items() if int(r) in rates and v
    }
    return Row(
        scale=scale,
        situation=job.name,
        unit_s=unit_s,
        model=model,
        calibrated=cal_model,
        calibration=dict(calibrated.calibration.model_dump()) if calibrated.calibration else {},
        own=own,
        measured={n: statistics.median(v) for n, v in result["seconds"].items()},
        pipelines=pipelines,
        measured_rates=measured_rates,
        overruns=int(sum(c["overruns"] for c in clock)),
        late_ms=1000 * sum(c["late_seconds"] for c in clock) / calls,
    )


def write_doc(section: str) -> None:
    """Replace (or append) the "## Trainer" section, leaving the others' sections alone."""
    replace_section("Trainer", section, DOC)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 GPUs only, 4 measured steps")
    ap.add_argument("--scales", type=int, nargs="+", choices=sorted(SCALES), help="GPU counts")
    ap.add_argument("--steps", type=int, help="measured steps per plan (default 5; quick 4)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per plan")
    ap.add_argument("--forward-ms", type=float, default=50.0, help="per layer-shard forward")
    ap.add_argument("--backward-ms", type=float, default=100.0, help="per layer-shard backward")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument(
        "--only", nargs="+", metavar="SITUATION", help="situations to run, e.g. 'one 2x'"
    )
    ap.add_argument("--dump", type=Path, help="also write each situation's raw result (JSON)")
    args = ap.parse_args(argv)
    from malleus.trainer.engine.calibrator import CAL_STEPS, CAL_WARMUP

    scales = args.scales or ([8] if args.quick else sorted(SCALES))
    known = {name for w in scales for name in situations(SCALES[w])}
    if args.only and not set(args.only) <= known:
        ap.error(f"--only: unknown situation(s) {sorted(set(args.only) - known)}; {sorted(known)}")
    args.steps = args.steps or (4 if args.quick else 5)
    if args.warmup + args.steps < CAL_WARMUP + CAL_STEPS + 1:
        ap.error(f"--warmup + --steps must be >= {CAL_WARMUP + CAL_STEPS + 1}: the calibration")
    command = "python bench/trainer.py " + " ".join(argv if argv is not None else sys.argv[1:])

    from malleus.trainer.launch.spawn import spawn_local

    rows: list[Row] = []
    jobs_by_key: dict[tuple[int, str], Job] = {}
    t0 = time.perf_counter()
    with LoadSampler() as load:
        for world in scales:
            s = SCALES[world]
            jobs = make_jobs(s, args.forward_ms / 1000, args.backward_ms / 1000, args.only)
            if not jobs:
                continue
            print(f"{s.label}: {len(jobs)} situations, spawning {world} ranks", flush=True)
            with tempfile.TemporaryDirectory() as out:
                spawn_local(world, run_scale, (jobs, args.warmup, args.steps, out))
                for i, job in enumerate(jobs):
                    result = json.loads((Path(out) / f"{i}.json").read_text())
                    if args.dump is not None:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        name = f"{world}-{job.name.replace(' ', '_')}.json"
                        (args.dump / name).write_text(json.dumps(result))
                    row = analyse(s, job, result)
                    rows.append(row)
                    jobs_by_key[(world, job.name)] = job
                    print(
                        f"{s.label} {job.name}: predicted {row.predicted:.2f} (uncalibrated "
                        f"{row.predicted_v1:.2f}), measured {row.speedup:.2f} "
                        f"({row.error:+.1%}; uncalibrated {row.error_v1:+.1%}), step / model "
                        f"uniform {row.step_fidelity('uniform'):.3f} planner "
                        f"{row.step_fidelity('planner'):.3f}",
                        flush=True,
                    )
    section = render(
        rows, jobs_by_key, command.strip(), load.summary(), args, time.perf_counter() - t0
    )
    print()
    print(section)
    if not args.no_write:
        write_doc(section)
        print(f"wrote the Trainer section of {DOC.relative_to(ROOT)}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
