"""The two signals of a live rank, with real gloo processes (trainer/world/alarm.py,
trainer/world/progress.py): a rank stopped (SIGSTOP) is known dead by its heartbeat within
seconds, with no hang timeout to wait out and no launcher looking; a rank stuck in Python
while its process lives on declares itself hung within its measured bound and exits; and
work that is slow, not stuck (a straggler 8x slow, a data stall and a checkpoint write of
4 s, past the 3 s floor, a re-plan and the first step after it) is never taken for a hang.

Each test spawns one fault-tolerant 4-rank job (2 nodes x 2 GPUs, tp 2, two data-parallel
replicas, float64, emulated clock) and checks the final model against the single-process
reference for the same steps.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
fc = importlib.import_module("fault_cases")

from malleus.errors import LEFT_OUT_EXIT  # noqa: E402
from malleus.trainer.world.alarm import beat_s, dead_after_s  # noqa: E402
from malleus.trainer.world.progress import FLOOR_S  # noqa: E402

TOL = 1e-4
DETECT_MARGIN_S = 3.0
"""Beyond the window itself: the alarm's polls and a busy host's scheduling (2 shared cores)."""
EARLIEST_S = dead_after_s(4) - beat_s(4)
"""The soonest a stop can be declared after it: the silence is counted from the last beat the
watcher saw advance, which may have come up to one beat before the stop."""


def test_a_stopped_rank_is_known_dead_by_its_heartbeat_within_seconds(tmp_path: Path) -> None:
    # No hangTimeoutSeconds: the collectives' bound is 600 s at step 2; only the heartbeat
    # can tell within seconds (nobody marks the stopped process dead: it still exists).
    job = fc.fault_job([(2, 1, "hang")])
    codes, results, full, _ = fc.train_job(tmp_path, job, fc.REPLICAS)
    assert codes == [0, -9, 0, 0]  # the stopped process is killed once the job is done
    rec = fc.one_recovery(results, [0, 2, 3])
    assert rec["failed"] == {"1": "hung"} and rec["steps_lost"] == 0
    detected = rec["detected_after_s"]["1"]
    assert EARLIEST_S <= detected < dead_after_s(4) + DETECT_MARGIN_S, rec
    assert rec["seconds"] < 5.0, rec  # re-forming does not wait for the stopped rank's sockets
    assert tc.rel_diff(full, fc.reference(fc.STEPS)) <= TOL
    print(f"SIGSTOP: detected after {detected:.2f} s, recovered in {rec['seconds']:.2f} s")


def test_a_rank_stuck_in_python_declares_itself_hung_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU 1's training thread blocks for good after its first layer of step 2; its process
    # and its heartbeat live on. Steps 0 (measured, not judged) and 1 set its bound: the floor.
    monkeypatch.setenv("MALLEUS_FAULT", "stall:1:2")
    codes, results, full, _ = fc.train_job(tmp_path, fc.fault_job(), fc.REPLICAS)
    assert codes == [0, LEFT_OUT_EXIT, 0, 0], codes
    rec = fc.one_recovery(results, [0, 2, 3])
    assert rec["failed"] == {"1": "hung"} and rec["steps_lost"] == 0
    detected = rec["detected_after_s"]["1"]
    assert FLOOR_S <= detected < FLOOR_S + DETECT_MARGIN_S, rec
    assert tc.rel_diff(full, fc.reference(fc.STEPS)) <= TOL
    print(f"stuck in Python: detected after {detected:.2f} s, recovered in {rec['seconds']:.2f} s")


def test_slow_work_is_never_taken_for_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU 2 turns 8x slow from step 2 on; GPU 1's data source stalls 4 s in step 3; GPU 2
    # takes 4 s more to write the checkpoint of step 3; a re-plan (a switch: the TP ranks of
    # each group swap shards) takes force at step 4, and its first step runs on a new layout.
    steps = 6
    monkeypatch.setenv("MALLEUS_PAUSE", "data:1:3:4,checkpoint:2:3:4")
    switch = tc.plan([(4, [([1, 0], (0, 4))]), (4, [([3, 2], (0, 4))])])
    switch = switch.model_copy(update={"generation": 1})
    job = fc.fault_job(steps=steps, slow=[(2, 2, 8.0)])
    codes, results, full, seconds = fc.train_job(
        tmp_path,
        job,
        fc.REPLICAS,
        switches=((4, switch),),
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=3,
    )
    assert codes == [0, 0, 0, 0], codes
    assert sorted(results) == [0, 1, 2, 3]
    for r in results.values():
        assert r["recoveries"] == [] and r["epoch"] == 0 and r["step"] == steps, r
        assert r["plan"]["generation"] == 1
    assert tc.rel_diff(full, fc.reference(steps, steps)) <= TOL
    print(f"slow, not stuck: no recovery, run {seconds:.1f} s")


def test_a_rank_stopped_mid_migration_is_known_dead_in_seconds_not_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPU 3 stops (SIGSTOP) right after posting its transfers of the switch at step 2. Its
    # peers wait for those transfers and for the switch's barrier: 300 s (the migration
    # timeout) before the waits were watched; now its heartbeat's silence ends them, and the
    # recovery plan supersedes the switch.
    monkeypatch.setenv("MALLEUS_FAULT", "migration:3:hang")
    switch = tc.plan([(4, [([1, 0], (0, 4))]), (4, [([3, 2], (0, 4))])])
    switch = switch.model_copy(update={"generation": 1})
    codes, results, full, seconds = fc.train_job(
        tmp_path, fc.fault_job(), fc.REPLICAS, switches=((2, switch),)
    )
    assert codes == [0, 0, 0, -9], codes  # the stopped process is killed once the job is done
    rec = fc.one_recovery(results, [0, 1, 2])
    assert rec["failed"] == {"3": "hung"} and rec["steps_lost"] == 0 and rec["step"] == 2
    detected = rec["detected_after_s"]["3"]
    assert EARLIEST_S <= detected < dead_after_s(4) + DETECT_MARGIN_S, rec
    assert results[0]["last_failure"] == {"generation": 1, "reason": "superseded by recovery"}
    assert tc.rel_diff(full, fc.reference(fc.STEPS)) <= TOL
    print(f"stopped mid-migration: detected after {detected:.2f} s, run {seconds:.1f} s")
