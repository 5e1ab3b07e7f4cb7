"""The pure parts of failure handling: membership translation, the boundary's join word,
fault arming, and which survivors hold what (trainer/world/membership.py, world.py, recovery/,
faults.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
fc = importlib.import_module("fault_cases")

from malleus.trainer.recovery.protocol import PeerFailure, as_failure  # noqa: E402
from malleus.trainer.recovery.restore import survivor_holders  # noqa: E402
from malleus.trainer.switching.protocol import Boundary  # noqa: E402
from malleus.trainer.world import world as world_module  # noqa: E402
from malleus.trainer.world.errors import LaunchError  # noqa: E402
from malleus.trainer.world.faults import Faults  # noqa: E402
from malleus.trainer.world.membership import Membership  # noqa: E402
from malleus.trainer.world.world import DEFAULT_HANG_TIMEOUT_S, World  # noqa: E402

REPLICAS = tc.plan([(4, [([0, 1], (0, 4))]), (4, [([2, 3], (0, 4))])])
ONE_PIPELINE = tc.plan([(8, [([0, 1], (0, 2)), ([2, 3], (2, 4))])])


def test_membership_translates_gpu_ids_to_process_group_ranks() -> None:
    m = Membership(2, (0, 2, 3, 5))
    assert [m.pg(g) for g in m.members] == [0, 1, 2, 3] and m.gpu(2) == 3
    assert m.coordinator == 0 and 5 in m and 1 not in m
    with pytest.raises(KeyError, match="GPU 1 is not in the job"):
        m.pg(1)
    with pytest.raises(ValueError):
        Membership(1, (3, 1))


def test_the_coordinator_stays_while_alive_and_moves_to_the_lowest_survivor() -> None:
    assert Membership(3, (0, 1, 2, 3), lead=1).coordinator == 1  # GPU 0 rejoined: 1 stays
    assert Membership(4, (0, 2, 3), lead=1).coordinator == 0  # 1 failed: the lowest


def test_pg_is_the_identity_before_any_membership() -> None:
    world = World(8)
    assert world.pg(7) == 7 and world.coordinator() == 0
    assert world.store is None and world.current is None
    assert world.collective_timeout_s == DEFAULT_HANG_TIMEOUT_S
    world.check_alarm()  # no alarm: nothing to raise
    world.install(Membership(1, (0, 3, 7), lead=3))
    assert world.pg(7) == 2 and world.coordinator() == 3 and world.store is None


def test_worlds_are_independent() -> None:
    """Two Worlds in one process share nothing (no module state behind them)."""
    a, b = World(2), World(2)
    a.install(Membership(1, (1,)), rendezvous=object())
    a.set_collective_timeout(12.0)
    assert a.coordinator() == 1 and a.store is not None and a.collective_timeout_s == 12.0
    assert b.coordinator() == 0 and b.store is None
    assert b.collective_timeout_s == DEFAULT_HANG_TIMEOUT_S


def test_boundary_words_carry_joins() -> None:
    b = Boundary(plan_bytes=10, stop=1, joins=2)
    assert Boundary.decode(b.words()) == b and len(b.words()) == 3
    assert Boundary.decode([5.0, 0.0]) == Boundary(5, 0, 0)  # two words: no joins


def test_faults_arm_at_their_step_only() -> None:
    faults = Faults([(2, 3, "kill"), (4, 1, "hang")], rank=3)
    assert faults.due == {2: "kill"}
    faults.arm(1)
    assert faults.armed is None
    faults.arm(2)
    assert faults.armed == "kill"
    faults.after("backward")  # only a forward fires it
    assert faults.armed == "kill"
    clock = object()
    assert Faults([], rank=0).clock(clock) is clock  # nothing scheduled: the clock as it is


def test_failures_are_peer_failures_only_with_a_store() -> None:
    world = World(2)
    e = RuntimeError("Connection closed by peer")
    assert as_failure(e, "step 1", world) is e  # no store: fatal, as before
    world.install(Membership.full(2), rendezvous=object())
    f = as_failure(RuntimeError("Timed out waiting 8000ms for recv"), "step 1", world)
    assert isinstance(f, PeerFailure) and f.timeout and "during step 1" in str(f)


def test_surviving_holders() -> None:
    job = fc.fault_job()
    have = survivor_holders(job, {g: REPLICAS for g in (0, 1, 2)})  # GPU 3 died
    assert all(have.values())  # every piece has a replica
    assert any(h == (1,) for h in have.values())  # shard 1: 3 held it with 1, now 1 alone
    lost = survivor_holders(job, {g: ONE_PIPELINE for g in (2, 3)})  # 0 and 1 died
    assert not all(lost.values())  # layers 0-1 and the embedding are gone: roll back


def test_malleus_store_makes_a_rank_a_client_of_an_external_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from malleus.trainer.launch.distributed import DistEnv, fault_tolerant, init_distributed

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # no rank hosts it
    monkeypatch.setenv("MALLEUS_STORE", f"127.0.0.1:{store.port}")
    monkeypatch.delenv("MALLEUS_EXTERNAL_STORE", raising=False)
    for name in ("MALLEUS_STORE_KEY", "MALLEUS_CONTROL_TOKEN_FILE", "MALLEUS_CONTROL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    world = World(1)
    # Without the job's secret a fault-tolerant rank would believe whatever the store says:
    # it refuses to start (trainer/world/sealed.py)
    with pytest.raises(LaunchError, match="needs the job's secret"):
        init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 1), world, init_timeout_s=10)
    monkeypatch.setenv("MALLEUS_STORE_KEY", "5e" * 32)
    try:
        # MASTER_PORT points nowhere: the rank meets at MALLEUS_STORE, as rank 0 too
        init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 1), world, init_timeout_s=10)
        assert fault_tolerant() and world.store is not None
        assert world.sealer.seal("k", "v").startswith(b"v~")
        assert world.current == Membership.full(1)
        assert dist.PrefixStore("malleus/0/", store).check(["joined/0"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(("code", "reason"), [(4, "NoValidPlan"), (3, "LeftOut"), (2, "BadInput")])
def test_how_a_rank_ended_reaches_the_operator_through_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, reason: str
) -> None:
    """A trainer that finds no plan for the survivors exits NO_PLAN_EXIT (4), one left out of
    the job LEFT_OUT_EXIT (3); torchrun, in a pod, exits 1 whatever its ranks' codes, so each
    also writes how it ended as the container's termination message, which the operator reads
    (`NoValidPlan` ends the job; `LeftOut` is not a failure). `malleus run` reads the rank's
    own code (tests/runner/test_faults.py)."""
    from malleus.errors import ENDING_REASONS
    from malleus.operator import failures
    from malleus.trainer.world import errors

    assert ENDING_REASONS[code] == reason
    log = tmp_path / "termination-log"  # the kubelet makes it in every container
    log.write_text("")
    monkeypatch.setattr(errors, "TERMINATION_LOG", log)
    errors.say_ending(code, "rank 3: what happened")
    assert log.read_text() == f"{reason}: rank 3: what happened"
    term = {"exitCode": 1, "reason": "Error", "message": log.read_text()}
    pod = {
        "metadata": {"name": "demo-node-0", "uid": "u0"},
        "status": {"containerStatuses": [{"name": "trainer", "state": {"terminated": term}}]},
    }
    seen = failures.pod_failure(pod, "demo")
    assert seen is not None and seen.reason == reason, seen
    assert seen.message.endswith(f"({reason}): rank 3: what happened"), seen.message
    # outside a pod (no file), nothing is written anywhere
    monkeypatch.setattr(errors, "TERMINATION_LOG", tmp_path / "absent")
    errors.say_ending(code, "x")
    assert not (tmp_path / "absent").exists()


def test_inside_a_step_collectives_time_out_at_the_steps_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`step_deadline`: a collective entered late in a step gets what is left of the hang
    timeout (at least `STEP_FLOOR` of it), so every survivor blocked on a hung rank times out
    at one moment; outside a step the group has the plain bound back. A real gloo group; the
    clock is the test's."""
    import torch
    import torch.distributed as dist

    now = [100.0]
    monkeypatch.setattr(world_module.time, "monotonic", lambda: now[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    world = World(1)
    try:
        world.install(Membership.full(1), rendezvous=dist.HashStore())
        world.set_collective_timeout(10.0)

        def timeout() -> float:
            return backend.options._timeout.total_seconds()

        with world.step_deadline():
            world.bound()
            assert timeout() == pytest.approx(10.0)
            now[0] += 3.0  # three seconds of compute, then the gradient sync
            world.bound()
            assert timeout() == pytest.approx(7.0)
            now[0] += 0.01  # close enough: not set again (it costs a call per collective)
            world.bound()
            assert timeout() == pytest.approx(7.0)
            now[0] += 20.0  # a slow step: never less than half the hang timeout
            world.bound()
            assert timeout() == pytest.approx(5.0)
        assert timeout() == pytest.approx(10.0)
        world.bound()  # outside a step: nothing changes
        assert timeout() == pytest.approx(10.0)
        assert not world._bounds  # no group is held past the step (their sockets)
    finally:
        dist.destroy_process_group()
