"""Plan execution: the layout (who does what, from the plan alone), tensor-parallel collectives,
the 1F1B pipeline, gradient sync, the per-piece optimizer, migration between plans.

Holds: `layout.py`, `groups.py`, `tensor.py`, `stage.py`, `pipeline.py`, `grad_sync.py`,
`optim.py`, `migrate.py`. Nothing here reads a job manifest or knows the Trainer.

May import: `world`, `model`, `data` (and `malleus.job`, `malleus.planner`).
"""
