"""The planner's search: `plan(problem)` -> the fastest `Plan` it finds in its budget.

Rooms:
- `driver`: `plan()` and what surrounds the phases: the budget (`default_budget`), rate
  bucketing, which layouts become plans, polishing under the true rates, the final choice;
- `phases`: groupings -> template and partition layouts -> hill climbs, each by its share of
  the one `Deadline` (`deadline`);
- `nodegroups`, `grouping`: each straggler node's TP groupings, and one chosen per node;
- `templates`, `localsearch`: the layouts scored, and the climbs between them;
- `evaluate`: scoring a layout (pipelines solved, micro-batches split), with its caches;
- `layers`, `layersplit`, `microbatch`: the exact inner solvers (a pipeline's stage order and
  layer split, the micro-batch split);
- `materialize`, `previous`, `settle`: layouts made into ranked plans, the previous plan
  re-split, and a last climb under the true rates.

Imports: search -> the planner's contract and cost model (`malleus.planner.problem`, `plan`,
`cost`, `pace`, `schedule`, `memory`, `validate`); never the reverse: nothing in
`malleus/planner/` outside this package imports it, except the package's `__init__`, which
exports `plan`. No torch, no solver processes.
"""

from .driver import MIGRATION_SLACK, Deadline, default_budget, plan

__all__ = ["MIGRATION_SLACK", "Deadline", "default_budget", "plan"]
