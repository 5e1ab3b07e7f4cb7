"""`RunOptions`: what one run of the trainer does beyond the job itself.

The job (sizes, batch, optimisation, emulation, memory model, planning problem) is
`malleus.job.ResolvedJob`, which every rank reads as it is. These are the choices of one run of
`malleus train`, `python -m malleus.trainer` or `malleus run` that no MalleusJob field states:
how many steps the run has, where it stops, where its checkpoints go, what it logs and which
plans it switches to.
"""

from __future__ import annotations

from dataclasses import dataclass

from malleus.job import ResolvedJob
from malleus.planner import Plan

__all__ = ["RunOptions"]


@dataclass(frozen=True)
class RunOptions:
    """One run's options (the same on every rank)."""

    steps: int | None = None
    """Total steps, also the length of the LR schedule (`--steps`); None: spec.training.steps."""
    until: int | None = None
    """Stop after this many steps (a later `--resume` continues); None: at the end."""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save every N steps; 0: only at the end (when `checkpoint_dir` is set)."""
    resume: bool = False
    save_model: str | None = None
    save_hf: str | None = None
    """Rank 0 writes the final model here as a Hugging Face folder (`--save-hf`, trainer/model/hf.py)."""
    log_every: int = 1
    quiet: bool = False
    switches: tuple[tuple[int, Plan], ...] = ()
    """(step, plan): the plan is in force from that step on."""
    report: str | None = None
    """Rank 0 writes the run's JSON report here at the end (`--report`, trainer/run/report.py)."""
    command: str = ""
    """The command line, as the report quotes it."""
    float64: bool = False
    """Tests only: train in float64 throughout (masters, copies, activations, Adam), whatever
    `spec.training.precision` says, so that any difference left between two plans cannot be
    float32 summation order (tests/trainer/model/test_float64.py)."""

    def total_steps(self, job: ResolvedJob) -> int:
        """The run's length: `steps`, or the job's."""
        return self.steps if self.steps is not None else job.steps
