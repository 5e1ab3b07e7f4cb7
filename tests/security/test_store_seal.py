"""Ranks trust only what they can check (issue 25, item 3): values of the job's store.

The job's rendezvous store (a TCPStore) has no authentication, so whoever can reach it could
plant the values that decide membership, admission and recovery. They are sealed with the job's
key (malleus/control/sealed.py, trainer/world/sealed.py) and a rank believes only what opens:

- the seal itself: a value tampered in one byte, moved under another key's name, sealed with
  another secret, or not sealed at all does not open;
- the key: derived from the job's control token (never the token), `spawn_local`'s own per
  launch, and a fault-tolerant rank with none refuses to start;
- a replacement's admission planted by a stranger who read its request is not believed;
- a real 4-rank gloo job trains while a stranger process writes its store (dead marks of the
  living, a leader claim, an arrival of the dead GPU, releases, a decision keeping every GPU,
  a request to join, and recovery alarms every 20 ms): no spurious recovery, one recovery
  when GPU 3 really dies (the launcher's sealed dead mark is believed), nobody admitted, and the
  model equals the single-process reference.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
import fault_cases as fc
import store_attacks
import trainer_cases as tc

from malleus.control.sealed import MAC_HEX, open_sealed, seal, store_key
from malleus.trainer.launch.distributed import store_sealer
from malleus.trainer.launch.spawn import spawn_local
from malleus.trainer.recovery.join import _pending, await_admission
from malleus.trainer.run.options import RunOptions
from malleus.trainer.run.reference import train_reference
from malleus.trainer.world.errors import LaunchError
from malleus.trainer.world.sealed import (
    STORE_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Sealer,
    job_store_key,
)
from malleus.trainer.world.world import World

KEY = store_key("the job's control token")


# ---- the seal --------------------------------------------------------------------------------
def test_a_sealed_value_opens_with_its_key_and_name_only() -> None:
    sealed = seal(KEY, "rec/dead/3", "killed")
    assert sealed.startswith(b"killed~") and len(sealed) == len("killed~") + MAC_HEX
    assert open_sealed(KEY, "rec/dead/3", sealed) == b"killed"
    assert open_sealed(KEY, "rec/dead/3", sealed.decode()) == b"killed"  # as text alike
    # every byte matters: the value's and the MAC's
    for i in range(len(sealed)):
        tampered = bytearray(sealed)
        tampered[i] ^= 0x01
        assert open_sealed(KEY, "rec/dead/3", bytes(tampered)) is None, i
    # moved under another key: another GPU, another epoch
    assert open_sealed(KEY, "rec/dead/2", sealed) is None
    decision = seal(KEY, "rec/3/decision", '{"members": [0]}')
    assert open_sealed(KEY, "rec/4/decision", decision) is None
    # the name and the value cannot trade bytes (the name's length is bound)
    assert open_sealed(KEY, "rec/dead/3k", seal(KEY, "rec/dead/3", "killed")) is None
    assert open_sealed(KEY, "rec/dead/", seal(KEY, "rec/dead/3", "3killed")) is None
    # another job's key, or no seal at all
    other = store_key("another job's token")
    assert open_sealed(other, "rec/dead/3", sealed) is None
    assert open_sealed(KEY, "rec/dead/3", b"killed") is None
    assert open_sealed(KEY, "rec/dead/3", b"") is None
    assert open_sealed(KEY, "rec/dead/3", b"killed~" + b"0" * MAC_HEX) is None


def test_the_key_is_derived_from_the_token_never_the_token() -> None:
    token = "the job's control token"
    assert token.encode() != KEY and len(KEY) == 32
    assert store_key(token) == store_key(token.encode()) == KEY
    with pytest.raises(ValueError):
        store_key("  ")


def test_a_forgery_reads_as_absent_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    store, sealer = dist.HashStore(), Sealer(KEY)
    sealer.put(store, "rec/1/decision", '{"members": [0, 1]}')
    assert sealer.get(store, "rec/1/decision") == '{"members": [0, 1]}'
    assert sealer.get(store, "rec/1/nothing") is None and sealer.forged == 0
    store.set("rec/1/decision", '{"members": [0]}')
    with caplog.at_level(logging.WARNING, logger="malleus.trainer.world.sealed"):
        for _ in range(3):
            assert sealer.get(store, "rec/1/decision") is None  # never raises, never believed
    assert sealer.forged == 3
    warned = [r for r in caplog.records if "did not seal" in r.getMessage()]
    assert len(warned) == 1 and "rec/1/decision" in warned[0].getMessage()


def test_a_planted_leader_claim_is_replaced_and_a_genuine_one_kept() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    store = dist.TCPStore("127.0.0.1", server.port, 1, False)
    sealer = Sealer(KEY)
    store.set("rec/1/leader", "3")  # planted before any survivor claimed
    assert sealer.claim(store, "rec/1/leader", "0") == "0"
    assert sealer.claim(store, "rec/1/leader", "2") == "0"  # the first genuine claim holds
    store.set("rec/2/leader", Sealer.fresh().seal("rec/2/leader", "3"))  # another key's seal
    assert sealer.claim(store, "rec/2/leader", "1") == "1"
    del server


def test_where_a_rank_gets_its_key(tmp_path: Path) -> None:
    token = tmp_path / "control-token"
    token.write_text("the job's control token\n")
    assert job_store_key({TOKEN_FILE_ENV: str(token)}) == KEY
    assert job_store_key({TOKEN_ENV: "the job's control token"}) == KEY
    assert job_store_key({STORE_KEY_ENV: "ab" * 32, TOKEN_FILE_ENV: str(token)}) == b"\xab" * 32
    assert job_store_key({}) is None
    assert job_store_key({TOKEN_FILE_ENV: str(tmp_path / "missing")}) is None
    with pytest.raises(ValueError, match="not hex"):
        job_store_key({STORE_KEY_ENV: "not hex"})
    with pytest.raises(ValueError, match="at least 16"):
        job_store_key({STORE_KEY_ENV: "abcd"})
    # a fault-tolerant rank with no key refuses to start, naming what to set
    with pytest.raises(LaunchError, match=f"{TOKEN_FILE_ENV}.*{STORE_KEY_ENV}"):
        store_sealer(2, {})
    assert store_sealer(2, {TOKEN_FILE_ENV: str(token)}).seal("k", "v") == seal(KEY, "k", "v")


# ---- admissions ------------------------------------------------------------------------------
def test_a_request_to_join_counts_only_when_sealed_by_the_job() -> None:
    store, sealer = dist.HashStore(), Sealer(KEY)
    n = store.add("join/3/n", 1)
    store.set(f"join/3/{n}", json.dumps({"at": 0, "nonce": "forged"}))
    assert _pending(store, sealer, 3, {}) is None  # nobody offers a seat to a stranger
    n = store.add("join/3/n", 1)
    sealer.put(store, f"join/3/{n}", json.dumps({"at": 0, "nonce": "real"}))
    assert _pending(store, sealer, 3, {}) == "real"
    assert _pending(store, sealer, 3, {3: "real"}) is None  # admitted already


def test_a_replacement_believes_no_admission_a_stranger_wrote() -> None:
    """The stranger reads the replacement's request (the store has no read protection either),
    learns its nonce and writes an admission naming a group of its choosing: the replacement
    does not form it; it waits for a sealed one and, none coming, gives up."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    store = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10))
    stranger = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10))
    world = World(4)
    world.seal_with(Sealer(KEY))
    wrote = threading.Event()

    def forge() -> None:
        stranger.wait(["join/1/1"])
        nonce = json.loads(stranger.get("join/1/1").split(b"~")[0])["nonce"]
        admission = {"epoch": 7, "members": [0, 1], "lead": 0, "step": 0, "plan": "{}"}
        admission |= {"out": {}, "timeout": 5, "admitted": {}}
        stranger.set(f"join/1/admit/{nonce}", json.dumps(admission))
        wrote.set()

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    with pytest.raises(LaunchError, match="did not admit it"):
        await_admission(world, store, 1, timeout_s=1.5)
    thread.join(5)
    assert wrote.is_set() and world.sealer.forged > 0
    assert world.current is None  # no membership installed, no group formed
    del server


