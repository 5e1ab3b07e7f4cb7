"""The operator judges ``spec.podTemplate`` by its pod template policy before it creates any
pod: a job admitted before the chart's ValidatingAdmissionPolicy existed (or with its binding
removed) asks for a hostPath, the operator's own ServiceAccount or ``LD_PRELOAD``, and gets no
pod; ``Ready=False/PolicyViolation`` names the fields, and one Warning event says so per
occurrence. Against kmock (`tests/operator/kube.py`), the handlers called as kopf calls them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from typing import Any

import kopf
import pytest

from malleus.operator import admission, children, handlers
from malleus.operator.context import MEMO_KEY, Context
from tests.operator.kube import Kube

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
OPERATOR_SA = "malleus-operator"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _with(ctx: Context, **settings: Any) -> tuple[Context, kopf.Memo]:
    ctx = dataclasses.replace(ctx, settings=ctx.settings.with_(**settings))
    return ctx, kopf.Memo({MEMO_KEY: ctx})


def _trainer_env(*env: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "trainer", "env": list(env)}]}}


ATTACKS = {
    "hostpath": (
        {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
        "spec.podTemplate.spec.volumes[0].hostPath",
    ),
    "operator-sa": (
        {"spec": {"serviceAccountName": OPERATOR_SA}},
        "spec.podTemplate.spec.serviceAccountName",
    ),
    "ld-preload": (
        _trainer_env({"name": "LD_PRELOAD", "value": "/data/x.so"}),
        "spec.podTemplate.spec.containers[0].env[0].name",
    ),
    "projected-token": (
        {
            "spec": {
                "volumes": [
                    {
                        "name": "t",
                        "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]},
                    }
                ]
            }
        },
        "spec.podTemplate.spec.volumes[0].projected.sources[0].serviceAccountToken",
    ),
    "secret-env": (
        _trainer_env({"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}),
        "spec.podTemplate.spec.containers[0].env[0].valueFrom.secretKeyRef",
    ),
}


def _ready(kube: Kube) -> dict[str, Any]:
    conds = kube.job("ml", "demo")["status"]["conditions"]
    return next(c for c in conds if c["type"] == "Ready")


def _pods(kube: Kube) -> list[str]:
    return sorted(n for k, n in kube.names() if k == "Pod")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_violating_job_gets_no_pod_and_says_why(
    kube: Kube, ctx: Context, make_job: Any, attack: str
) -> None:
    """Even with the operator's account on the allow-list: a job never runs under it."""
    template, field = ATTACKS[attack]
    ctx, memo = _with(
        ctx,
        service_account=OPERATOR_SA,
        pod_template_policy=f'{{"allowedServiceAccounts": ["{OPERATOR_SA}"]}}',
    )
    body = make_job(podTemplate=template)
    kube.add_job(body)
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="pod template"):
        run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    assert _pods(kube) == []
    assert kube.names() == []  # nothing at all: no Service, ConfigMap, Secret, store
    assert kube.requests("create", "Pod") == 0
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Failed"
    ready = _ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", "PolicyViolation")
    assert field in ready["message"]
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PolicyViolation"
    (event,) = [e for e in kube.events if e["reason"] == "PolicyViolation"]
    assert event["type"] == "Warning" and field in event["message"]


def test_the_policy_comes_from_the_settings(kube: Kube, ctx: Context, make_job: Any) -> None:
    """The chart's values, as the operator's setting, open a door: the hostPath reaches the pod."""
    template, _ = ATTACKS["hostpath"]
    ctx, memo = _with(ctx, pod_template_policy='{"allowedVolumeTypes": ["hostPath"]}')
    body = make_job(podTemplate=template)
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    pod = kube.get("Pod", "ml", "demo-node-0")
    assert pod is not None
    assert {"name": "root", "hostPath": {"path": "/"}} in pod["spec"]["volumes"]
    assert "PolicyViolation" not in kube.reasons()


def test_a_replacement_under_a_tightened_policy_is_refused_once(
    kube: Kube, ctx: Context, make_job: Any
) -> None:
    """The job ran when the policy allowed secret volumes; the admin tightened it since. A
    failed worker is not replaced by a pod mounting the Secret; the timer's retries do not
    repeat the event."""
    template = {"spec": {"volumes": [{"name": "s", "secret": {"secretName": "db"}}]}}
    loose, loose_memo = _with(
        ctx, pod_template_policy='{"allowedVolumeTypes": ["secret", "emptyDir"]}'
    )
    body = make_job(podTemplate=template, failurePolicy={"maxRestarts": 2})
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=loose_memo))
    kube.merge_status("ml", "demo", patch["status"])
    for name in ("demo-node-0", "demo-node-1"):
        kube.set_pod_phase("ml", name, "Running")
    run(handlers.sync_pods(loose, "ml", "demo"))
    assert kube.job("ml", "demo")["status"]["phase"] == "Running"

    strict, strict_memo = _with(ctx)  # the default policy: no secret volumes
    kube.set_pod_phase(
        "ml",
        "demo-node-1",
        "Failed",
        containerStatuses=[
            {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}
        ],
    )
    pod = kube.get("Pod", "ml", "demo-node-1")
    assert pod is not None
    run(
        handlers.on_pod_event(
            event={"type": "MODIFIED"},
            body=pod,
            namespace="ml",
            labels=pod["metadata"]["labels"],
            memo=strict_memo,  # type: ignore[arg-type]
        )
    )
    (record,) = kube.job("ml", "demo")["status"]["failures"]
    due = dt.datetime.fromisoformat(record["replaceAt"])
    creates = kube.requests("create", "Pod")
    for minute in range(3):
        later = due + dt.timedelta(minutes=minute)
        assert run(children.replace_failed(strict, kube.job("ml", "demo"), later)) == []
    assert kube.requests("create", "Pod") == creates
    failed = kube.get("Pod", "ml", "demo-node-1")
    assert failed is not None and failed["status"]["phase"] == "Failed"  # not even deleted
    ready = _ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", "PolicyViolation")
    assert "spec.podTemplate.spec.volumes[0].secret" in ready["message"]
    assert kube.reasons().count("PolicyViolation") == 1


def test_a_resume_of_a_template_edited_while_suspended_is_refused_once(
    kube: Kube, ctx: Context, memo: kopf.Memo, make_job: Any
) -> None:
    body = make_job(suspend=True)
    kube.add_job(body)
    patch = kopf.Patch()
    run(handlers.on_create(body=body, patch=patch, memo=memo))
    kube.merge_status("ml", "demo", patch["status"])
    job = kube.job("ml", "demo")
    job["spec"]["suspend"] = False
    job["spec"]["podTemplate"] = _trainer_env({"name": "PYTHONPATH", "value": "/data/evil"})
    job["metadata"]["generation"] += 1
    job = kube.put("MalleusJob", job)
    for second in range(3):
        at = T0 + dt.timedelta(seconds=second)
        assert run(admission.reconcile(Context.of(memo), kube.job("ml", "demo"), at)) is None
    assert _pods(kube) == []
    st = kube.job("ml", "demo")["status"]
    assert st["phase"] == "Suspended"
    ready = _ready(kube)
    assert ready["reason"] == "PolicyViolation"
    assert "spec.podTemplate.spec.containers[0].env[0].name" in ready["message"]
    assert kube.reasons().count("PolicyViolation") == 1
