"""`spec.training.compile`: the layers' math through `torch.compile` (inductor, here on the CPU)
trains the model the uncompiled layers train, to rounding, and compiles once for every layer.

A one-rank job in this process (gloo, a world of one), tp 1, 3 layers, two steps each way from
the same seed. The fused kernels round in their own order, so the bound is the plans' fp32
bound against the reference (1e-4 relative), not bit equality.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from malleus.trainer.engine.state import gather_full
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.world.world import World

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="torch.compile on the CPU needs a C compiler (cc or gcc on PATH)",
)

LAYERS = 3


def train(world: World, compiled: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    job = tc.small_job(
        1,
        1,
        tp=1,
        model={"layers": LAYERS},
        training={"globalBatchSize": 4, "microBatchSize": 2, "steps": 2, "compile": compiled},
    )
    plan = tc.plan([(2, [([0], (0, LAYERS))])], tp=1)
    trainer = Trainer(job, plan, rank=0, world=world, device=torch.device("cpu"))
    losses = [trainer.train_step().loss for _ in range(2)]
    return losses, gather_full(trainer, 0)


def test_compiled_layers_train_the_same_model(one_rank: World) -> None:
    torch._dynamo.reset()  # compiled code of earlier tests in this process: compiled anew here
    counters.clear()
    eager_losses, eager = train(one_rank, compiled=False)
    assert counters["stats"]["unique_graphs"] == 0  # the uncompiled path compiles nothing
    losses, model = train(one_rank, compiled=True)
    # RMSNorm, attention, SwiGLU: one graph each for all 3 layers and the final norm (a
    # layer's weights are arguments, so no layer recompiles another's graph).
    assert counters["stats"]["unique_graphs"] == 3
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert losses[1] != eager_losses[0]  # trained: the second step's loss moved
    assert tc.rel_diff(model, eager) <= 1e-4
