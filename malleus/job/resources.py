"""Can this machine run the job? Checked before anything starts, with what it needs said plainly.

Torch-free and in the job package because both `malleus run` and `malleus train` check it.

A local run starts one process per emulated GPU. On CPUs the emulated clock makes several ranks
share a core (each mostly waits out its emulated compute), but not without bound; without
emulation the ranks' real timings are the rates, so each needs a core of its own or the rates
measure contention. Memory: every rank is a Python process with torch loaded plus its share of
the model state. With real GPUs, each rank needs a GPU of its own.

The probe does not import torch: GPUs are looked for only when the machine shows a sign of
them, and then counted by the trainer's own Python (what the trainer will see).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from malleus.errors import BadInput, Fault

if TYPE_CHECKING:
    from .resolved import ResolvedJob

__all__ = [
    "GPU_RANK_MIB",
    "NO_RESOURCE_CHECK",
    "RANKS_PER_CORE",
    "RANK_BASE_MIB",
    "Machine",
    "Needs",
    "check_resources",
    "job_needs",
    "probe_machine",
    "require_resources",
    "usable_cpus",
]

RANKS_PER_CORE = 4
"""Emulated GPUs one CPU core carries with their step times still reflecting the layout
(measured: 8 ranks on 2 shared cores keep the emulated charges within a few percent)."""
RANK_BASE_MIB = 450
"""Resident memory of one CPU trainer process before its model state (Python, torch, gloo):
measured ~300 MiB for the tiny presets, plus headroom for activations and buffers."""
GPU_RANK_MIB = 2048
"""Host memory of one trainer process driving a GPU (CUDA context, pinned buffers)."""
_STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient and two Adam moments
_MIB = 1 << 20


@dataclass(frozen=True)
class Machine:
    """What this machine offers."""

    cpus: int
    memory_mib: float | None
    """Available (not total) memory; None when it cannot be read."""
    gpus: int = 0
    gpu_memory_mib: float | None = None
    """The smallest GPU's memory."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Needs:
    """What the job needs, and why (one line each)."""

    ranks: int
    emulated: bool
    cpus: int
    memory_mib: float
    gpus: int
    why_cpus: str
    why_memory: str


def _available_memory_mib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / _MIB
    except (ValueError, OSError, AttributeError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_GPU_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "mem = [torch.cuda.get_device_properties(i).total_memory for i in range(n)]\n"
    "print(json.dumps({'gpus': n, 'memory': min(mem) if mem else None}))\n"
)


def _probe_gpus(python: str, timeout: float) -> tuple[int, float | None]:
    """(GPUs, smallest GPU memory MiB) as the trainer's torch sees them; (0, None) without."""
    signs = shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists() or Path("/dev/kfd").exists()
    if not signs:
        return 0, None
    try:
        out = subprocess.run(
            [python, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=timeout, check=True
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0, None
    memory = found.get("memory")
    return int(found.get("gpus", 0)), (memory / _MIB if memory else None)


def probe_machine(python: str = sys.executable, gpu_probe_timeout: float = 60.0) -> Machine:
    """This machine's cores (the ones this process may use), available memory and GPUs."""
    gpus, gpu_memory = _probe_gpus(python, gpu_probe_timeout)
    return Machine(
        cpus=usable_cpus(), memory_mib=_available_memory_mib(), gpus=gpus, gpu_memory_mib=gpu_memory
    )


def job_needs(world: int, *, emulated: bool, gpus: bool, parameters: int, tp: int) -> Needs:
    """What `world` ranks need: cores, memory (base + the state a rank may hold), GPUs.

    A rank holds at most the state of every layer's shards of its TP share, `1/tp` of the model
    (a single-stage pipeline); `1/tp` is the safe bound for any plan.
    """
    state_mib = parameters * _STATE_BYTES_PER_PARAM / tp / _MIB
    base = GPU_RANK_MIB if gpus else RANK_BASE_MIB
    memory = world * (base + state_mib)
    why_memory = f"{world} ranks x ({base} MiB per process + {state_mib:.0f} MiB of model state)"
    if gpus:
        cpus, why_cpus = 1, "one core drives the GPUs"
    elif emulated:
        cpus = math.ceil(world / RANKS_PER_CORE)
        why_cpus = f"{world} emulated GPUs at most {RANKS_PER_CORE} per core"
    else:
        cpus = world
        why_cpus = (
            f"{world} ranks timed for real need a core each, or their rates measure contention "
            "(set spec.emulation.enabled to share cores)"
        )
    return Needs(
        ranks=world,
        emulated=emulated,
        cpus=cpus,
        memory_mib=memory,
        gpus=world if gpus else 0,
        why_cpus=why_cpus,
        why_memory=why_memory,
    )


def check_resources(
    needs: Needs, machine: Machine, *, gpu_memory_mib: float | None = None
) -> list[str]:
    """Every shortfall, one line each, saying what is needed and what there is; empty if fine."""
    problems: list[str] = []
    if needs.gpus and machine.gpus < needs.gpus:
        problems.append(
            f"GPUs: the job has {needs.gpus} ranks and each needs a GPU; this machine has "
            f"{machine.gpus}"
        )
    if (
        needs.gpus
        and gpu_memory_mib is not None
        and machine.gpu_memory_mib is not None
        and gpu_memory_mib > machine.gpu_memory_mib
    ):
        problems.append(
            f"GPU memory: spec.resources.gpuMemoryMiB is {gpu_memory_mib:.0f} MiB but the "
            f"smallest GPU has {machine.gpu_memory_mib:.0f} MiB (plans would not fit)"
        )
    if machine.cpus < needs.cpus:
        problems.append(
            f"CPU cores: needs {needs.cpus} ({needs.why_cpus}); this machine gives {machine.cpus}"
        )
    if machine.memory_mib is not None and machine.memory_mib < needs.memory_mib:
        problems.append(
            f"memory: needs {needs.memory_mib / 1024:.1f} GiB ({needs.why_memory}); "
            f"{machine.memory_mib / 1024:.1f} GiB available"
        )
    return problems


NO_RESOURCE_CHECK = (
    "run it on a larger machine or make the job smaller (spec.nodes, spec.gpusPerNode); "
    "--no-resource-check starts it anyway (slowly, or until memory runs out)"
)


def require_resources(
    job: ResolvedJob, machine: Machine | None, *, source: str | None = None, check: bool = True
) -> Needs:
    """What `job` needs of `machine`; with `check`, `BadInput` listing every shortfall.

    The one check `malleus run` and `malleus train` make before starting a process, so both
    refuse a job too large for this machine with the same words. Each fault's path is
    ``machine``: the job is valid, this machine is too small for it. Without a machine (the
    check turned off, nothing probed) the job is taken to run on CPUs.
    """
    needs = job_needs(
        job.world,
        emulated=job.emulated,
        gpus=machine is not None and machine.gpus > 0,
        parameters=job.parameters,
        tp=job.tp,
    )
    if check and machine is not None:
        problems = check_resources(needs, machine, gpu_memory_mib=job.spec.resources.gpu_memory_mib)
        if problems:
            raise BadInput(
                [Fault("machine", f"too small for {job.world} ranks: {p}") for p in problems],
                source,
                hint=NO_RESOURCE_CHECK,
            )
    return needs
