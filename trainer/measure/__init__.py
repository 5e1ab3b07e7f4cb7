"""What the trainer measures: straggling rates, the emulated GPU clock, the cost model's
calibration terms and how calibrations merge.

Holds: `profiling.py` (rates from compute time per unit of work), `emulation.py` (the emulated
clock and injected slowdowns), `calibration_terms.py` (every rank's figures reduced to the
planner's calibration; torch-free), `calibration_merge.py` (calibrations over a window and
across plans).

May import: `world`, `model`, `data`, `parallel` (and `malleus.job`, `malleus.planner`).
"""
