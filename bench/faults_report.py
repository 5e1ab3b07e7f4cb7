"""The "Failures" section of docs/benchmarks.md from bench/faults.py's rows: one table per job.

A row is one fault kind with its live and restart outcomes (`faults.outcome`). The figures that
set the ratio are printed beside it: the first step after recovery is trained on the GPUs left
and counts in full in both modes, so a job's step time bounds restart / live from above
(restart / live < (process restart + step) / step), whatever recovery costs; hence a job with
the default emulated layers and one with shorter ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from collections.abc import Mapping
from typing import Any

from benchdoc import machine  # bench/ is on sys.path when run as a script

__all__ = ["render"]

HEADER = [
    "| fault | live s | restart s | restart / live | detection s live / restart "
    "| after detection: restart / live | down s live / restart | live steps lost "
    "| restart steps lost | live KiB | restart KiB | live via | exit live / restart |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
]


def _n(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(live: Mapping[str, Any], rest: Mapping[str, Any]) -> float | None:
    if not live["seconds"] or rest["seconds"] is None:
        return None
    return rest["seconds"] / live["seconds"]


def _after_detection(live: Mapping[str, Any], rest: Mapping[str, Any]) -> float | None:
    """restart / live, each less its own detection time (a hang costs both the timeout)."""
    if None in (live["seconds"], rest["seconds"], live.get("detection"), rest.get("detection")):
        return None
    a, b = live["seconds"] - live["detection"], rest["seconds"] - rest["detection"]
    return b / a if a > 0 else None


def _downtime(run: Mapping[str, Any]) -> float | None:
    """Seconds after detection in which no step trained: to the first committed step, less its
    own time and the detection (a step of training is not down time, whatever its plan)."""
    if None in (run["seconds"], run.get("detection"), run.get("first_step")):
        return None
    return max(0.0, run["seconds"] - run["detection"] - run["first_step"])


def _span(values: list[float], fmt: str, unit: str = "") -> str:
    lo, hi = min(values), max(values)
    return (
        f"{lo:{fmt}}{unit}"
        if format(lo, fmt) == format(hi, fmt)
        else f"{lo:{fmt}}-{hi:{fmt}}{unit}"
    )


def _table(rows: list[dict[str, Any]], labels: Mapping[str, str]) -> list[str]:
    lines = list(HEADER)
    for r in rows:
        live, rest = r["live"], r["restart"]
        lines.append(
            f"| {labels[r['kind']]} | {_n(live['seconds'], '.2f')} | "
            f"{_n(rest['seconds'], '.2f')} | {_n(_ratio(live, rest), '.1f')}x | "
            f"{_n(live.get('detection'), '.2f')} / {_n(rest.get('detection'), '.2f')} | "
            f"{_n(_after_detection(live, rest), '.1f')}x | "
            f"{_n(_downtime(live), '.2f')} / {_n(_downtime(rest), '.2f')} | "
            f"{_n(live['steps_lost'], 'd')} | {_n(rest['steps_lost'], 'd')} | "
            f"{_n(live['bytes'] / 1024 if live['bytes'] is not None else None, ',.0f')} | "
            f"{_n(rest['bytes'] / 1024 if rest['bytes'] is not None else None, ',.0f')} | "
            f"{live['mode'] or '-'} | {live['code']} / {rest['code']} |"
        )
    return lines


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """The ratios, where the live seconds go, and the down time, for one job's rows."""
    out: list[str] = []
    ratios = [x for r in rows if (x := _ratio(r["live"], r["restart"])) is not None]
    kills = [
        x
        for r in rows
        if r["kind"] != "hang" and (x := _ratio(r["live"], r["restart"])) is not None
    ]
    afters = [x for r in rows if (x := _after_detection(r["live"], r["restart"])) is not None]
    if ratios:
        out.append(
            f"From the fault, live recovery is {_span(ratios, '.1f', 'x')} faster than restarting "
            f"every process ({_span(kills, '.1f', 'x') if kills else '-'} for the kills); "
            "from detection on, "
            f"{_span(afters, '.1f', 'x') if afters else '-'}. Target: at least 10x."
        )
    short = [(r, x) for r in rows if (x := _ratio(r["live"], r["restart"])) is not None and x < 10]
    floors = [
        (r["restart"]["seconds"] / r["live"]["first_step"])
        for r, _ in short
        if r["live"].get("first_step")
    ]
    if short and floors:
        out.append(
            f"Below 10x ({', '.join(r['kind'] for r, _ in short)}): a live recovery cannot take "
            "less than its first step on the GPUs left, "
            f"{_span([r['live']['first_step'] for r, _ in short if r['live'].get('first_step')], '.2f', ' s')}"
            " here, and the restart it is compared with takes "
            f"{_span([r['restart']['seconds'] for r, _ in short], '.2f', ' s')} on this host "
            "(4 processes starting on 2 CPUs), so no live recovery can be more than "
            f"{_span(floors, '.1f', 'x')} faster on it, whatever its detection and down time."
        )
    parts = [
        (live["first_step"], down)
        for live in (r["live"] for r in rows)
        if (down := _downtime(live)) is not None
    ]
    downs = [
        (d, e)
        for r in rows
        if (d := _downtime(r["live"])) is not None and (e := _downtime(r["restart"])) is not None
    ]
    if parts and downs:
        out.append(
            "Where the live seconds go: the first step after the recovery, on the GPUs left, "
            f"{_span([a for a, _ in parts], '.2f', ' s')} of its own (the step the fault "
            "interrupted, redone, or the first after the checkpoint); before it, after "
            f"detection (re-forming, the plan, restoring the pieces), "
            f"{_span([b for _, b in parts], '.2f', ' s')}: the down time, against "
            f"{_span([e for _, e in downs], '.2f', ' s')} for the restart."
        )
    return out


