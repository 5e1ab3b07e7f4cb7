"""`malleus run --resume WORKDIR`: continue an interrupted run where its checkpoint left it.

A run's work directory keeps what a continuation needs: `run.json` (the job file and the run's
options, written before anything starts), `plans/gen-N.json` (every plan published), the
checkpoints (`checkpoints/latest`, whose manifest names the plan generation it was taken under)
and `report.json` (the run's report so far). `--resume` restarts the trainers with their resume
flag under the plan in force at the checkpoint, the controller from that plan, and appends to
the report (per-step rows, events, plan changes, failures) and the plot instead of replacing
them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from malleus.job import BadInput
from malleus.job.report import generation_segments

__all__ = [
    "RUN_FILE",
    "append_report",
    "checkpoint_generation",
    "checkpoint_plan",
    "load_options",
    "previous_report",
    "resume_options",
    "save_options",
]

RUN_FILE = "run.json"
REPORT_FILE = "report.json"


def save_options(workdir: Path, options: Any) -> None:
    """Write the run's options (job path made absolute) for a later `--resume`."""
    data = asdict(options)
    data["job"] = str(Path(options.job).resolve())
    for key in ("report", "plot", "save_model", "save_hf"):
        if data.get(key):
            data[key] = str(Path(data[key]).resolve())
    data.pop("resume", None)
    data.pop("workdir", None)
    (workdir / RUN_FILE).write_text(json.dumps(data, indent=1) + "\n")


def load_options(workdir: Path) -> dict[str, Any]:
    """`run.json` of an earlier run; BadInput when `workdir` holds no run."""
    path = workdir / RUN_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput.one(
            "--resume",
            f"{workdir} is not the work directory of a malleus run ({path}: {e})",
            what="arguments",
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("job"), str):
        raise BadInput.one("--resume", f"{path}: no job recorded", what="arguments")
    return data


def resume_options(
    workdir: str | Path, given: Any, explicit: set[str], restored: tuple[str, ...]
) -> Any:
    """The options of the run in `workdir`: those in `restored` from its `run.json`, except the
    ones named in `explicit`, which (like all others) come from `given` (a `LocalRunOptions`
    built from the command line)."""
    workdir = Path(workdir)
    saved = load_options(workdir)
    names = {f.name for f in fields(given)}
    values = {k: v for k, v in saved.items() if k in names and k in restored}
    for name in explicit:
        values[name] = getattr(given, name)
    values["workdir"] = str(workdir)
    values["resume"] = True
    return replace(given, **values)


def checkpoint_generation(checkpoints: Path) -> tuple[int, int] | None:
    """(step, plan generation) of the checkpoint `checkpoints/latest` names, None if none."""
    try:
        name = (checkpoints / "latest").read_text().strip()
        manifest = json.loads((checkpoints / name / "manifest.json").read_text())
        return int(manifest["step"]), int(manifest.get("plan_generation") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_plan(checkpoints: Path) -> str | None:
    """The plan in force when the checkpoint `checkpoints/latest` was taken, as JSON text (the
    trainers keep it in the manifest), or None (none recorded). Not yet checked: the caller
    validates it against the job before anything runs under it."""
    try:
        name = (checkpoints / "latest").read_text().strip()
        plan = json.loads((checkpoints / name / "manifest.json").read_text()).get("plan")
    except (OSError, ValueError, AttributeError):
        return None
    return json.dumps(plan) if isinstance(plan, dict) else None


def previous_report(workdir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((workdir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def append_report(
    previous: Mapping[str, Any], current: Mapping[str, Any], resume_step: int
) -> dict[str, Any]:
    """One report for the whole run: `previous`'s steps before `resume_step` (the steps after
    the checkpoint were trained again), then `current`'s; events, plan changes, switches and
    failures of both; times summed; `resumes` lists each continuation. The figures over the
    whole run (windows, static baseline) are `report.refigure`'s, given the job."""
    out = dict(current)
    rows = [r for r in previous.get("per_step", []) if r["step"] < resume_step]
    rows += list(current.get("per_step", []))
    out["per_step"] = rows
    out["steps"] = len(rows)
    for key in ("events", "plan_changes", "failures", "replacements", "recoveries"):
        if key in previous or key in current:
            out[key] = list(previous.get(key, [])) + list(current.get(key, []))
    seen, switches = set(), []
    for s in list(previous.get("switches", [])) + list(current.get("switches", [])):
        if s.get("generation") not in seen:
            seen.add(s.get("generation"))
            switches.append(s)
    out["switches"] = switches
    for key in ("wall_seconds", "training_seconds", "ideal_seconds"):
        a, b = previous.get(key), current.get(key)
        out[key] = a + b if a is not None and b is not None else (b if a is None else a)
    tps = current.get("tokens_per_step")
    training = out.get("training_seconds")
    out["mean_tokens_per_second"] = tps * len(rows) / training if tps and training else None
    ideal = out.get("ideal_seconds")
    out["ideal_ratio"] = ideal / training if ideal is not None and training else None
    if tps:
        out["generations"] = generation_segments(rows, tps)
    out["started"] = previous.get("started", current.get("started"))
    out["initial_plan"] = previous.get("initial_plan", current.get("initial_plan"))
    # The first plan's terms (the static baseline's) were measured before the first stop.
    out["calibration"] = previous.get("calibration") or current.get("calibration")
    out["calibrations"] = list(previous.get("calibrations", [])) + list(
        current.get("calibrations", [])
    )
    resumes = list(previous.get("resumes", []))
    resumes.append(
        {
            "step": resume_step,
            "started": current.get("started"),
            "command": current.get("command"),
            "previous_exit": previous.get("exit"),
        }
    )
    out["resumes"] = resumes
    return out
