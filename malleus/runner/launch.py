"""How one trainer rank of a local run is started: its command line and its environment.

`LaunchSpec` holds what stays the same across launches, relaunches and replacements, and builds
rank `rank`'s `python -m malleus.trainer` command (`argv`) and torchrun's variables (`env`), so a
local run exercises the exact entry point a pod runs. Apart from `malleus.runner.processes`
(which starts, watches and stops the processes) because it is pure: no process is touched here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["STORE_ENV", "LaunchSpec"]

STORE_ENV = "MALLEUS_STORE"


@dataclass(frozen=True)
class LaunchSpec:
    """How to start the trainers (what stays the same across relaunches)."""

    job: str
    world: int
    workdir: Path
    token_file: Path
    steps: int | None = None
    save_model: str | None = None
    save_hf: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    init_timeout: float = 120.0
    threads_per_rank: int = 1
    python: str = sys.executable
    fault_tolerant: bool = True
    """Give the ranks `MALLEUS_STORE`: they survive failures (recover, admit replacements).
    False (restart mode, the baseline): a failure ends every rank, as under plain torchrun,
    and the runner restarts them all; the store is the runner's all the same."""

    def argv(
        self, rank: int, plan: Path, control_port: int, resume: bool, *, join: bool = False
    ) -> list[str]:
        """Rank `rank`'s command line; `control_port` the job's base control port (a rank
        serves at base + its local rank while it is the coordinator)."""
        args = [self.python, "-m", "malleus.trainer", self.job, "--plan", str(plan)]
        args += ["--log-every", "1", "--init-timeout", f"{self.init_timeout:g}"]
        args += ["--control-port", str(control_port)]
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        if self.save_model:
            args += ["--save-model", self.save_model]
        if self.save_hf:
            args += ["--save-hf", self.save_hf]
        if self.checkpoint_dir:
            args += ["--checkpoint-dir", self.checkpoint_dir]
            args += ["--checkpoint-every", str(self.checkpoint_every)]
            if resume and not join:
                args.append("--resume")
        if join:
            args.append("--join")
        return args

    def env(self, rank: int, master_port: int, store: str | None = None) -> dict[str, str]:
        """torchrun's variables; with `store` (host:port) the runner's rendezvous store."""
        env = dict(os.environ)
        env.pop("MALLEUS_EXTERNAL_STORE", None)
        env.pop(STORE_ENV, None)
        env.pop("MALLEUS_CONTROL_TOKEN", None)
        env.pop("MALLEUS_STORE_KEY", None)  # the store's key comes from the token file alone
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),  # one machine: the rank is also the local GPU index
            WORLD_SIZE=str(self.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
            OMP_NUM_THREADS=str(self.threads_per_rank),
            MALLEUS_CONTROL_TOKEN_FILE=str(self.token_file),
            PYTHONUNBUFFERED="1",
        )
        if store is not None:
            # Every rank (rank 0 too) is a client of the runner's store: no rank hosts it.
            env["MALLEUS_EXTERNAL_STORE"] = "1"
            if self.fault_tolerant:
                env[STORE_ENV] = store
        return env


def without_faults(spec: LaunchSpec, step: int, workdir: Path, launch: int) -> LaunchSpec:
    """`spec` with a copy of the job whose scheduled failures up to `step` are gone (written
    to `workdir`/job-launch-`launch`.yaml): a restarted rank trains those steps again, and must
    not fail at them again. `spec` itself when there is nothing to drop."""
    try:
        manifest = yaml.safe_load(Path(spec.job).read_text())
        schedule = manifest["spec"]["emulation"]["schedule"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return spec
    kept = [e for e in schedule if not ("fail" in e and int(e.get("step", 0)) <= step)]
    if len(kept) == len(schedule):
        return spec
    manifest["spec"]["emulation"]["schedule"] = kept
    path = workdir / f"job-launch-{launch}.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return dataclasses.replace(spec, job=str(path.resolve()))
