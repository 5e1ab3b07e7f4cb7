"""`malleus run JOB.yaml`: a straggler-resilient training job on this machine, end to end.

Exit codes: 0 done; 1 the run failed (no member of the job left, no valid plan on the GPUs
left, a switch failed); 2 bad input (manifest, resources, no plan, nothing to resume), refused
before anything started; 130 interrupted (Ctrl-C or SIGTERM: the trainers save a checkpoint at
their next step boundary first, and the message gives the `malleus run --resume WORKDIR`
command; a second Ctrl-C stops them at once).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
import sys
from typing import Any, TextIO

from malleus.job import BadInput
from malleus.job.report import write_json
from malleus.job.resources import Machine

from .failures import summary_lines
from .prepare import MODES, LocalRunOptions, Prepared, ideal_step_seconds, prepare
from .progress import Progress
from .report import RunFacts, build_report, judge_baseline, refigure, summary_text
from .resume import REPORT_FILE, append_report, previous_report
from .session import Outcome, Session

__all__ = ["add_arguments", "main", "make_report", "run", "write_json"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "job", nargs="?", help="MalleusJob manifest (YAML); with --resume, the run's own"
    )
    parser.add_argument(
        "--resume",
        metavar="WORKDIR",
        help="continue the interrupted run in WORKDIR from its latest checkpoint, under the "
        "plan in force there (its job and options; report, plot and logs are appended)",
    )
    parser.add_argument("--report", metavar="REPORT.json", help="write the JSON run report here")
    parser.add_argument("--plot", metavar="PLOT.png", help="write throughput and rate plots here")
    parser.add_argument("--steps", type=int, help="total steps (overrides spec.training.steps)")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="live: re-plan and migrate in place (default); static: never re-plan; "
        "restart: re-plan by checkpoint, stop and relaunch",
    )
    parser.add_argument("--save-model", metavar="PATH", help="write the final full state dict")
    parser.add_argument(
        "--save-hf", metavar="DIR", help="write the final model as a Hugging Face folder"
    )
    parser.add_argument("--workdir", metavar="DIR", help="plans, logs, checkpoints (default: temp)")
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="auto: a bar on a terminal, periodic lines otherwise",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between progress lines (default 10)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=0.2,
        metavar="S",
        help="seconds between two readings of the trainers' rates (default 0.2)",
    )
    parser.add_argument(
        "--init-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds the trainers have to start and meet (default 120)",
    )
    parser.add_argument(
        "--no-resource-check",
        action="store_true",
        help="start even if this machine looks too small for the job",
    )


_RESUMED = ("job", "mode", "steps", "report", "plot", "save_model", "save_hf")
"""What `--resume` takes from the run's `run.json` unless given again on the command line."""


def main(args: argparse.Namespace) -> int:
    if args.job is None and args.resume is None:
        print("malleus run: give a job file (JOB.yaml) or --resume WORKDIR", file=sys.stderr)
        return 2
    options = LocalRunOptions(
        job=args.job or "",
        mode=args.mode or "live",
        steps=args.steps,
        report=args.report,
        plot=args.plot,
        save_model=args.save_model,
        save_hf=args.save_hf,
        workdir=args.workdir,
        progress=args.progress,
        progress_interval=args.progress_interval,
        scrape_interval=args.scrape_interval,
        init_timeout=args.init_timeout,
        check_resources=not args.no_resource_check,
    )
    if args.resume is not None:
        from .resume import resume_options

        explicit = {n for n in _RESUMED if getattr(args, n, None) is not None}
        try:
            options = resume_options(args.resume, options, explicit, _RESUMED)
        except BadInput as e:
            print(e, file=sys.stderr)
            return 2
    return run(options, command=shlex.join(["malleus", "run", *sys.argv[2:]]))


def make_report(
    prepared: Prepared, session: Session, outcome: Outcome, started: str, command: str
) -> dict[str, Any]:
    job = prepared.job
    facts = RunFacts(
        job=job.name,
        mode=prepared.options.mode,
        nodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
        tp=job.tp,
        tokens_per_step=prepared.tokens_per_step,
        window_steps=prepared.policy.window_steps,
        total_steps=prepared.total_steps,
        started=started,
        wall_seconds=outcome.wall_seconds,
        exit_code=outcome.code,
        exit_reason=outcome.reason,
        unit_seconds=prepared.unit_seconds,
        schedule=prepared.schedule,
        machine=prepared.machine.to_dict() if prepared.machine else {},
        command=command,
    )
    return build_report(
        facts,
        session.record.rows(),
        session.record.switches(),
        outcome.history,
        initial_plan=json.loads(prepared.plan.to_json()),
        ideal_step_seconds=ideal_step_seconds(prepared),
        problem_of=prepared.job.problem,
        calibration=session.record.calibrations().get(prepared.plan.generation),
        calibrations=list(session.record.calibrations().values()),
    )


def run(
    options: LocalRunOptions,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    machine: Machine | None = None,
    command: str = "",
) -> int:
    """The whole command: prepare (exit 2 on bad input), run, report. Returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        prepared = prepare(options, machine)
    except BadInput as e:
        print(e, file=err)
        return 2
    except KeyboardInterrupt:
        return 130
    mode = Progress.auto_mode(out) if options.progress == "auto" else options.progress
    progress = Progress(out, mode, interval=options.progress_interval)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    session = Session(prepared, progress)
    try:
        outcome = asyncio.run(session.run())
    except KeyboardInterrupt:  # before the handlers were installed; the processes are stopped
        session.procs.terminate(grace=1.0)
        outcome = Outcome(130, "interrupted: trainers stopped")
    report = make_report(prepared, session, outcome, started, command)
    report.update(session.supervisor.log.to_report())  # failures, replacements, recoveries
    if prepared.resume_step is not None:
        previous = previous_report(prepared.workdir)
        if previous is not None:
            report = append_report(previous, report, prepared.resume_step)
            refigure(
                report, window_steps=prepared.policy.window_steps, problem_of=prepared.job.problem
            )
    judge_baseline(report)  # with the failures in: a baseline that does not apply is dropped
    write_json(report, str(prepared.workdir / REPORT_FILE))  # what a --resume appends to
    if options.report:
        write_json(report, options.report)
    if options.plot and report["per_step"]:
        from .report.plot import plot_report

        plot_report(report, options.plot)
    print("\n".join([summary_text(report), *summary_lines(report)]), file=out)
    if outcome.code:
        print(f"malleus run: {outcome.reason}", file=err)
    return outcome.code
