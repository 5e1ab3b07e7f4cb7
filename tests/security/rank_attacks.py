"""The body of the 2-rank gloo job in tests/security/test_ranks.py: GPU 1 attacks, GPU 0 runs
the real code.

Not collected by pytest (no test_ prefix); imported by bare name (the test puts this folder on
sys.path) so that the spawned children can unpickle `attack` — the launcher's own pickling of
its children's arguments, within one user's processes, is not a channel between ranks.

Each round is one exchange of the product (trainer/world/exchange.py and its callers), with
GPU 1 putting into it what a compromised worker would, and GPU 0 calling the product's own
function. Both ranks take part in the same collectives in the same order, so a round that
goes as the test expects never leaves a peer waiting. Every outcome is written to OUT as JSON
by the rank that observed it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from pydantic import ValidationError

from malleus.job import ResolvedJob
from malleus.planner import Plan
from malleus.trainer.checkpoint import directory
from malleus.trainer.checkpoint.files import CheckpointError
from malleus.trainer.engine.state import exchange_verdicts
from malleus.trainer.engine.trainer import Trainer
from malleus.trainer.launch.distributed import DistEnv, init_distributed
from malleus.trainer.switching.protocol import STOP, Boundary
from malleus.trainer.world.exchange import (
    all_gather_bytes,
    broadcast_bytes,
    encode_json,
    gather_bytes,
)
from malleus.trainer.world.world import World

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


class Armed:
    """Unpickled, it creates the file `marker` (as `os.system` would run a command)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def armed_pickle(marker: str) -> bytes:
    """What `*_object` collectives would have unpickled: a pickle that runs code."""
    return pickle.dumps(Armed(marker))


def job() -> ResolvedJob:
    """The smallest real job on 2 GPUs (1 node, tp 2, a 2-layer model)."""
    manifest = yaml.safe_load(TINY.read_text())
    spec = manifest["spec"]
    spec.update(nodes=1, gpusPerNode=2, parallelism={"tp": 2})
    spec["model"] = {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 256, "sequence": 16}
    spec["training"] |= {"globalBatchSize": 2, "steps": 4}
    spec["emulation"] = {"enabled": False}
    return ResolvedJob.load(manifest).check()


def plan() -> Plan:
    return Plan.model_validate(
        {
            "tp": 2,
            "pipelines": [{"micro_batches": 2, "stages": [{"ranks": [0, 1], "layers": [0, 2]}]}],
            "excluded": [],
        }
    )


class ForgedStop:
    """What GPU 1 announces as if it were the coordinator: a stop."""

    def take(self) -> tuple[Boundary, bytes]:
        return Boundary(0, STOP), b""


class _View:
    def __init__(self, world: World, device: torch.device) -> None:
        self.world, self.device = world, device


def _refusal(fn: Any) -> str:
    try:
        fn()
    except (CheckpointError, ValidationError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def attack(out: str, marker: str) -> None:
    env = DistEnv.from_env()
    world = World(env.world_size)
    world.set_collective_timeout(60)
    device = init_distributed(env, world, collective_timeout_s=60)
    me, seen = env.rank, {}
    evil = armed_pickle(marker)
    view = _View(world, device)
    try:
        # 1. A resume's verdicts (was all_gather_object): GPU 1 sends the armed pickle.
        if me == 0:
            seen["verdicts"] = _refusal(lambda: exchange_verdicts(view, None, None))  # type: ignore[arg-type]
        else:
            all_gather_bytes(evil, world=world, device=device, what="attack")

        # 2. The same exchange, GPU 1 announcing 1 TiB: refused before any allocation.
        if me == 0:
            seen["oversize"] = _refusal(lambda: exchange_verdicts(view, None, None))  # type: ignore[arg-type]
        else:
            lies = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
            dist.all_gather(lies, torch.tensor([1 << 40], dtype=torch.int64))

        # 3. The starting plan (was broadcast_object_list), from a coordinator that sends the
        #    armed pickle: GPU 1 decodes it as trainer/cli.py does.
        if me == 0:
            broadcast_bytes(evil, world=world, device=device, what="attack")
        else:
            data = broadcast_bytes(None, world=world, device=device, what="the starting plan")
            seen["plan"] = _refusal(lambda: Plan.from_json(data))

        # 4. A checkpoint's file reports (was gather_object): the armed pickle, then a JSON
        #    report that claims GPU 0's piece for GPU 1's file.
        owners = {"embed.weight": 0, "head.weight": 1}
        forged = [
            {"rank-00001.pt": {"sha256": "0" * 64, "bytes": 1}},
            {"embed.weight": {"file": "rank-00001.pt"}},
        ]
        for name, payload in (("reports", evil), ("report_claims", encode_json(forged))):
            if me == 0:
                seen[name] = _refusal(
                    lambda: directory._gather_reports({}, {}, 0, owners, world, device)
                )
            else:
                gather_bytes(payload, 0, world=world, device=device, what="attack")

        # 5. The step's world vector (was an all-reduce SUM): GPU 1 announces a stop as if it
        #    were the coordinator; nobody stops. Then the real coordinator's stop stops both.
        trainer = Trainer(job(), plan(), rank=me, world=world, device=device)
        if me == 1:
            trainer.coordinator = ForgedStop()  # type: ignore[assignment]
        trainer.train_step()
        seen["forged_stop"] = trainer.boundary.stopping
        if me == 0:
            assert trainer.services.stop is not None
            trainer.services.stop.request({"checkpoint": False})
        trainer.train_step()
        seen["real_stop"] = trainer.boundary.stopping
    finally:
        (Path(out) / f"gpu{me}.json").write_text(json.dumps(seen))
        if dist.is_initialized():
            dist.destroy_process_group()
