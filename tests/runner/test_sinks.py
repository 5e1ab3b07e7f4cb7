"""Reading a switch from the trainer's /status, and a checkpoint directory, for the report."""

from __future__ import annotations

from pathlib import Path

from malleus.runner.prepare import true_rates
from malleus.runner.record import PlanSwitch
from malleus.runner.sinks import checkpoint_bytes, latest_checkpoint_step, switch_from_status


def test_the_trainers_migration_record_gives_the_switch_step() -> None:
    status = {
        "step": 12,
        "current_generation": 2,
        "migration": {"generation": 2, "step": 10, "seconds": 0.04, "bytes": 4096},
    }
    assert switch_from_status(status, 2, fallback_step=12) == PlanSwitch(2, 10, 0.04, 4096)


def test_without_a_record_of_this_generation_the_step_seen_is_the_bound() -> None:
    status = {"migration": {"generation": 1, "step": 4, "seconds": 0.5, "bytes": 8}}
    assert switch_from_status(status, 2, fallback_step=12) == PlanSwitch(2, 12, 0.5, 8)
    assert switch_from_status({}, 2, fallback_step=12) == PlanSwitch(2, 12)


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
