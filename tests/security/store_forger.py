"""A stranger who can reach a job's rendezvous store: `python store_forger.py HOST PORT DIR`.

Run as a process of its own by tests/security/store_attacks.py (rank 0 starts it), with no key
of the job. It plants, once, every value a recovery or an admission decides by, unsealed or
sealed with a key of its own, each one that the ranks would act on were they to believe it:

- dead marks of the survivors (the leader would stop waiting for them, the others would give
  up on their leader's decision);
- for recovery epoch 1: a leader claim naming GPU 3 (the one that will die), an arrival of GPU 3
  (it would be a member again), releases (the leader of a hang would stop waiting), a decision
  that keeps every GPU and only redoes a step;
- a replacement's request to join for GPU 3 (the coordinator would admit a GPU nobody runs).

Then writes DIR/planted and, until DIR/stop appears (or 300 s), plants `rec/E/arrive` for
the next epochs every 20 ms: believed, it would stop every computing rank (a spurious recovery).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from malleus.trainer.world.sealed import Sealer


def main(host: str, port: int, out: Path) -> None:
    client = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=60))
    store = dist.PrefixStore("malleus/0/", client)
    own = Sealer.fresh()  # a key of its own: sealed, but not by the job
    for g in (0, 1, 2):
        store.set(f"rec/dead/{g}", "killed")
    store.set("rec/dead/1", own.seal("rec/dead/1", "killed"))
    store.set("rec/1/leader", "3")
    store.set("rec/1/alive/3", json.dumps({"gpu": 3, "step": 2, "timeout": False}))
    for g in (0, 1, 2):
        store.set(f"rec/1/released/{g}", "1")
    forged = {"members": [0, 1, 2, 3], "spurious": True, "step": 0, "vec": None}
    store.set("rec/1/decision", json.dumps(forged))
    n = store.add("join/3/n", 1)
    store.set(f"join/3/{n}", json.dumps({"at": time.time(), "nonce": "forged"}))
    (out / "planted").write_text("planted\n")
    deadline = time.monotonic() + 300
    while not (out / "stop").exists() and time.monotonic() < deadline:
        for e in (1, 2):
            store.set(f"rec/{e}/arrive", "1")
        time.sleep(0.02)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
