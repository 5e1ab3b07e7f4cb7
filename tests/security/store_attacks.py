"""The body of the fault-tolerant 4-rank job in tests/security/test_store_seal.py: the job trains
(tests/trainer/fault_cases.py `run`) while a stranger writes its store (store_forger.py).

Not collected by pytest (no test_ prefix); imported by bare name (the test puts this folder and
tests/trainer on sys.path) so that the spawned children can unpickle `attacked`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fault_cases as fc
import torch.distributed as dist

from malleus.trainer.launch.distributed import DistEnv
from malleus.trainer.world.sealed import Sealer, job_store_key

FORGER = Path(__file__).with_name("store_forger.py")


def attacked(job: Any, plan: Any, opts: Any, out: str) -> int:
    """`fc.run` on every rank; GPU 0 first starts the stranger and waits until it planted its
    values, and at the end reads the launcher's dead mark of GPU 3 with the job's key (the one
    `spawn_local` gave the ranks) into OUT/dead-mark.json."""
    env = DistEnv.from_env()
    forger = None
    where = Path(out)
    if env.rank == 0:
        forger = subprocess.Popen(
            [sys.executable, str(FORGER), env.master_addr, str(env.master_port), out]
        )
        deadline = time.monotonic() + 120
        while not (where / "planted").exists():
            if time.monotonic() > deadline or forger.poll() is not None:
                raise RuntimeError("the forger did not plant its values")
            time.sleep(0.05)
    try:
        code = fc.run(job, plan, opts, out)
        if env.rank == 0:
            key = job_store_key()
            assert key is not None
            client = dist.TCPStore(env.master_addr, env.master_port, None, False)
            store = dist.PrefixStore("malleus/0/", client)
            mark = Sealer(key).get(store, "rec/dead/3")
            (where / "dead-mark.json").write_text(json.dumps({"3": mark}))
        return code
    finally:
        if forger is not None:
            (where / "stop").write_text("stop\n")
            try:
                forger.wait(timeout=10)
            except subprocess.TimeoutExpired:
                forger.kill()
                forger.wait()
