"""Host synchronisations per training step: each one a GPU waits out, counted on the CPU.

On a GPU every read of a device tensor from Python (`.item()`, `.tolist()`, `float(t)`, `.cpu()`,
a blocking copy to the device) and every `torch.cuda.synchronize()` stops the host until the
device has drained its queue, so the next kernels cannot be queued behind the running ones. A
one-rank bf16 job runs here on the CPU with the step's synchronisation points switched to what
a GPU runs (the layer timer's and the communication meter's `torch.cuda.synchronize`, here a
counter); every such call is counted by where it comes from and held to `expected_syncs`, so
that a new one inside the step (a loss read per micro-batch, a Python check on a device tensor)
fails here, named, before it costs a GPU anything.
"""

from __future__ import annotations

import collections
import importlib
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from malleus.trainer.engine.calibrator import CAL_STEPS, CAL_WARMUP
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.world.world import World

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")

ROOT = Path(__file__).resolve().parents[3]
LAYERS, MICRO_BATCHES = 2, 4
READS = ["item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"]
"""Tensor methods that hand a value to Python: on a GPU each waits for the device."""


def expected_syncs(layers: int, micro_batches: int) -> dict[tuple[str, str], int]:
    """(what, where) -> calls in one step of a one-rank, one-stage job: today's count, each
    needed by a figure the step reports.

    - the layer timer (LayerTimer.__call__): a synchronize before and after every layer call,
      forward and backward, so that each layer's wall time is its compute: the per-layer
      seconds behind the straggling rate; 2 x 2 x layers per micro-batch;
    - the embedding's and head's timer (LayerTimer.end): the same around their forward and
      backward (the calibration's embedding and head terms); 2 x 4 per micro-batch;
    - the communication meter (CommMeter.timed) around the world collective: 2, so that the
      step's communication seconds are the collective's;
    - the world vector read back (Trainer._train_step's `.tolist()`): 1, the step's gradient
      norm, loss, every rank's rate and the coordinator's words, which the host needs.
    The losses are summed on the device (PipelineStage), and the batches go to the device from
    pinned memory without blocking (Trainer._batch): neither waits. A multi-rank job adds the
    meter's 2 around each gradient bucket's all-reduce and each pipeline transfer; the step
    that closes a calibration window, 1 (`expected_extra`).
    """
    per_micro = 2 * 2 * layers
    return {
        ("synchronize", "trainer/parallel/pipeline.py:__call__"): per_micro * micro_batches,
        ("synchronize", "trainer/parallel/pipeline.py:end"): 2 * 4 * micro_batches,
        ("synchronize", "trainer/parallel/tensor.py:timed"): 2,
        ("tolist", "trainer/engine/trainer.py:_train_step"): 1,
    }


def expected_extra(step: int) -> dict[tuple[str, str], int]:
    """The calibration window's last step reads its exchanged figures back: 1 `.tolist()`."""
    if step == CAL_WARMUP + CAL_STEPS - 1:
        return {("tolist", "trainer/engine/calibrator.py:_close"): 1}
    return {}


class Counter:
    def __init__(self) -> None:
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.on = False

    def hit(self, what: str) -> None:
        if not self.on:
            return
        for frame in reversed(traceback.extract_stack()[:-2]):  # innermost Malleus frame
            path = Path(frame.filename)
            if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("trainer", "malleus"):
                self.calls[(what, f"{path.relative_to(ROOT)}:{frame.name}")] += 1
                return
        self.calls[(what, "outside Malleus")] += 1


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    monkeypatch.setenv("MALLEUS_EXTERNAL_STORE", "1")
    world = World(1)
    init_distributed(DistEnv(0, 1, 0, "127.0.0.1", store.port), world, init_timeout_s=10)
    yield world
    dist.destroy_process_group()


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Counter:
    c = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *a, _f=original, _n=name, **k):
            c.hit(_n)
            return _f(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    original_to = torch.Tensor.to

    def to(self, *a, **k):
        device = k.get("device") or next((x for x in a if isinstance(x, (torch.device, str))), None)
        if device is not None and not k.get("non_blocking", False):
            c.hit("blocking copy")  # to a GPU from pageable memory: waits for the device
        return original_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: c.hit("synchronize"))
    return c


def test_host_syncs_per_step(one_rank: World, counter: Counter) -> None:
    job = tc.small_job(
        1,
        1,
        tp=1,
        model={"layers": LAYERS},
        training={"globalBatchSize": MICRO_BATCHES, "microBatchSize": 1, "precision": "bf16"},
    )
    plan = tc.plan([(MICRO_BATCHES, [([0], (0, LAYERS))])], tp=1)
    trainer = Trainer(job, plan, rank=0, world=one_rank, device=torch.device("cpu"))
    # What a CUDA device runs: LayerTimer and CommMeter choose these by the device's type.
    trainer.timer.sync = torch.cuda.synchronize
    trainer.meter.cuda = True
    trainer.train_step()  # step 0: one-off costs, outside the calibration window
    for step in range(1, CAL_WARMUP + CAL_STEPS + 1):
        counter.calls.clear()
        counter.on = True
        report = trainer.train_step()
        counter.on = False
        assert report.step == step
        allowed = collections.Counter(expected_syncs(LAYERS, MICRO_BATCHES))
        allowed.update(expected_extra(step))
        over = {k: (n, allowed.get(k, 0)) for k, n in counter.calls.items() if n > allowed[k]}
        assert not over, f"step {step}: host syncs (what, where): (counted, allowed) {over}"
        timer = ("synchronize", "trainer/parallel/pipeline.py:__call__")
        assert counter.calls[timer] == allowed[timer]  # the counting itself sees them all
    total = sum(expected_syncs(LAYERS, MICRO_BATCHES).values())
    assert total == MICRO_BATCHES * (4 * LAYERS + 8) + 3  # 67: the layer timer's, mostly
