"""The pure manifest builders (`resources`, `workers`): what every worker pod, the Service,
ConfigMap and Secret hold."""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

import pytest

from malleus.job import ResolvedJob
from malleus.operator import jobs, resources, workers
from malleus.operator.resources import JobRef
from malleus.planner.plan import Pipeline, Plan, Stage

REF = JobRef(namespace="ml", name="demo", uid="uid-1234", generation=1)
PLAN = Plan(
    generation=1,
    tp=2,
    pipelines=[
        Pipeline(micro_batches=4, stages=[Stage(ranks=[0, 1], layers=(0, 8))]),
        Pipeline(micro_batches=4, stages=[Stage(ranks=[2, 3], layers=(0, 8))]),
    ],
    excluded=[4, 5, 6, 7],
)


def _job(make_job: Any, **spec: Any) -> Any:
    return jobs.resolve(make_job(**spec))


def _children(make_job: Any, **spec: Any) -> list[dict[str, Any]]:
    return workers.build_children(_job(make_job, **spec), REF, PLAN, "s3cret-token")


def _pods(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker pods (not the store)."""
    return [
        c
        for c in children
        if c["kind"] == "Pod" and c["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_one_pod_per_node_after_service_configmap_secret(make_job: Any) -> None:
    children = _children(make_job, nodes=3)
    kinds = [c["kind"] for c in children]
    assert kinds == [
        "Service",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
        "Service",  # the store's, then its pod, before any worker
        "Pod",
        "Pod",
        "Pod",
        "Pod",
    ]
    assert [c["metadata"]["name"] for c in children[4:6]] == ["demo-store", "demo-store"]
    assert [p["metadata"]["name"] for p in _pods(children)] == [
        "demo-node-0",
        "demo-node-1",
        "demo-node-2",
    ]


def test_every_child_is_owned_by_the_job_and_labelled(make_job: Any) -> None:
    for obj in _children(make_job):
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "malleus.io/v1alpha1",
                "kind": "MalleusJob",
                "name": "demo",
                "uid": "uid-1234",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][resources.JOB_LABEL] == "demo"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == resources.MANAGED_BY


def test_gpu_requests_equal_limits_equal_gpus_per_node(make_job: Any) -> None:
    spec = {"resources": {"cpu": "8", "memory": "64Gi"}}
    for pod in _pods(_children(make_job, **spec)):
        (container,) = pod["spec"]["containers"]
        res = container["resources"]
        assert (
            res["requests"]
            == res["limits"]
            == {
                "cpu": "8",
                "memory": "64Gi",
                "nvidia.com/gpu": "4",
            }
        )
        assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
        anti = pod["spec"]["affinity"]["podAntiAffinity"]
        term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["topologyKey"] == "kubernetes.io/hostname"


def test_emulation_needs_no_gpus_and_no_one_pod_per_node_rule(make_job: Any) -> None:
    for pod in _pods(_children(make_job, emulation={"enabled": True})):
        (container,) = pod["spec"]["containers"]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert "affinity" not in pod["spec"]
        assert _env(container)["MALLEUS_EMULATION"] == "1"


def test_torchrun_launches_the_pods_ranks_and_they_meet_in_the_store(make_job: Any) -> None:
    pods = _pods(_children(make_job, nodes=2, gpusPerNode=4))
    for index, pod in enumerate(pods):
        container = pod["spec"]["containers"][0]
        cmd = container["command"]
        assert cmd[0] == "torchrun"
        # torchrun only launches this pod's ranks: no rendezvous on any worker
        assert "--nnodes=1" in cmd and "--node-rank=0" in cmd
        assert "--nproc-per-node=4" in cmd
        assert "--master-addr=127.0.0.1" in cmd
        assert "--max-restarts=0" in cmd
        assert cmd[cmd.index("-m") + 1 :] == [
            "malleus.trainer",
            "/etc/malleus/job.json",
            "--plan=/etc/malleus/plan.json",
        ]
        env = _env(container)
        assert env["MALLEUS_STORE"] == "demo-store.ml.svc:29400"
        assert env["MALLEUS_NODE_RANK"] == str(index)
        assert pod["spec"]["terminationGracePeriodSeconds"] == 60  # failurePolicy default
        # stable DNS: hostname + subdomain = the headless Service
        assert pod["spec"]["hostname"] == f"demo-node-{index}"
        assert pod["spec"]["subdomain"] == "demo"
        assert pod["metadata"]["labels"][resources.NODE_LABEL] == str(index)


def test_token_file_from_secret_plan_and_job_from_configmap(make_job: Any) -> None:
    (pod, *_) = _pods(_children(make_job, controlPort=9040))
    container = pod["spec"]["containers"][0]
    env = _env(container)
    # the token is a file of the Secret's volume, never an environment variable
    assert "MALLEUS_CONTROL_TOKEN" not in env
    assert env["MALLEUS_CONTROL_TOKEN_FILE"] == "/etc/malleus-tls/token"
    mount = {m["name"]: m for m in container["volumeMounts"]}["control-tls"]
    assert mount == {"name": "control-tls", "mountPath": "/etc/malleus-tls", "readOnly": True}
    secret = {v["name"]: v for v in pod["spec"]["volumes"]}["control-tls"]["secret"]
    assert secret["secretName"] == "demo-control"
    assert {"key": "token", "path": "token"} in secret["items"]
    assert env["MALLEUS_PLAN"] == "/etc/malleus/plan.json"
    assert env["MALLEUS_JOB"] == "/etc/malleus/job.json"
    assert env["MALLEUS_CONTROL_PORT"] == "9040"
    assert env["MALLEUS_NODE_RANK"] == "0"
    assert env["MALLEUS_JOB_NAME"] == "demo"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["config"] == {"name": "config", "mountPath": "/etc/malleus", "readOnly": True}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "demo-config"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # one control port per rank: whichever rank is the coordinator serves its own
    assert ports == {"control": 9040, "control-1": 9041, "control-2": 9042, "control-3": 9043}
    # no annotation-driven scrape: Prometheus comes in through the job's PodMonitor
    assert not any(k.startswith("prometheus.io/") for k in pod["metadata"]["annotations"])


def test_pods_run_as_non_root_with_a_read_only_root(make_job: Any) -> None:
    for pod in _pods(_children(make_job)):
        psc = pod["spec"]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        csc = pod["spec"]["containers"][0]["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["readOnlyRootFilesystem"] is True
        assert csc["capabilities"] == {"drop": ["ALL"]}
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["spec"]["automountServiceAccountToken"] is False
        # writable places a trainer needs, since the root is read-only
        paths = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/dev/shm", "/checkpoints"} <= paths


def test_checkpoint_claim_is_mounted_at_its_path(make_job: Any) -> None:
    spec = {"checkpoint": {"claimName": "ckpt", "path": "/data/ckpt", "intervalSteps": 10}}
    (pod, *_) = _pods(_children(make_job, **spec))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "ckpt"},
    }
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["checkpoints"] == "/data/ckpt"
    cmd = pod["spec"]["containers"][0]["command"]
    assert cmd[-3:-1] == ["--checkpoint-dir=/data/ckpt", "--checkpoint-every=10"]
    # The trained model is left on the claim as a Hugging Face folder at the end.
    assert cmd[-1] == f"--save-hf=/data/ckpt/{workers.HF_EXPORT}"


def test_no_export_without_a_persistent_volume(make_job: Any) -> None:
    (pod, *_) = _pods(_children(make_job, checkpoint={"intervalSteps": 10}))
    assert not any(a.startswith("--save-hf") for a in pod["spec"]["containers"][0]["command"])


def test_headless_service_publishes_not_ready_addresses(make_job: Any) -> None:
    svc = _children(make_job)[0]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {
        resources.JOB_LABEL: "demo",
        "app.kubernetes.io/component": "worker",  # not the store
    }
    assert {p["port"] for p in svc["spec"]["ports"]} == {8040}


def test_configmap_holds_the_plan_and_the_job(make_job: Any) -> None:
    cm = _children(make_job)[1]
    assert Plan.from_json(cm["data"]["plan.json"]) == PLAN
    job = json.loads(cm["data"]["job.json"])
    assert job["kind"] == "MalleusJob"
    assert job["metadata"] == {"name": "demo", "namespace": "ml"}
    assert job["spec"]["nodes"] == 2
    # the trainers' manifest round-trips through the same parser
    assert jobs.resolve(job).nodes == 2


def test_secret_holds_the_token_base64(make_job: Any) -> None:
    secret = _children(make_job)[2]
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"


def test_longest_job_name_keeps_pod_names_dns_labels() -> None:
    name = "j" * 52  # the CRD's maxLength
    assert len(resources.pod_name(name, 4095)) <= 63


def test_event_names_the_job() -> None:
    event = resources.build_event(
        REF, "Warning", "PodFailed", "x" * 5000, dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    )
    assert event["involvedObject"]["kind"] == "MalleusJob"
    assert event["involvedObject"]["uid"] == "uid-1234"
    assert event["metadata"]["generateName"] == "demo."
    assert event["firstTimestamp"] == "2025-01-02T03:04:05Z"
    assert len(event["message"]) == 1024


@pytest.mark.parametrize("kind", ["Pod", "Service", "ConfigMap", "Secret"])
def test_manifests_are_valid_for_the_kubernetes_client_models(make_job: Any, kind: str) -> None:
    """The generated client validates bodies strictly (unknown fields rejected), as k8s.py
    sends them: a typo in a builder fails here, not in a cluster."""
    from kubernetes import client

    model = {"Pod": client.V1Pod, "Service": client.V1Service}.get(kind) or getattr(
        client, f"V1{kind}"
    )
    for obj in _children(make_job):
        if obj["kind"] == kind:
            parsed = model.model_validate(obj) if hasattr(model, "model_validate") else None
            assert parsed is not None


def test_manifests_validate_against_the_kubernetes_openapi_schema(make_job: Any) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the test extra)"
    )
    children = _children(make_job, checkpoint={"claimName": "ckpt"})
    children += _children(make_job, emulation={"enabled": True})
    children.append(resources.build_event(REF, "Normal", "Created", "ok", dt.datetime.now(dt.UTC)))
    for obj in children:
        kv.validate(obj, kv.latest_version(), strict=True)


def test_the_worker_command_and_files_fit_the_trainer_cli(make_job: Any, tmp_path: Any) -> None:
    """What the pods run parses with the trainer's own argparse, and the ConfigMap's job.json
    and plan.json (as mounted) load as the trainer loads them."""
    import argparse

    cli = pytest.importorskip("malleus.trainer.cli")
    spec = {"checkpoint": {"intervalSteps": 5}}
    children = _children(make_job, **spec)
    cm = children[1]
    (tmp_path / "job.json").write_text(cm["data"]["job.json"])
    (tmp_path / "plan.json").write_text(cm["data"]["plan.json"])
    cmd = _pods(children)[0]["spec"]["containers"][0]["command"]
    args_after_module = cmd[cmd.index("malleus.trainer") + 1 :]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [a.replace(resources.CONFIG_MOUNT, str(tmp_path)) for a in args_after_module]
    )
    assert args.checkpoint_every == 5 and args.checkpoint_dir == "/checkpoints"
    assert ResolvedJob.load(args.job).check().name == "demo"  # strictly, as the trainer reads it
    assert Plan.from_json((tmp_path / "plan.json").read_text()) == PLAN
