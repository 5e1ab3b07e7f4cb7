"""The loop wired to its services: /status, /metrics and /inject on a real one-rank job."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from malleus.control import ControlClient
from malleus.trainer.endpoint.metrics import parse_rates
from malleus.trainer.engine.services import Services
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.world.world import World

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")

TOKEN = "test-token"


def test_status_metrics_and_injection(one_rank: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLEUS_CONTROL_TOKEN", TOKEN)
    job = tc.small_job(
        1,
        1,
        tp=1,
        model={"layers": 2},
        training={"globalBatchSize": 2, "steps": 3},
        # A budget the tiny model's real math stays well inside even on a loaded host (at 20 ms
        # a layer, two busy cores overran it and read rates of 2-5).
        emulation=tc.emulation(0.1, 0.2),
    )
    plan = tc.plan([(2, [([0], (0, 2))])], tp=1)
    svc = Services.create(job, 0, control_port=0, host="127.0.0.1")
    try:
        trainer = Trainer(
            job, plan, rank=0, world=one_rank, device=torch.device("cpu"), services=svc
        )
        trainer.train_step()  # warm-up: one-off costs may overrun the emulated budget
        first = trainer.train_step()
        assert first.rates[0] == pytest.approx(1.0, abs=0.3)
        client = ControlClient(svc.server.url, TOKEN)
        status = client.status()
        assert (status.step, status.generation, status.steps, status.done) == (2, 0, 3, False)
        assert status.rates == {0: pytest.approx(first.rates[0])}
        assert parse_rates(client.metrics_text(), job="test") == status.rates
        client.inject(0, 2.5)
        second = trainer.train_step()  # the injection takes effect at this step boundary
        assert svc.clock.factor == 2.5
        assert second.rates[0] == pytest.approx(2.5, rel=0.2)
    finally:
        svc.close()