# ---- a real job under attack -----------------------------------------------------------------
REPLICAS = tc.plan([(4, [([0, 1], (0, 4))]), (4, [([2, 3], (0, 4))])])  # two data-parallel copies


@pytest.mark.timeout(300)
def test_a_strangers_values_in_a_running_jobs_store_are_not_believed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    steps = 5
    job = fc.fault_job([(2, 3, "kill")], steps=steps)
    out = tmp_path / "out"
    out.mkdir()
    opts = RunOptions(float64=True, save_model=str(out / "model.pt"))
    codes = spawn_local(
        4, store_attacks.attacked, (job, REPLICAS, opts, str(out)), fault_tolerant=True
    )
    err = capfd.readouterr().err
    results = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")
    }

    assert (out / "planted").exists() and "did not seal" in err  # the forgeries were read
    assert codes == [0, 0, 0, -9]
    assert sorted(results) == [0, 1, 2]
    for r in results.values():
        assert r["members"] == [0, 1, 2] and r["step"] == steps  # GPU 3 never admitted again
        assert r["epoch"] == 1 and len(r["recoveries"]) == 1  # one real recovery, one epoch
        assert r["spurious"] == {}  # the planted alarms stopped nobody
    rec = results[0]["recoveries"][0]
    assert rec["failed"] == {"3": "killed"} and rec["mode"] == "replicas" and rec["step"] == 2
    assert 0 < rec["seconds"] < 30  # no wait for a planted leader or on a planted decision
    # the launcher's mark, sealed with the key spawn_local gave the ranks, is one they believe
    assert json.loads((out / "dead-mark.json").read_text()) == {"3": "killed"}
    torch.set_num_threads(1)
    reference = train_reference(fc.fault_job(steps=steps), until=steps, float64=True)
    assert tc.rel_diff(torch.load(out / "model.pt"), reference.full_state()) <= 1e-4
