"""The operator across a failure of node 0: the PodDisruptionBudget follows the nodes left in the
job, and a suspension asks the coordinator that moved (the lowest survivor), not node 0.

Against kmock (`tests/operator/kube.py`); the coordinator is a real control endpoint
(`malleus.trainer.endpoint.server.ControlServer`) on the loopback address of its pod's IP, and
in the last test the real trainers themselves: four gloo processes whose node 0 is killed,
the survivors' coordinator on node 1's address, stopped by the operator's suspension.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import kopf
import pytest

from malleus.job.status import MalleusJobStatus
from malleus.operator import admission, children, handlers, resources
from malleus.operator.context import MEMO_KEY, Context
from tests.operator.kube import Kube

control = pytest.importorskip("malleus.trainer.endpoint.server")
failures_cases = pytest.importorskip("tests.operator.test_failures_daemon")

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # fault_cases, trainer_cases


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _create(kube: Kube, memo: kopf.Memo, body: dict[str, Any]) -> None:
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    for i, ip in ((0, "127.0.0.1"), (1, "127.0.0.2")):
        kube.set_pod_phase("ml", f"demo-node-{i}", "Running", podIP=ip)
        pod = kube.get("Pod", "ml", f"demo-node-{i}")
        assert pod is not None
        pod["metadata"]["uid"] = f"pod-{i}"
        kube.put("Pod", pod)
    run(handlers.sync_pods(Context.of(memo), "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"


def _fail(kube: Kube, memo: kopf.Memo, node: int) -> None:
    term = {"exitCode": 137, "reason": "Error"}
    kube.set_pod_phase(
        "ml",
        f"demo-node-{node}",
        "Failed",
        containerStatuses=[{"name": "trainer", "state": {"terminated": term}}],
    )
    body = kube.get("Pod", "ml", f"demo-node-{node}")
    assert body is not None
    event = {"type": "MODIFIED"}
    labels = body["metadata"]["labels"]
    run(handlers.on_pod_event(event=event, body=body, namespace="ml", labels=labels, memo=memo))


def _min_available(kube: Kube) -> Any:
    budget = kube.get("PodDisruptionBudget", "ml", resources.disruption_budget_name("demo"))
    assert budget is not None
    return budget["spec"]["minAvailable"]


def test_a_node_out_for_good_lowers_the_disruption_budget(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _create(kube, memo, make_job(failurePolicy={"maxRestarts": 0}))
    assert _min_available(kube) == 2
    _fail(kube, memo, 0)  # maxRestarts 0: node 0 stays out, its pod is never coming back
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Running" and st["failures"][0]["state"] == "Out"
    assert _min_available(kube) == 1  # a drain may go on once node 1 is evictable again
    # Idempotent, and a restarted operator (the budget reset behind its back) catches up.
    budget = kube.get("PodDisruptionBudget", "ml", resources.disruption_budget_name("demo"))
    assert budget is not None
    budget["spec"]["minAvailable"] = 2
    kube.put("PodDisruptionBudget", budget)
    run(handlers.sync_pods(Context.of(memo), "ml", "demo"))
    assert _min_available(kube) == 1
    records = MalleusJobStatus.model_validate(st).failures or []
    assert not run(children.follow_out(Context.of(memo), _ref(kube), 2, records))


def test_a_node_waiting_for_its_replacement_keeps_the_budget(
    kube: Kube, memo: kopf.Memo, make_job: Any
) -> None:
    _create(kube, memo, make_job(failurePolicy={"maxRestarts": 2}))
    _fail(kube, memo, 1)
    assert kube.job("ml", "demo")["status"]["failures"][0]["state"] == "Waiting"
    assert _min_available(kube) == 2  # it comes back: a drain waits for it, as before


def _ref(kube: Kube) -> resources.JobRef:
    return resources.JobRef.from_body(kube.job("ml", "demo"))


def test_suspending_after_rank_0_died_asks_the_coordinator_that_moved(
    kube: Kube, ctx: Context, make_job: Any
) -> None:
    base = failures_cases._port_free_on_both()
    ctx = Context(
        ctx.cluster, ctx.settings.with_(endpoint_template="http://{pod_ip}:{port}"), ctx.metrics
    )
    memo = kopf.Memo({MEMO_KEY: ctx})
    _create(kube, memo, make_job(controlPort=base, checkpoint={"intervalSteps": 10}))
    _fail(kube, memo, 0)  # node 0 is replaced later; meanwhile node 1's rank 0 coordinates
    token = run(
        ctx.cluster.read_secret_value("ml", resources.secret_name("demo"), resources.TOKEN_KEY)
    )
    asked: list[dict[str, Any]] = []

    def stop(req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        asked.append(req)
        return 202, {"stopping": True}

    trainers = failures_cases.Trainers(8, failures_cases._plan(2, [0, 1, 2, 3]))
    server = control.ControlServer(
        "127.0.0.2",
        base,  # node 1, local rank 0: the lowest survivor's endpoint
        token,
        status=trainers.status,
        inbox=None,
        metrics=None,
        inject=None,
        stop=stop,
    ).start()
    try:
        job = kube.job("ml", "demo")
        job["spec"]["suspend"] = True
        job["metadata"]["generation"] += 1
        kube.put("MalleusJob", job)
        assert run(admission.reconcile(ctx, kube.job("ml", "demo"), T0)) == "suspend"
    finally:
        server.stop()
    assert len(asked) == 1 and asked[0].get("checkpoint") is True, asked
    # Asked, so node 1's pod is left to checkpoint and exit (not deleted at once).
    assert kube.get("Pod", "ml", "demo-node-1") is not None


def test_suspending_a_job_whose_node_0_died_stops_the_real_trainers(
    kube: Kube, ctx: Context, make_job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same suspension with real trainer processes (gloo, the launcher's store): node 0's
    two ranks are SIGKILLed mid-step 2, the survivors on node 1 recover and GPU 2 takes the
    coordinator's office and endpoint (127.0.0.2, node 1's pod IP); the operator's
    `reconcile` finds it there, asks it to stop with a checkpoint, and the trainers stop at
    the next step boundary, the model the single-process reference's for the steps done."""
    import json
    import threading

    from malleus.trainer.launch.spawn import spawn_local
    from malleus.trainer.run.options import RunOptions
    from malleus.trainer.run.reference import train_reference

    fc = importlib.import_module("fault_cases")
    tc = importlib.import_module("trainer_cases")
    base = failures_cases._port_free_on_both()
    ctx = Context(
        ctx.cluster, ctx.settings.with_(endpoint_template="http://{pod_ip}:{port}"), ctx.metrics
    )
    memo = kopf.Memo({MEMO_KEY: ctx})
    _create(
        kube, memo, make_job(controlPort=base, gpusPerNode=2, checkpoint={"intervalSteps": 1000})
    )
    token = run(
        ctx.cluster.read_secret_value("ml", resources.secret_name("demo"), resources.TOKEN_KEY)
    )
    monkeypatch.setenv("MALLEUS_CONTROL_TOKEN", token)  # the trainers' endpoints want the job's

    steps = 400  # far more than run before the stop: the stop is what ends the job
    job = fc.fault_job([(2, 0, "kill"), (2, 1, "kill")], steps=steps, layer_ms=4)
    replicas = tc.plan([(4, [([0, 1], (0, 4))]), (4, [([2, 3], (0, 4))])])
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    opts = RunOptions(
        float64=True, save_model=str(out / "model.pt"), checkpoint_dir=str(ckpt),
        checkpoint_every=1000,
    )  # fmt: skip
    ports = [base, base + 1, base, base + 1]
    hosts = ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]
    codes: list[Any] = []
    body = (job, replicas, opts, str(out), ports, None, hosts)
    launcher = threading.Thread(
        target=lambda: codes.extend(spawn_local(4, fc.run, body, fault_tolerant=True))
    )
    launcher.start()
    try:
        _fail(kube, memo, 0)  # node 0's pod failed with its ranks
        deadline = time.monotonic() + 240
        while not _recovered_at(f"http://127.0.0.2:{base}", token):
            assert launcher.is_alive() and time.monotonic() < deadline, codes
            time.sleep(0.2)
        job_body = kube.job("ml", "demo")
        job_body["spec"]["suspend"] = True
        job_body["metadata"]["generation"] += 1
        kube.put("MalleusJob", job_body)
        assert run(admission.reconcile(ctx, kube.job("ml", "demo"), T0)) == "suspend"
        launcher.join(timeout=240)
        assert not launcher.is_alive()
    finally:
        launcher.join(timeout=1)
    assert codes == [-9, -9, 0, 0], codes
    results = {g: json.loads((out / f"rank-{g}.json").read_text()) for g in (2, 3)}
    done = results[2]["step"]
    assert results[3]["step"] == done and done < steps  # stopped, not finished
    assert results[2]["served"]["/status"]["out"] == {"0": "killed", "1": "killed"}
    assert (ckpt / f"step-{done:08d}").is_dir()  # the checkpoint the stop asked for
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    want = train_reference(fc.fault_job(steps=steps), until=done, float64=True).full_state()
    assert tc.rel_diff(torch.load(out / "model.pt"), want) <= 1e-4


def _recovered_at(url: str, token: str) -> bool:
    """Whether the endpoint at `url` answers and reports a completed recovery."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read()).get("last_recovery") is not None
    except (urllib.error.URLError, OSError, ValueError):
        return False
