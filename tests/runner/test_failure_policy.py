"""The runner's side of failures without trainers: the failure policy, the coordinator that
moves, the report a resumed run appends to. Torch-free and fast."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from malleus.control import AsyncControlClient, ControlStatus, RecoveryRecord
from malleus.job import FailurePolicy
from malleus.runner.failures import (
    FailureLog,
    Supervision,
    backoff_seconds,
    parse_trainer_event,
    summary_lines,
    why_no_plan,
)
from malleus.runner.resume import append_report, checkpoint_generation
from malleus.runner.sinks import CoordinatorClient
from malleus.trainer.endpoint.metrics import TrainerMetrics
from malleus.trainer.endpoint.server import ControlServer
from tests.statuses import control_status


def test_backoff_doubles_per_failure_of_a_rank_and_is_capped() -> None:
    policy = FailurePolicy(restart_backoff_seconds=10)
    assert [backoff_seconds(policy, n) for n in (1, 2, 3, 5, 9)] == [10, 20, 40, 160, 300]
    assert backoff_seconds(FailurePolicy(restart_backoff_seconds=0), 4) == 0


def test_a_rank_is_replaced_after_its_backoff_until_its_restarts_are_used_up() -> None:
    s = Supervision(FailurePolicy(max_restarts=2, restart_backoff_seconds=5))
    assert s.failed(1, "killed by SIGKILL", now=100.0) == "replace in 5 s"
    assert s.due(104.9) == [] and s.due(105.0) == [1] and s.due(200.0) == []
    assert s.failed(1, "killed by SIGKILL", now=110.0) == "replace in 10 s"
    assert s.failed(2, "hung", now=110.0) == "replace in 5 s"  # counted per rank
    assert s.due(115.0) == [2] and s.due(120.0) == [1]
    assert s.failed(1, "exited with code 1", now=130.0) == "left out: 2 restarts used"
    assert s.out == {1: "exited with code 1"} and s.due(1e9) == []


def test_trainer_lines_and_the_no_plan_verdict_are_read() -> None:
    line = "[malleus] recovered from the failure of rank(s) [1, 3] at step 7: replicas"
    assert parse_trainer_event(line) == (
        "recovered",
        {"ranks": [1, 3], "step": 7, "line": line},
    )
    assert parse_trainer_event("[malleus] rank 2 joined at step 12") == (
        "joined",
        {"rank": 2, "step": 12},
    )
    assert parse_trainer_event("[malleus] step 2 (3/10) loss 4.0") is None
    tails = {0: ["x", "malleus trainer: no valid plan on the GPUs left [0]: tp 2 needs 2"], 1: []}
    assert why_no_plan(tails) == "malleus trainer: no valid plan on the GPUs left [0]: tp 2 needs 2"
    assert why_no_plan({0: ["fine"]}) is None


def test_a_recovery_is_timed_from_the_fault_and_recorded_once() -> None:
    from malleus.runner.failures import Failure

    log = FailureLog()
    log.add_failure(Failure(1, "killed by SIGKILL", 8, 20.0, 1, "replace in 2 s"))
    record = RecoveryRecord(
        epoch=1,
        failed={1: "killed"},
        step=8,
        steps_lost=0,
        seconds=1.5,
        bytes_restored=4096,
        mode="replicas",
        generation=2,
    )
    got = log.add_record(record, committed_at=22.5, fault_at=log.fault_time([1]))
    assert got is not None and got.seconds == pytest.approx(2.5) and got.trainer_seconds == 1.5
    assert log.add_record(record, 30.0, 20.0) is None  # the same epoch, polled again
    report = log.to_report()
    lines = summary_lines(report)
    assert "failures: 1" in lines and "recoveries: 1" in lines
    assert any("rank 1 killed by SIGKILL at step 8: replace in 2 s" in ln for ln in lines)
    assert any(ln.split()[:2] == ["r1", "8"] and "replicas" in ln for ln in lines)
    assert summary_lines({"failures": [], "recoveries": []}) == []


TOKEN = "t0ken"


def _status() -> ControlStatus:
    return control_status(world=3, step=4)


def _endpoint(port: int = 0, *, coordinator: bool = True) -> ControlServer:
    """A real trainer endpoint: the coordinator's, or a rejoined rank's metrics-only one."""
    status = _status if coordinator else None
    metrics = TrainerMetrics("demo", 0, 0)
    server = ControlServer(
        "127.0.0.1", port, TOKEN, status=status, inbox=None, metrics=metrics, inject=None
    )
    return server.start()


class _Procs:
    """What the client needs of TrainerProcesses: ports and the ranks alive."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.live = set(range(len(ports)))

    def url_of(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.ports[rank]}"

    @property
    def url(self) -> str:
        return self.url_of(0)

    def alive(self) -> list[int]:
        return sorted(self.live)


