"""Host synchronisations per training step: each one a GPU waits out, counted on the CPU.

On a GPU every read of a device tensor from Python (`.item()`, `.tolist()`, `float(t)`, `.cpu()`,
a blocking copy to the device) and every `torch.cuda.synchronize()` stops the host until the
device has drained its queue, so the next kernels cannot be queued behind the running ones. A
one-rank bf16 job runs here on the CPU with the step's stopwatch switched to what a GPU runs
(trainer/parallel/timing.py): CUDA events read once per step (`EventStopwatch`, over a stand-in
for `torch.cuda.Event` whose wait is counted: tests/trainer/cuda_stand_in.py), and, as an emulated clock on a GPU has it, the
wall clock synchronised before every reading (`WallStopwatch(torch.cuda.synchronize)`). Every
synchronisation is counted by where it comes from and held to the expected table, so that a
new one inside the step (a loss read per micro-batch, a Python check on a device tensor) fails
here, named, before it costs a GPU anything.
"""

from __future__ import annotations

import collections
import importlib
import sys
import traceback
from pathlib import Path

import pytest
import torch

from malleus.trainer.engine.calibrator import CAL_STEPS, CAL_WARMUP
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.parallel.timing import EventStopwatch, WallStopwatch
from malleus.trainer.world.world import World

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
cs = importlib.import_module("cuda_stand_in")

ROOT = Path(__file__).resolve().parents[3]
TIMING = ROOT / "trainer" / "parallel" / "timing.py"
LAYERS, MICRO_BATCHES = 2, 4
READS = ["item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"]
"""Tensor methods that hand a value to Python: on a GPU each waits for the device."""


def expected_syncs(watch: str, layers: int, micro_batches: int) -> dict[tuple[str, str], int]:
    """(what, where) -> calls in one step of a one-rank, one-stage job, each needed by a figure
    the step reports.

    - `events`, what a GPU with real timings runs: the schedule's times are read once, as it
      ends (PipelineStage.run: the events' one wait; every layer's compute time, behind the
      straggling rate, the embedding's and the head's, the TP and pipeline communication), and
      the world vector once (Trainer._train_step's `.tolist()`: the step's gradient norm, loss,
      every rank's rate and the coordinator's words). 2 whatever the model.
    - `wall`, what an emulated clock on a GPU runs (it charges each call as it ends): a
      synchronize before and after every timed call, each layer's forward and backward
      (2 x 2 x layers per micro-batch) and the embedding's and the head's (2 x 4 per
      micro-batch); and the world vector's read (1).
    The losses are summed on the device (PipelineStage), and the batches go to the device from
    pinned memory without blocking (Trainer._batch): neither waits. A multi-rank job's gradient
    chunks and pipeline transfers are timed with the same stopwatch: with events nothing more in
    the step (a calibration window's steps read the gradient sync's timings once more, after
    the world vector's read, when the device is idle), with the wall clock 2 each.
    """
    if watch == "events":
        return {
            ("synchronize", "trainer/parallel/pipeline.py:run"): 1,
            ("tolist", "trainer/engine/trainer.py:_train_step"): 1,
        }
    per_pass = 2 * layers + 2 * 2  # the layers, the embedding and the head; forward or backward
    return {
        ("synchronize", "trainer/parallel/pipeline.py:_forward"): per_pass * micro_batches,
        ("synchronize", "trainer/parallel/pipeline.py:_backward"): per_pass * micro_batches,
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
        # The innermost Malleus frame that asked for a reading (the stopwatches only obey).
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = Path(frame.filename)
            if path == TIMING:
                continue
            if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("trainer", "malleus"):
                self.calls[(what, f"{path.relative_to(ROOT)}:{frame.name}")] += 1
                return
        self.calls[(what, "outside Malleus")] += 1


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


@pytest.mark.parametrize("watch", ["events", "wall"])
def test_host_syncs_per_step(one_rank: World, counter: Counter, watch: str) -> None:
    job = tc.small_job(
        1,
        1,
        tp=1,
        model={"layers": LAYERS},
        training={"globalBatchSize": MICRO_BATCHES, "microBatchSize": 1, "precision": "bf16"},
    )
    plan = tc.plan([(MICRO_BATCHES, [([0], (0, LAYERS))])], tp=1)
    trainer = Trainer(job, plan, rank=0, world=one_rank, device=torch.device("cpu"))
    # What a CUDA device runs (trainer/parallel/timing.py `stopwatch_for`).
    trainer.meter.watch = (
        EventStopwatch(lambda: cs.StandInEvent(torch.cuda.synchronize))
        if watch == "events"
        else WallStopwatch(torch.cuda.synchronize)
    )
    trainer.train_step()  # step 0: one-off costs, outside the calibration window
    for step in range(1, CAL_WARMUP + CAL_STEPS + 1):
        counter.calls.clear()
        counter.on = True
        report = trainer.train_step()
        counter.on = False
        assert report.step == step
        allowed = collections.Counter(expected_syncs(watch, LAYERS, MICRO_BATCHES))
        allowed.update(expected_extra(step))
        assert dict(counter.calls) == dict(allowed), f"step {step}: host syncs (what, where)"
        assert report.compute_seconds > 0  # the figures were read
        assert trainer.calibrator.window or step < CAL_WARMUP
    # The figures behind the rates, read either way: every layer pass, counted once.
    assert trainer.timer.units == 2 * LAYERS * MICRO_BATCHES
    assert trainer.timer.ends["head"][1] == MICRO_BATCHES
    total = sum(expected_syncs("wall", LAYERS, MICRO_BATCHES).values())
    assert total == MICRO_BATCHES * (4 * LAYERS + 8) + 1  # 65 with the wall clock, 2 with events
