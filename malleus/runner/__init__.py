"""`malleus run`: a MalleusJob on one machine, no cluster, with the operator's decision loop.

prepare (manifest, resources, first plan, or the checkpoint `--resume` continues from: exit 2
before anything starts) -> processes (the rendezvous store, then one `python -m malleus.trainer`
per GPU, torchrun-style) -> session (the shared Controller on the coordinator's /metrics,
switching plans live, or by restart, or never; supervise: failed ranks replaced under
spec.failurePolicy; supervise_restart: restart mode's stop-and-start) -> record -> report, plot, summary (failures: what failed and how the job
recovered).

Torch-free: the trainers run in their own processes; only they import torch.
"""

from .cli import add_arguments, main, run
from .prepare import LocalRunOptions, Mode, Prepared, prepare
from .progress import Progress, ProgressState, bar_text, line_text
from .record import PlanSwitch, RunRecord, StepRecord, parse_step_line
from .report import RunFacts, build_report, plan_changes, summary_text

__all__ = [
    "LocalRunOptions",
    "Mode",
    "PlanSwitch",
    "Prepared",
    "Progress",
    "ProgressState",
    "RunFacts",
    "RunRecord",
    "StepRecord",
    "add_arguments",
    "bar_text",
    "build_report",
    "line_text",
    "main",
    "parse_step_line",
    "plan_changes",
    "prepare",
    "run",
    "summary_text",
]
