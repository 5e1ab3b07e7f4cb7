"""Malleability end to end: switch a running job to new plans, migrating state in place.

Three spawned jobs (real gloo, no mocks):
- 8 ranks (2 nodes x 4, tp 2) train through a chain of four switches: exclude a rank while TP
  groups shrink and a pipeline gains a stage; re-admit it with three pipelines; one pipeline
  across both nodes; back to two pipelines laid out the other way round. Right after every
  switch the model gathered from its new holders equals the single-process reference, and so
  does the end result; each switch moved exactly the minimal bytes.
- 4 ranks under `malleus train` with tied embeddings and the HTTP control endpoint: a pinned
  `--switch`, a plan POSTed mid-run (202, then 409 and 400 for stale and invalid ones),
  /status and /metrics reporting the migration, `POST /stop` leaving a checkpoint that equals
  the reference at its step.
- 4 ranks where one rank dies inside a migration: the job fails fast naming the rank and the
  switch, and the last checkpoint still loads and is right.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.ports import free_port

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
sc = importlib.import_module("switch_cases")

from malleus.control import (  # noqa: E402
    ControlClient,
    ControlError,
    ControlStatus,
    PlanConflict,
)
from malleus.errors import BadInput  # noqa: E402
from malleus.job import ResolvedJob  # noqa: E402
from malleus.planner import Plan  # noqa: E402
from malleus.trainer import cli  # noqa: E402
from malleus.trainer.checkpoint.directory import CheckpointError, latest, load_pieces, read_manifest  # noqa: E402
from malleus.trainer.endpoint.metrics import parse_rates  # noqa: E402
from malleus.trainer.launch.spawn import spawn_local  # noqa: E402
from malleus.trainer.model.decoder import join_pieces, pieces  # noqa: E402
from malleus.trainer.parallel.migrate import minimal_bytes  # noqa: E402
from malleus.trainer.run.reference import train_reference  # noqa: E402

TOL = 1e-4
JOB = tc.small_job(training={"steps": 5})
CHAIN = [
    tc.plan([(6, [([0, 1], (0, 3)), ([2, 3], (3, 6))]), (6, [([4, 5], (0, 3)), ([6, 7], (3, 6))])]),
    tc.plan(  # rank 3 excluded; rank 2's group shrinks 2 -> 1; pipeline 1 gets 3 stages
        [
            (7, [([0, 1], (0, 2)), ([2], (2, 6))]),
            (5, [([4], (0, 3)), ([5, 6], (3, 5)), ([7], (5, 6))]),
        ],
        excluded=[3],
    ),
    tc.plan(  # rank 3 re-admitted; 3 pipelines of 1, 2 and 2 stages
        [
            (3, [([3, 2], (0, 6))]),
            (5, [([0], (0, 3)), ([1], (3, 6))]),
            (4, [([5, 4], (0, 4)), ([6, 7], (4, 6))]),
        ]
    ),
    tc.plan(  # one pipeline across both nodes; four ranks excluded
        [(12, [([1, 0], (0, 2)), ([6], (2, 4)), ([3], (4, 6))])], excluded=[2, 4, 5, 7]
    ),
    tc.plan(  # two pipelines again, the other way round
        [(6, [([4, 5], (0, 3)), ([6, 7], (3, 6))]), (6, [([0, 1], (0, 3)), ([2, 3], (3, 6))])]
    ),
]
SWITCHES = [(k, p.model_copy(update={"generation": k})) for k, p in enumerate(CHAIN) if k]


def reference(job: ResolvedJob, until: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return train_reference(job, until=until).full_state()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("chain")
    spawn_local(8, sc.run_chain, (JOB, CHAIN[0], SWITCHES, JOB.steps, str(out)))
    return torch.load(out / "chain.pt")


def test_model_equals_the_reference_after_every_switch(chain: dict[str, Any]) -> None:
    assert sorted(chain["models"]) == [1, 2, 3, 4, 5]  # after each switch, and at the end
    for step, full in chain["models"].items():
        assert tc.rel_diff(full, reference(JOB, step)) <= TOL, step
    losses = [r["loss"] for r in chain["reports"]]
    assert losses == pytest.approx(train_reference(JOB).losses, rel=1e-5)


def test_each_switch_moves_exactly_the_minimal_bytes(chain: dict[str, Any]) -> None:
    # Expected from the two plans and the real piece sizes (planner holdings -> pieces).
    assert [m["generation"] for m in chain["migrations"]] == [1, 2, 3, 4]
    for k, m in enumerate(chain["migrations"], start=1):
        expected = minimal_bytes(JOB.model, CHAIN[k - 1], CHAIN[k])
        assert m["step"] == k
        assert m["bytes"] == m["minimal_bytes"] == expected > 0
        assert 0 < m["seconds"] < 60


# ---- malleus train: --switch, POST /plan, /status, /metrics, POST /stop ----------------------
TOKEN = "switch-token"
TIED_A = sc.plan_dict((5, [([0, 1], 0, 2), ([2], 2, 4)]), (3, [([3], 0, 4)]))
TIED_B = sc.plan_dict((8, [([3, 2], 0, 3), ([1], 3, 4)]), excluded=[0])  # 0 hands over
TIED_C = sc.plan_dict((4, [([0], 0, 4)]), (4, [([2, 3], 0, 1), ([1], 1, 4)]))  # 0 re-admitted


def _until(
    client: ControlClient, ok: Callable[[ControlStatus], bool], limit: float = 120
) -> ControlStatus:
    """Poll /status until `ok` holds (the job is live and moves on by itself)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            status = client.status()
            if ok(status):
                return status
        except ControlError:
            pass  # not listening yet
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def _refusal(call: Callable[[], object]) -> Exception | None:
    """The exception a control call raised (None if it succeeded)."""
    try:
        call()
    except (BadInput, ControlError) as e:
        return e
    return None


