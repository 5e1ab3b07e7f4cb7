"""`malleus run`'s report: the JSON run report, its summary table and its plot.

Pure functions of what the run recorded (`malleus.runner.record`), so a saved report can be
read, printed and plotted again. Rooms:
- `build`: the run's facts (`RunFacts`) and the report's assembly (`build_report`);
- `figures`: per plan change (predicted against measured) and per re-plan window;
- `baseline`: the static baseline, the first plan held all run, predicted on the run's steps;
- `text`: the end-of-run summary table;
- `plot`: the run's picture (matplotlib, imported only when drawing; `plot_report` is not
  exported here, so importing the report never loads it).

Imports: the runner's `record` and `changes`, the controller's events and decisions, the job's
shared report parts (`malleus.job.report`) and the planner's cost model; nothing here starts,
watches or talks to a process.
"""

from .baseline import (
    ProblemOf,
    baseline_verdict,
    judge_baseline,
    static_baseline,
    static_baseline_of,
)
from .build import RunFacts, build_report, refigure
from .figures import plan_changes, replan_windows
from .text import summary_text

__all__ = [
    "ProblemOf",
    "RunFacts",
    "baseline_verdict",
    "build_report",
    "judge_baseline",
    "plan_changes",
    "refigure",
    "replan_windows",
    "static_baseline",
    "static_baseline_of",
    "summary_text",
]
