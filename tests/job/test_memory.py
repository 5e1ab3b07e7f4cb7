"""The planner's memory model of a job, checked by hand and against examples/problems/70b.json."""

from __future__ import annotations

import pytest

from malleus.job import PRESETS
from malleus.job.memory import MIB, layer_parameters, memory_model


def test_memory_model_of_the_tiny_preset_by_hand() -> None:
    cfg = PRESETS["tiny"]  # hidden 64, ffn 128, vocab 256, sequence 64
    h, f = 64, 128
    params = (4 * h * h + 4 * h) + (3 * h * f + f + h) + 4 * h
    assert layer_parameters(cfg) == params
    mem = memory_model(cfg, tp=2, micro_batch_size=2, capacity_mib=1000)
    assert mem.layer_mb == pytest.approx(params * 16 / 2 / MIB)
    assert mem.activation_mb == pytest.approx(2 * 64 * 64 * 34 / 2 / MIB)
    assert mem.embedding_mb == pytest.approx(256 * 64 * 16 / 2 / MIB)
    assert (mem.fixed_mb, mem.capacity_mb) == (2000.0, 1000.0)


def test_memory_model_of_llama_70b_is_in_the_designs_range() -> None:
    # examples/problems/70b.json (tp 8): layer 1470 MB, activations 178 MB. GQA is not modelled, so
    # the layer state comes out higher (safe side).
    mem = memory_model(PRESETS["llama-70b"], tp=8, micro_batch_size=1, capacity_mib=81559)
    assert 1400 < mem.layer_mb < 2000
    assert 100 < mem.activation_mb < 200
