"""The Trainer: one rank's part of a plan (its pieces, optimizer state and layout) and its step.

Holds: `trainer.py` (the Trainer, its step and its plan switch), `figures.py` (what a step
measures and publishes beside the step), `calibrator.py` (the calibration window under each
plan), `services.py` (clock, profiler, metrics, control endpoint, plan inbox that the loop plugs
into), `step.py` (the step's figures and what the helpers read of a Trainer), `state.py` (a Trainer's state in and out: checkpoints and the full model).

May import: every room below it (`world` .. `endpoint`); never `recovery`, `launch` or `run`.
"""
