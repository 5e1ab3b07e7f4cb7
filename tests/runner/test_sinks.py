"""Reading a checkpoint directory for the report, and the emulated schedule's true rates.

(How a live switch is read from the trainers' /status is `tests/controller/test_sources.py`.)
"""

from __future__ import annotations

from pathlib import Path

from malleus.runner.prepare import true_rates
from malleus.runner.sinks import checkpoint_bytes, latest_checkpoint_step


def test_latest_checkpoint_step_and_size(tmp_path: Path) -> None:
    assert latest_checkpoint_step(tmp_path) is None and checkpoint_bytes(tmp_path) == 0
    step = tmp_path / "step-00000020"
    step.mkdir()
    (step / "rank-00000.pt").write_bytes(b"x" * 1000)
    (step / "manifest.json").write_bytes(b"{}")
    (tmp_path / "latest").write_text("step-00000020\n")
    assert latest_checkpoint_step(tmp_path) == 20
    assert checkpoint_bytes(tmp_path) == 1002


def test_true_rates_take_the_latest_scheduled_factor() -> None:
    schedule = ((40, 1, 3.0), (80, 6, 2.0), (140, 1, 1.0))
    assert true_rates(schedule, 39) == {}
    assert true_rates(schedule, 40) == {1: 3.0}
    assert true_rates(schedule, 100) == {1: 3.0, 6: 2.0}
    assert true_rates(schedule, 140) == {1: 1.0, 6: 2.0}
