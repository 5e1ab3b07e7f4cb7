"""What a job needs from the machine, and the plain words when the machine falls short."""

from __future__ import annotations

from pathlib import Path

import pytest

from malleus.job import BadInput, ResolvedJob
from malleus.job.resources import (
    RANK_BASE_MIB,
    Machine,
    check_resources,
    job_needs,
    probe_machine,
    require_resources,
)

ROOT = Path(__file__).resolve().parents[2]


def test_emulated_ranks_share_cores_but_real_timings_need_one_each() -> None:
    emulated = job_needs(8, emulated=True, gpus=False, parameters=1000, tp=2)
    real = job_needs(8, emulated=False, gpus=False, parameters=1000, tp=2)
    assert (emulated.cpus, real.cpus) == (2, 8)
    assert emulated.memory_mib > 8 * RANK_BASE_MIB


def test_every_shortfall_is_named_with_need_and_have() -> None:
    needs = job_needs(8, emulated=True, gpus=False, parameters=10_000_000, tp=2)
    problems = check_resources(needs, Machine(cpus=1, memory_mib=1024.0))
    assert len(problems) == 2
    cpu, memory = problems
    assert cpu.startswith("CPU cores: needs 2 (8 emulated GPUs at most 4 per core)")
    assert cpu.endswith("this machine gives 1")
    assert memory.startswith("memory: needs ") and "1.0 GiB available" in memory
    assert "8 ranks x (450 MiB per process + 76 MiB of model state)" in memory


def test_real_timings_on_too_few_cores_point_to_emulation() -> None:
    needs = job_needs(4, emulated=False, gpus=False, parameters=1000, tp=2)
    (problem,) = check_resources(needs, Machine(cpus=2, memory_mib=1e6))
    assert "need a core each" in problem and "spec.emulation.enabled" in problem


def test_gpus_are_counted_and_their_memory_checked() -> None:
    needs = job_needs(8, emulated=False, gpus=True, parameters=1000, tp=2)
    machine = Machine(cpus=16, memory_mib=1e6, gpus=4, gpu_memory_mib=40_000.0)
    problems = check_resources(needs, machine, gpu_memory_mib=81_559)
    assert problems[0] == "GPUs: the job has 8 ranks and each needs a GPU; this machine has 4"
    assert "gpuMemoryMiB is 81559 MiB but the smallest GPU has 40000 MiB" in problems[1]


def test_a_machine_that_fits_has_no_problems() -> None:
    needs = job_needs(4, emulated=True, gpus=False, parameters=1000, tp=2)
    assert check_resources(needs, Machine(cpus=2, memory_mib=4096.0)) == []
    assert check_resources(needs, Machine(cpus=2, memory_mib=None)) == []  # unknown: not refused


def test_probe_reads_this_machine_without_importing_torch() -> None:
    import sys

    had_torch = "torch" in sys.modules
    machine = probe_machine()
    assert machine.cpus >= 1
    assert machine.memory_mib is None or machine.memory_mib > 0
    assert ("torch" in sys.modules) == had_torch


def test_require_resources_refuses_a_resolved_job_with_every_shortfall_naming_the_file() -> None:
    job = ResolvedJob.load(ROOT / "examples" / "tiny-cpu.yaml")
    with pytest.raises(BadInput) as caught:
        require_resources(job, Machine(cpus=1, memory_mib=256.0), source="tiny-cpu.yaml")
    assert caught.value.paths == ["machine", "machine"]
    assert str(caught.value).startswith("invalid MalleusJob in tiny-cpu.yaml (2 faults):")
    assert "too small for 8 ranks: CPU cores: needs 2" in str(caught.value)
    roomy = require_resources(job, Machine(cpus=2, memory_mib=1e6))
    assert (roomy.ranks, roomy.cpus, roomy.gpus) == (8, 2, 0)
    assert require_resources(job, Machine(cpus=1, memory_mib=1.0), check=False).cpus == 2