def _operate(url: str, seen: dict[str, Any]) -> None:
    """The controller's side, in a thread while `malleus train` runs."""
    client = ControlClient(url, TOKEN, timeout=10)
    try:
        _until(client, lambda s: s.generation == 1)  # the pinned --switch
        c = Plan.model_validate(TIED_C | {"generation": 2})  # the next one: the only one taken
        seen["post"] = client.post_plan(c)
        seen["again"] = _refusal(lambda: client.post_plan(c))
        stale = Plan.model_validate(TIED_A | {"generation": 1})
        seen["stale"] = _refusal(lambda: client.post_plan(stale))
        gap = sc.plan_dict((8, [([0, 1], 0, 3)]), excluded=[2, 3]) | {"generation": 3}
        seen["invalid"] = _refusal(lambda: client.post_plan(Plan.model_validate(gap)))
        seen["status"] = _until(client, lambda s: s.generation == 2)
        seen["metrics"] = client.metrics_text()
        seen["anonymous"] = _refusal(lambda: ControlClient(url, None).stop())
        seen["stop"] = _refusal(client.stop)
    except Exception as e:  # surfaced by the test
        seen["error"] = repr(e)
        ControlClient(url, TOKEN).stop(checkpoint=False)


def test_live_switches_over_http_then_stop_with_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLEUS_CONTROL_TOKEN", TOKEN)
    emulation = {"enabled": True, "layerForwardMs": 4, "layerBackwardMs": 8}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(sc.manifest(2, 2, tied=True, steps=60, emulation=emulation)))
    for name, data in (("a", TIED_A), ("b", TIED_B)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    port, ckpt = free_port(), tmp_path / "ckpt"
    seen: dict[str, Any] = {}
    operator = threading.Thread(target=_operate, args=(f"http://127.0.0.1:{port}", seen))
    operator.start()
    args = [str(job), "--plan", str(tmp_path / "a.json"), "--switch", f"2:{tmp_path / 'b.json'}"]
    args += ["--control-port", str(port), "--checkpoint-dir", str(ckpt), "--quiet"]
    rc = cli.main(_parse(args))
    operator.join(timeout=30)
    assert rc == 0 and "error" not in seen, seen

    assert seen["post"] == 2
    assert isinstance(seen["again"], PlanConflict) and isinstance(seen["stale"], PlanConflict)
    assert isinstance(seen["invalid"], BadInput) and seen["invalid"].faults
    status = seen["status"]
    mig = status.last_migration
    resolved = ResolvedJob.load(str(job))
    b = Plan.model_validate(TIED_B)
    assert mig is not None and mig.generation == 2 and 2 < mig.step <= status.step
    assert mig.bytes == minimal_bytes(resolved.model, b, Plan(**TIED_C))
    assert status.pending_generation is None and status.generation == 2
    metrics = seen["metrics"]
    # Counters over the run: the pinned --switch (a -> b) and the posted plan (b -> c), each
    # moving exactly its minimal bytes.
    first = minimal_bytes(resolved.model, Plan(**TIED_A), b)
    assert _gauge(metrics, "malleus_migrated_bytes_total") == first + mig.bytes
    assert _gauge(metrics, "malleus_migration_duration_seconds_count") == 2
    assert _gauge(metrics, "malleus_migration_duration_seconds_sum") >= mig.seconds
    assert _gauge(metrics, "malleus_plan_generation") == 2
    assert set(parse_rates(metrics)) <= set(range(4))
    anonymous = seen["anonymous"]
    assert isinstance(anonymous, ControlError) and anonymous.code == 401  # writes need the token
    assert seen["stop"] is None  # accepted: stop at the next boundary, with a checkpoint

    # Stopped early, at a step boundary, with a checkpoint that equals the reference there.
    path = latest(ckpt)
    manifest = read_manifest(path)
    step = manifest["step"]
    assert mig.step <= step < 60 and manifest["plan_generation"] == 2
    loaded = load_pieces(path, [p.name for p in pieces(resolved.model, 2)], resolved)
    got = join_pieces(resolved.model, 2, loaded.params)
    assert tc.rel_diff(got, reference(resolved, step)) <= TOL
    assert {st.step for st in loaded.state.values()} == {step}  # Adam steps travelled too


def _gauge(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name}")


def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


# ---- a rank dies during a migration ---------------------------------------------------------
def test_a_rank_dying_in_a_migration_fails_the_job_fast_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(sc.manifest(1, 4, steps=4)))
    a = sc.plan_dict((4, [([0, 1], 0, 4)]), (4, [([2, 3], 0, 4)]))
    b = sc.plan_dict((8, [([1], 0, 2), ([2, 3], 2, 4)]), excluded=[0])
    for name, data in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("MALLEUS_FAULT", "migration:3")
    args = [str(job), "--plan", str(tmp_path / "a.json"), "--switch", f"2:{tmp_path / 'b.json'}"]
    args += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--quiet"]
    args.append("--no-resource-check")  # 4 ranks timed for real on a machine of fewer cores
    saved: list[float] = []  # when step 1's checkpoint appeared: one step before the fault
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not saved:
            try:
                if latest(ckpt) is not None:
                    saved.append(time.monotonic())
            except CheckpointError:
                pass  # caught between the first checkpoint's rename and `latest`'s: look again
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rc = cli.main(_parse(args))
    finally:
        done.set()
        watcher.join()
    failed_after = time.monotonic() - saved[0]
    err = capfd.readouterr().err
    assert rc == 1
    died = "rank 3 died (signal SIGKILL) during the switch to plan generation 1 at step 2"
    assert died in err, err[-3000:]
    # One step, the fault, the launcher's grace (5 s) and the others' exit; a hang would last
    # the migration timeout (300 s) or the collective timeout (1800 s).
    assert failed_after < 45

    # Step 2's checkpoint would have been written after the switch at its end: step 1's stays.
    path = latest(ckpt)
    assert path.name == "step-00000001" and not list(ckpt.glob(".*tmp"))
    resolved = ResolvedJob.load(str(job))
    loaded = load_pieces(path, [p.name for p in pieces(resolved.model, 2)], resolved)
    got = join_pieces(resolved.model, 2, loaded.params)
    assert tc.rel_diff(got, reference(resolved, 1)) <= TOL
