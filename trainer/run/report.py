"""`malleus train --report FILE`: the JSON report `malleus run` writes, from rank 0's own steps.

Rank 0 knows every step's loss, time and rates and every plan switch, so it keeps them here and
writes the report when the run ends, however it ends (done, stopped, failed: the exit says
which); the launcher writes one for a rank 0 that died before it could. The keys are `malleus
run`'s (malleus/runner/report/) so that one script reads both; what only the controller knows
(its decisions, predicted speedups) is left empty, and `mode` says "train" (or "reference").
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

from malleus.job import ResolvedJob
from malleus.job.report import generation_segments, step_row, write_json
from malleus.planner import Plan
from malleus.trainer.switching.protocol import Migration

__all__ = ["RunLog", "failure_report"]


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class RunLog:
    """Rank 0's record of one run: per-step rows and plan switches, written as the report."""

    def __init__(
        self,
        job: ResolvedJob,
        plan: Plan | None,
        total_steps: int,
        *,
        mode: str = "train",
        command: str = "",
    ) -> None:
        self.job, self.total_steps, self.mode, self.command = job, total_steps, mode, command
        self.started, self._t0 = _now(), time.monotonic()
        self.initial_plan = json.loads(plan.to_json()) if plan is not None else None
        self.generation = plan.generation if plan is not None else 0
        self.rows: list[dict[str, Any]] = []
        self.switches: list[dict[str, Any]] = []
        if plan is not None:
            self.switches.append(_switch(plan.generation, 0, None, None))

    def step(
        self,
        index: int,
        loss: float,
        *,
        seconds: float | None = None,
        rates: dict[int, float | None] | None = None,
    ) -> None:
        """Step `index` (0-based) is done, under the plan generation in force while it ran."""
        tps = self.job.tokens_per_step / seconds if seconds else None
        now = time.monotonic() - self._t0
        self.rows.append(
            step_row(
                index,
                time=now,
                seconds=seconds,
                tokens_per_second=tps,
                loss=loss,
                generation=self.generation,
                rates=rates or {},
            )
        )

    def switched(self, migration: Migration) -> None:
        """A plan switch: its generation runs from `migration.step` on."""
        self.generation = migration.generation
        self.switches.append(
            _switch(migration.generation, migration.step, migration.seconds, migration.bytes)
        )

    def report(self, code: int, reason: str) -> dict[str, Any]:
        """The report as `malleus run` shapes it."""
        return _report(
            self.job,
            mode=self.mode,
            command=self.command,
            started=self.started,
            wall_seconds=time.monotonic() - self._t0,
            total_steps=self.total_steps,
            code=code,
            reason=reason,
            rows=self.rows,
            switches=self.switches,
            initial_plan=self.initial_plan,
        )

    def write(self, path: str, code: int, reason: str | None = None) -> None:
        """The report to `path`; `reason` None: "done", or where the run stopped."""
        if reason is None:
            done = len(self.rows) and self.rows[-1]["step"] + 1
            reason = (
                "done"
                if done == self.total_steps
                else f"stopped after step {done} of {self.total_steps}"
            )
        write_json(self.report(code, reason), path)


def failure_report(
    job: ResolvedJob, path: str, total_steps: int, code: int, reason: str, command: str = ""
) -> None:
    """The report of a run whose rank 0 died before writing its own: the exit, no steps."""
    write_json(
        _report(
            job,
            mode="train",
            command=command,
            started=_now(),
            wall_seconds=None,
            total_steps=total_steps,
            code=code,
            reason=reason,
            rows=[],
            switches=[],
            initial_plan=None,
        ),
        path,
    )


def _switch(
    generation: int, step: int, seconds: float | None, moved: float | None
) -> dict[str, Any]:
    return {
        "generation": generation,
        "step": step,
        "migration_seconds": seconds,
        "migration_bytes": moved,
    }


def _report(
    job: ResolvedJob,
    *,
    mode: str,
    command: str,
    started: str,
    wall_seconds: float | None,
    total_steps: int,
    code: int,
    reason: str,
    rows: list[dict[str, Any]],
    switches: list[dict[str, Any]],
    initial_plan: dict[str, Any] | None,
) -> dict[str, Any]:
    timed = [r for r in rows if r["seconds"]]
    training = timed[-1]["time"] - (timed[0]["time"] - timed[0]["seconds"]) if timed else None
    return {
        "job": job.name,
        "mode": mode,
        "command": command,
        "started": started,
        "machine": {},  # `malleus run` probes the machine; a trainer has no reason to
        "layout": {"nodes": job.nodes, "gpus_per_node": job.gpus_per_node, "tp": job.tp},
        "exit": {"code": code, "reason": reason},
        "steps": len(rows),
        "total_steps": total_steps,
        "wall_seconds": wall_seconds,
        "training_seconds": training,
        "tokens_per_step": job.tokens_per_step,
        "mean_tokens_per_second": job.tokens_per_step * len(rows) / training if training else None,
        "final_loss": rows[-1]["loss"] if rows else None,
        "unit_seconds": job.unit_seconds,
        "ideal_seconds": None,
        "ideal_ratio": None,
        "schedule": [{"step": s, "rank": r, "factor": f} for s, r, f in job.schedule],
        "initial_plan": initial_plan,
        "generations": generation_segments(rows, job.tokens_per_step),
        "plan_changes": [],
        "switches": switches,
        "events": [],
        "per_step": rows,
    }