def test_the_client_follows_the_lowest_live_rank_that_coordinates() -> None:
    servers = [_endpoint() for _ in range(3)]
    ports = [s.port for s in servers]
    procs = _Procs(ports)
    rejoined: list[ControlServer] = []

    async def scenario() -> list[Any]:
        client = CoordinatorClient(procs, TOKEN)  # type: ignore[arg-type]
        seen: list[Any] = [(await client.status()).step, client.rank]
        servers[0].stop()  # rank 0 gone: its port refuses
        procs.live.discard(0)
        seen += [(await client.status()).step, client.rank]  # found rank 1 on the failed call
        procs.live.add(0)  # a replacement of rank 0, not serving yet
        await client.follow()
        seen.append(client.rank)
        # It joined while rank 1 coordinates: it serves its node's metrics page and answers
        # /healthz, but it is not the coordinator (a plan posted there would be refused).
        rejoined.append(_endpoint(ports[0], coordinator=False))
        assert await AsyncControlClient(procs.url_of(0)).healthz()
        await client.follow()
        seen.append(client.rank)
        rejoined[0].stop()
        rejoined.append(_endpoint(ports[0]))  # a later plan re-admitted it: it coordinates
        await client.follow()
        seen.append(client.rank)
        await client.aclose()
        return seen

    try:
        assert asyncio.run(scenario()) == [4, 0, 4, 1, 1, 1, 0]
    finally:
        for s in [*servers[1:], *rejoined[1:]]:
            s.stop()


def test_a_resumed_report_keeps_the_steps_before_the_checkpoint_and_appends() -> None:
    def row(step: int, gen: int) -> dict[str, Any]:
        return {"step": step, "seconds": 1.0, "loss": 5.0 - step / 10, "generation": gen}

    previous = {
        "started": "2026-12-01T10:00:00+00:00",
        "per_step": [row(s, 1) for s in range(7)],  # steps 5 and 6 were after the checkpoint
        "events": [{"kind": "a"}],
        "plan_changes": [],
        "switches": [{"generation": 1, "step": 0}],
        "wall_seconds": 10.0,
        "training_seconds": 7.0,
        "exit": {"code": 130, "reason": "interrupted"},
        "tokens_per_step": 8,
        "initial_plan": {"generation": 1},
        "failures": [{"rank": 1}],
    }
    current = {
        "started": "2026-12-01T11:00:00+00:00",
        "command": "malleus run --resume w",
        "per_step": [row(s, 1) for s in range(5, 12)],
        "events": [{"kind": "b"}],
        "plan_changes": [],
        "switches": [{"generation": 1, "step": 0}],
        "wall_seconds": 20.0,
        "training_seconds": 7.0,
        "exit": {"code": 0, "reason": "completed"},
        "tokens_per_step": 8,
        "failures": [],
    }
    out = append_report(previous, current, resume_step=5)
    assert [r["step"] for r in out["per_step"]] == list(range(12))
    assert out["steps"] == 12 and out["wall_seconds"] == 30.0 and out["training_seconds"] == 14.0
    assert out["mean_tokens_per_second"] == pytest.approx(8 * 12 / 14.0)
    assert [e["kind"] for e in out["events"]] == ["a", "b"]
    assert out["switches"] == [{"generation": 1, "step": 0}]
    assert out["started"] == previous["started"] and out["exit"]["code"] == 0
    assert out["failures"] == [{"rank": 1}]
    assert out["resumes"] == [
        {
            "step": 5,
            "started": current["started"],
            "command": current["command"],
            "previous_exit": previous["exit"],
        }
    ]
    again = append_report(out, current, resume_step=9)
    assert len(again["resumes"]) == 2


def test_the_checkpoint_names_its_step_and_plan_generation(tmp_path: Path) -> None:
    assert checkpoint_generation(tmp_path) is None
    (tmp_path / "step-00000020").mkdir()
    (tmp_path / "step-00000020" / "manifest.json").write_text('{"step": 20, "plan_generation": 3}')
    (tmp_path / "latest").write_text("step-00000020\n")
    assert checkpoint_generation(tmp_path) == (20, 3)
