"""One rank's run from start to end: the loop around the Trainer, its options, its inputs,
its report and the single-process reference.

Holds: `start.py` (`enter_job`: the rank enters its job), `loop.py` (`run_rank`: resume, switches, recoveries and admissions at step boundaries,
checkpoints, the end), `options.py` (`RunOptions`), `inputs.py` (judging `malleus train`'s
inputs before any rank starts), `report.py` (the JSON report), `reference.py` (the same
training in one process: the yardstick for exactness).

May import: every room of the trainer (`cli.py` and `__main__.py` sit above it).
"""
