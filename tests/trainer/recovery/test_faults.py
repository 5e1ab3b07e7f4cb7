"""Failures without restarts: real gloo processes are killed (SIGKILL) or stopped (SIGSTOP)
and the survivors detect it, re-form the job among themselves and go on (trainer/recovery/protocol.py).

Each test spawns one fault-tolerant 4-rank job (2 nodes x 2 GPUs, tp 2, a 4-layer model in
float64, emulated clock) whose store is the launcher's, injects one failure and checks that the
final model equals the single-process reference trained for the same committed steps, how
fast the failure was noticed and what the coordinator reports (`ControlStatus.out`,
`last_recovery`).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_ports

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
fc = importlib.import_module("fault_cases")

from malleus.trainer.checkpoint.directory import latest, read_manifest  # noqa: E402

TOL = 1e-4
STEPS = 5
DETECT_S = 10.0  # a death is noticed by every survivor within this
REPLICAS = fc.REPLICAS  # two data-parallel copies
ONE_PIPELINE = tc.plan([(8, [([0, 1], (0, 2)), ([2, 3], (2, 4))])])  # every shard held once


reference = fc.reference
_train = fc.train_job
_one_recovery = fc.one_recovery


def test_a_rank_killed_mid_step_is_survived_from_replicas(tmp_path: Path) -> None:
    job = fc.fault_job([(2, 3, "kill")])
    codes, results, full, seconds = _train(tmp_path, job, REPLICAS)
    assert codes == [0, 0, 0, -9]
    rec = _one_recovery(results, [0, 1, 2])
    assert rec["failed"] == {"3": "killed"} and rec["mode"] == "replicas"
    assert rec["steps_lost"] == 0 and rec["step"] == 2 and rec["bytes_restored"] > 0
    assert rec["detected_after_s"]["3"] < DETECT_S
    assert 0 < rec["seconds"] < 30
    coord = results[0]
    assert coord["out"] == {"3": "killed"} and coord["last_recovery"]["epoch"] == 1
    assert 3 not in {g for p in coord["plan"]["pipelines"] for s in p["stages"] for g in s["ranks"]}
    assert tc.rel_diff(full, reference(STEPS)) <= TOL
    _counted_as_on_paper(results)
    print(f"kill mid-step: {rec}, run {seconds:.1f}s")


def _counted_as_on_paper(results: dict[int, dict[str, Any]]) -> None:
    """Each survivor's store calls of the recovery (trainer/recovery/tally.py) are those the
    protocol says (docs/reference/trainer.md, "Recovery cost"): its own posts once each, every
    arrival read once by the leader alone, the plan posted once (a second survivor may race
    the first), arrivals of constant size."""
    costs = {g: r["recoveries"][0]["store"] for g, r in results.items()}
    (leader,) = [g for g, c in costs.items() if c["led"]]
    own = ("set rec/#/alive/#", "set rec/#/arrival/#", "set rec/#/arrive")
    own += ("set rec/#/released/#", "compare_set rec/#/leader")
    for g, c in costs.items():
        keys = c["keys"]
        assert all(keys.get(k) == 1 for k in own), (g, keys)
        # its place in the order of arrivals; the leader also reads the count once per poll
        assert keys["add rec/#/arrivals"] == 1 if g != leader else keys["add rec/#/arrivals"] >= 2
        assert keys.get("check rec/#/plan/#") == 1 + (g == leader), keys  # the leader reads it
        assert keys.get("get rec/#/alive/#", 0) == (len(costs) if g == leader else 0), keys
        assert keys.get("set rec/#/decision", 0) == (g == leader), keys
        assert keys.get("get rec/#/decision", 0) == 1 and c["epochs"] == 1, keys
    plans = sum(c["keys"].get("set rec/#/plan/#", 0) for c in costs.values())
    assert 1 <= plans < len(costs), plans  # posted once, twice at most when two raced


def test_the_leader_killed_before_deciding_the_others_go_on_at_the_next_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU 3 dies mid-step; the survivor that takes the lead of that recovery (epoch 1, whichever
    # wins the race) dies too before it decides. The launcher marks it dead, so the other two
    # go to epoch 2 at once instead of waiting out DECISION_WAIT_S, and recover without both.
    from malleus.trainer.recovery.protocol import DECISION_WAIT_S

    monkeypatch.setenv("MALLEUS_FAULT", "lead:*:1")
    job = fc.fault_job([(2, 3, "kill")])
    codes, results, full, seconds = _train(tmp_path, job, REPLICAS)
    assert codes[3] == -9 and codes[:3].count(-9) == 1 and codes[:3].count(0) == 2, codes
    leader = codes.index(-9)
    survivors = [g for g in range(4) if codes[g] == 0]
    rec = _one_recovery(results, survivors)
    assert rec["failed"] == {str(leader): "killed", "3": "killed"}
    assert all(r["epoch"] == 2 for r in results.values())  # epoch 1 had no decision
    assert rec["seconds"] < DECISION_WAIT_S, rec  # not the decision's timeout
    coord = results[survivors[0]]
    assert coord["out"] == {str(leader): "killed", "3": "killed"}
    # Either replicas or (GPUs 1 and 3: shard 1 has no holder left) the seeded initial state:
    # the model is the reference's for the same committed steps either way.
    assert rec["mode"] == ("checkpoint" if leader == 1 else "replicas"), rec
    assert tc.rel_diff(full, reference(STEPS)) <= TOL
    print(f"leader {leader} killed: {rec}, run {seconds:.1f}s")


def test_rank_0_killed_the_coordinator_and_its_endpoint_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLEUS_CONTROL_TOKEN", "fault-token")  # the ranks' endpoints want one
    job = fc.fault_job([(2, 0, "kill")])
    ports = free_ports(4)
    codes, results, full, _ = _train(tmp_path, job, REPLICAS, ports=ports)
    assert codes == [-9, 0, 0, 0]
    rec = _one_recovery(results, [1, 2, 3])
    assert rec["failed"] == {"0": "killed"} and rec["steps_lost"] == 0
    assert rec["detected_after_s"]["0"] < DETECT_S
    served = results[1]["served"]  # GPU 1's own endpoint, on its own port
    assert served is not None and all(results[g]["served"] is None for g in (2, 3))
    status = served["/status"]
    assert status["out"] == {"0": "killed"} and status["step"] == STEPS and status["done"]
    assert status["last_recovery"]["generation"] == status["generation"] == rec["generation"]
    assert served["/plan"]["generation"] == rec["generation"]
    assert tc.rel_diff(full, reference(STEPS)) <= TOL


def test_two_ranks_of_the_only_pipeline_killed_roll_back_to_the_checkpoint(
    tmp_path: Path,
) -> None:
    job = fc.fault_job([(3, 0, "kill"), (3, 1, "kill")])
    ckpt = tmp_path / "ckpt"
    codes, results, full, _ = _train(
        tmp_path, job, ONE_PIPELINE, checkpoint_dir=str(ckpt), checkpoint_every=2
    )
    assert codes[:2] == [-9, -9] and codes[2:] == [0, 0]
    rec = _one_recovery(results, [2, 3])
    assert rec["failed"] == {"0": "killed", "1": "killed"}
    assert rec["mode"] == "checkpoint" and rec["steps_lost"] == 1 and rec["step"] == 2
    assert tc.rel_diff(full, reference(STEPS)) <= TOL  # the lost step was trained again
    assert read_manifest(latest(ckpt))["step"] == STEPS


def test_a_rank_killed_mid_migration_the_recovery_plan_supersedes_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLEUS_FAULT", "migration:3")
    switch = tc.plan([(4, [([1, 0], (0, 4))]), (4, [([3, 2], (0, 4))])])
    switch = switch.model_copy(update={"generation": 1})
    job = fc.fault_job()
    codes, results, full, _ = _train(tmp_path, job, REPLICAS, switches=((2, switch),))
    assert codes == [0, 0, 0, -9]
    rec = _one_recovery(results, [0, 1, 2])
    assert rec["steps_lost"] == 0 and rec["step"] == 2 and rec["generation"] == 2
    failure = results[0]["served"]  # no endpoint here: the coordinator's inbox, below
    assert failure is None
    assert results[0]["last_failure"] == {"generation": 1, "reason": "superseded by recovery"}
    assert tc.rel_diff(full, reference(STEPS)) <= TOL


def test_a_rank_killed_during_a_checkpoint_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLEUS_FAULT", "checkpoint:2:2")
    ckpt = tmp_path / "ckpt"
    codes, results, full, _ = _train(
        tmp_path, fc.fault_job(), REPLICAS, checkpoint_dir=str(ckpt), checkpoint_every=2
    )
    assert codes == [0, 0, -9, 0]
    rec = _one_recovery(results, [0, 1, 3])
    assert rec["steps_lost"] == 0 and rec["mode"] == "replicas"
    assert tc.rel_diff(full, reference(STEPS)) <= TOL
    steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000002", "step-00000004", "step-00000005"]  # step 2 written again
    assert read_manifest(ckpt / "step-00000002")["step"] == 2


def test_a_replacement_joins_and_a_plan_re_admits_it(tmp_path: Path, capfd) -> None:
    steps = 10
    # A checkpoint every step: the replacement is admitted at a boundary whose checkpoint the
    # members then write, and it must write it with them (else their checkpoint and its
    # first step would wait on each other until the hang timeout: a spurious recovery).
    job = fc.fault_job([(1, 3, "kill")], steps=steps, layer_ms=10, hang_timeout=20)
    readmit = REPLICAS.model_copy(update={"generation": 2})  # 1: the recovery's plan
    ckpt = tmp_path / "ckpt"
    codes, results, full, _ = _train(
        tmp_path,
        job,
        REPLICAS,
        replace=3,
        switches=((8, readmit),),
        checkpoint_dir=str(ckpt),
        checkpoint_every=1,
    )
    assert codes[3] == -9 and codes[:3] == [0, 0, 0] and codes[4] == 0  # 4: GPU 3 again
    joined = [line for line in capfd.readouterr().out.splitlines() if "joined at step" in line]
    assert len(joined) == 1 and joined[0].startswith("[malleus] rank 3 joined at step ")
    at = int(joined[0].split()[-1])
    assert 2 <= at < 8
    assert sorted(results) == [0, 1, 2, 3]
    for r in results.values():
        assert r["members"] == [0, 1, 2, 3] and r["step"] == steps
        assert r["plan"]["generation"] == 2  # the re-admitting plan, GPU 3 holding its shards
        assert r["spurious"] == {}, r["spurious"]  # no step redone with every rank alive
    assert read_manifest(latest(ckpt))["step"] == steps
    assert results[0]["out"] == {} and results[0]["last_recovery"]["failed"] == {"3": "killed"}
    assert tc.rel_diff(full, reference(steps, steps)) <= TOL


def test_a_third_rank_killed_during_the_rollbacks_checkpoint_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPUs 0 and 1 (the only pipeline's first stage) die mid-step: the survivors roll back to
    # the checkpoint (epoch 1). GPU 2 dies in that rollback, as its peer agrees on the
    # checkpoint to read: GPU 3 goes on alone at the next epoch, from the same checkpoint.
    monkeypatch.setenv("MALLEUS_FAULT", "rollback:2:1")
    job = fc.fault_job([(3, 0, "kill"), (3, 1, "kill")])
    ckpt = tmp_path / "ckpt"
    codes, results, full, _ = _train(
        tmp_path, job, ONE_PIPELINE, checkpoint_dir=str(ckpt), checkpoint_every=2
    )
    assert codes == [-9, -9, -9, 0], codes
    r = results[3]
    assert r["members"] == [3] and r["step"] == STEPS and r["epoch"] >= 2
    rec = r["recoveries"][-1]
    assert set(rec["failed"]) >= {"2"} and rec["mode"] == "checkpoint", r["recoveries"]
    assert r["out"] == {"0": "killed", "1": "killed", "2": "killed"}
    assert tc.rel_diff(full, reference(STEPS)) <= TOL  # the lost steps trained again
    assert read_manifest(latest(ckpt))["step"] == STEPS


def test_a_second_rank_killed_while_a_replacement_is_admitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    # GPU 3 dies at step 1; its replacement asks to join; at the step boundary that admits it,
    # GPU 2 dies as the new group forms (`admit:2`, after it let go of the old group). The
    # members' group cannot form: they recover without GPU 2 (and without GPU 3, whose
    # admission did not happen), then admit the same request again at a later boundary.
    from malleus.trainer.recovery.join import AWAIT_JOIN_ENV

    monkeypatch.setenv("MALLEUS_FAULT", "admit:2")
    monkeypatch.setenv(AWAIT_JOIN_ENV, "3")  # the coordinator waits for the request: no race
    steps = 12
    job = fc.fault_job([(1, 3, "kill")], steps=steps, layer_ms=10, hang_timeout=30)
    codes, results, full, seconds = _train(tmp_path, job, REPLICAS, replace=3)
    assert codes[2:4] == [-9, -9] and codes[:2] == [0, 0] and codes[4] == 0, codes
    joined = [line for line in capfd.readouterr().out.splitlines() if "joined at step" in line]
    assert len(joined) == 1 and joined[0].startswith("[malleus] rank 3 joined at step "), joined
    at = int(joined[0].split()[-1])
    assert sorted(results) == [0, 1, 3]
    for r in results.values():
        assert r["members"] == [0, 1, 3] and r["step"] == steps
    first, second = results[0]["recoveries"]
    assert first["failed"] == {"3": "killed"} and second["failed"] == {"2": "killed"}
    assert first["steps_lost"] == second["steps_lost"] == 0
    assert second["step"] <= at  # admitted after the recovery from the second failure
    assert results[0]["out"] == {"2": "killed"}  # GPU 3 is back in the job, GPU 2 is not
    assert tc.rel_diff(full, reference(steps, steps)) <= TOL
    print(f"second failure during an admission: joined at {at}, run {seconds:.1f}s")