def healthy_step(rows: list[dict[str, Any]]) -> float | None:
    """The median step seconds of the live runs before their faults (4 GPUs, one plan)."""
    steps = [s for r in rows for s in r["live"].get("healthy_steps") or []]
    return statistics.median(steps) if steps else None


def render(
    jobs: Mapping[str, list[dict[str, Any]]],
    titles: Mapping[str, str],
    labels: Mapping[str, str],
    args: argparse.Namespace,
    load: str,
) -> str:
    """`jobs`: job name -> its rows; `titles`: job name -> what its emulated layers are."""
    lines = [
        "## Failures",
        "",
        f"Command: `python bench/faults.py --steps {args.steps} --at {args.at} "
        f"--kinds {','.join(args.kinds)} --jobs {','.join(jobs)}`  ",
        f"Machine: {machine()}  ",
        f"Date: {dt.date.today().isoformat()} (load average during the runs: {load}; the "
        "CPUs are shared with other work)",
        "",
        f"Job: 1 node x 4 emulated GPUs, tp 2 (two data-parallel replicas), {args.steps} steps, "
        "a checkpoint every 5 steps, hangTimeoutSeconds "
        f"{args.hang_timeout if args.hang_timeout is not None else 'unset (the default)'}; "
        "the fault is a "
        f"real signal to the trainer process(es) right after step {args.at} is committed. "
        "live = `malleus run` (the survivors recover in place; the dead rank's process is "
        "replaced and rejoins); restart = `malleus run --mode restart` (every process stopped "
        "and started again from the latest checkpoint; a stopped process is noticed by the "
        "runner's watch after the hang timeout, 30 s unset, as a watchdog would: the trainers "
        "of a restart-based job do not detect hangs). Live, a stopped process is known dead "
        "by its heartbeat (~2 s). Seconds: from the fault (the process "
        "seen ended, or first seen stopped) to the first step committed after recovery; "
        "steps lost: committed steps trained again; KiB restored: copied from replicas or read "
        "back from the checkpoint; down s: after detection, to that first step, less the "
        "step's own time.",
        "",
        "Both modes pay the first step after recovery in full, so a job's step time caps the "
        "ratio at (restart + step) / step, whatever recovery costs. The same job runs twice, "
        "with the default emulated layers and with layers 4x shorter: a restart here costs "
        "seconds (process starts on 2 CPUs) against the minutes a cluster's restart costs "
        "(pod scheduling, image pull, NCCL set-up, a checkpoint from remote storage), so "
        "restart / step on this host is at the low end of a real job's either way.",
    ]
    for name, rows in jobs.items():
        step = healthy_step(rows)
        lines += [
            "",
            f"**{titles[name]}** (a healthy step on the 4 GPUs: {_n(step, '.2f')} s)",
            "",
            *_table(rows, labels),
        ]
        failed = [
            (r["kind"], m, r[m]["reason"])
            for r in rows
            for m in ("live", "restart")
            if r[m]["code"] not in (0, "-")
        ]
        if failed:
            lines += ["", "Runs that did not complete:", ""]
            lines += [f"- {k} / {m}: {why}" for k, m, why in failed]
        for paragraph in _summary(rows):
            lines += ["", paragraph]
    return "\n".join(lines) + "\n"
