"""``spec.podTemplate``: what a job adds to its pods, and what the operator keeps its own.

The merge is pure (`overrides.apply_pod_template`, called by `workers.build_pod`); the schema
part runs on the real API server (its pruning is what stops a template from naming a command
or a security context), and the built pods through kubernetes-validate.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from malleus.job import job_schema, validate_manifest
from malleus.job.podpolicy import PodTemplatePolicy, policy_faults
from malleus.job.spec import ContainerOverride, EnvVar, PodSpecOverride, PodTemplate, VolumeMount
from malleus.operator import children, jobs, resources, workers
from malleus.operator.context import Context
from malleus.operator.k8s import Cluster
from malleus.operator.metrics import OperatorMetrics
from malleus.operator.overrides import OPERATOR_RESOURCES, apply_pod_template
from malleus.operator.resources import JobRef
from malleus.operator.settings import Settings
from tests.cluster.controlplane import RESTRICTED
from tests.job.cases import REPO, load_yaml

if TYPE_CHECKING:
    from tests.cluster.fixtures import AdminApi

REF = JobRef(namespace="ml", name="gpu-cluster", uid="uid-1", generation=1)
EXAMPLE = REPO / "examples" / "gpu-cluster.yaml"


def _example() -> dict[str, Any]:
    manifest = load_yaml(EXAMPLE)
    manifest["metadata"]["namespace"] = "ml"
    return manifest


def _pod(manifest: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return workers.build_pod(jobs.resolve(manifest), REF, index)


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return container


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _trainer(pod)["env"]}


def test_every_override_reaches_the_pod() -> None:
    pod = _pod(_example())
    meta, spec, trainer = pod["metadata"], pod["spec"], _trainer(pod)
    assert meta["labels"]["team"] == "pretraining"
    assert meta["labels"]["malleus.io/job"] == "gpu-cluster"  # the operator's beside it
    assert meta["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert not any(k.startswith("prometheus.io/") for k in meta["annotations"])
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    affinity = spec["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (anti,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"  # still one worker per node
    keys = [t["key"] for t in spec["tolerations"]]
    assert keys == ["nvidia.com/gpu", "dedicated"]
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert spec["priorityClassName"] == "training-high"
    env = _env(pod)
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["MALLEUS_NODE_RANK"] == "0"
    mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "shm"  # the job's sized one replaced the operator's
    assert mounts["/models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert "/etc/malleus-tls" in mounts and "/etc/malleus" in mounts
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert "dshm" not in volumes
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "hf-models"
    assert {"config", "control-tls", "tmp", "checkpoints"} <= set(volumes)
    for kind in ("requests", "limits"):
        amounts = trainer["resources"][kind]
        assert amounts == {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": "8", "rdma/hca": "1"}


def test_the_gpu_cluster_fields_reach_the_pod_hardened() -> None:
    """runtimeClassName, topology spread, DNS options, an init container and IPC_LOCK reach
    the pod; the init container is hardened like the trainer, whose hardening stays whole."""
    pod = _pod(_example())
    spec, trainer = pod["spec"], _trainer(pod)
    assert spec["runtimeClassName"] == "nvidia"
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "network.example.com/block"
    assert spec["dnsConfig"] == {"options": [{"name": "ndots", "value": "2"}]}
    assert "dnsPolicy" not in spec  # the cluster's DNS, with the job's options added
    assert trainer["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    (init,) = spec["initContainers"]
    assert init["name"] == "fabric-check" and init["command"] == ["ib-check", "--ports-active"]
    assert init["resources"]["limits"] == {"cpu": "100m", "memory": "64Mi"}
    assert init["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["securityContext"]["runAsUser"] == 1000  # the pod's: init containers' too


def test_sidecars_claims_and_the_trainers_name(make_job: Any) -> None:
    """A native sidecar keeps ``restartPolicy: Always``; resource claims reach the pod and
    the trainer; an init container may never take the trainer's name nor its GPUs (the model
    refuses both; the operator drops them even from a template built around the model)."""
    plain = workers.build_pod(jobs.resolve(make_job()), REF, 0)
    claim = {"name": "nic", "resourceClaimTemplateName": "rdma-nic"}
    template = PodTemplate.model_validate(
        {
            "spec": {
                "resourceClaims": [claim],
                "initContainers": [
                    {
                        "name": "shipper",
                        "image": "fluent-bit:3",
                        "restartPolicy": "Always",
                        "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
                        "resources": {"claims": [{"name": "nic"}]},
                    }
                ],
                "containers": [{"name": "trainer", "resources": {"claims": [{"name": "nic"}]}}],
            }
        }
    )
    pod = apply_pod_template(plain, template)
    assert pod["spec"]["resourceClaims"] == [claim]
    assert _trainer(pod)["resources"]["claims"] == [{"name": "nic"}]
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["NET_BIND_SERVICE"],
    }
    assert sidecar["resources"] == {"claims": [{"name": "nic"}]}
    for bad in (
        {"name": "trainer", "image": "evil"},
        {"name": "x", "image": "y", "resources": {"limits": {"nvidia.com/gpu": 8}}},
    ):
        with pytest.raises(ValueError, match="init container"):
            PodTemplate.model_validate({"spec": {"initContainers": [bad]}})
    sneaky = template.model_copy(deep=True)
    sneaky.spec.init_containers[0].name = "trainer"  # no validation on assignment
    sneaky.spec.init_containers[0].resources.limits["nvidia.com/gpu"] = 8
    pod = apply_pod_template(plain, sneaky)
    assert "initContainers" not in pod["spec"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["trainer"]


def test_a_hostile_init_container_is_hardened_even_unpruned() -> None:
    """privileged, root, privilege escalation in an init container: the schema has no field
    for them, the operator reads the body as the API server prunes it, and its hardening is
    the container's security context whatever the body said."""
    manifest = _example()
    (init,) = manifest["spec"]["podTemplate"]["spec"]["initContainers"]
    init["securityContext"] = {
        "privileged": True,
        "runAsUser": 0,
        "allowPrivilegeEscalation": True,
        "capabilities": {"add": ["SYS_ADMIN"], "drop": []},
    }
    strict = {f.path for f in validate_manifest(manifest)[1]}
    assert "spec.podTemplate.spec.initContainers[0].securityContext.privileged" in strict
    (built,) = _pod(manifest)["spec"]["initContainers"]
    security = built["securityContext"]
    assert "privileged" not in security and "runAsUser" not in security
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # SYS_ADMIN got through the model (it is a capability name), never through the policy:
    faults = policy_faults(
        jobs.resolve(manifest).spec.pod_template,
        PodTemplatePolicy(allowed_capabilities=("IPC_LOCK",)),
        operator_service_account=None,
    )
    paths = [f.path for f in faults]
    assert "spec.podTemplate.spec.initContainers[0].securityContext.capabilities.add[0]" in paths


def test_workers_are_ready_once_their_launcher_listens(make_job: Any) -> None:
    """The readiness probe: torchrun's agent store on every worker (not the control port,
    which only the coordinator serves); the template cannot replace it."""
    pod = _pod(_example())
    probe = _trainer(pod)["readinessProbe"]
    assert probe["tcpSocket"] == {"port": resources.RENDEZVOUS_PORT}
    assert probe == workers.READINESS_PROBE
    assert f"--master-port={resources.RENDEZVOUS_PORT}" in _trainer(pod)["command"]
    plain = workers.build_pod(jobs.resolve(make_job()), REF, 1)
    assert _trainer(plain)["readinessProbe"] == workers.READINESS_PROBE


def test_service_account_scheduler_and_no_token() -> None:
    manifest = _example()
    manifest["spec"]["podTemplate"]["spec"].update(
        serviceAccountName="trainer-sa", schedulerName="volcano"
    )
    spec = _pod(manifest)["spec"]
    assert (spec["serviceAccountName"], spec["schedulerName"]) == ("trainer-sa", "volcano")
    assert spec["automountServiceAccountToken"] is False  # the operator's, whatever the SA


def test_the_operators_fields_win_over_the_template(make_job: Any) -> None:
    """A template built in code (no schema, no CEL) that names the operator's own keys."""
    plain = workers.build_pod(jobs.resolve(make_job()), REF, 1)
    before = copy.deepcopy(plain)
    template = PodTemplate(
        metadata={
            "labels": {"malleus.io/job": "someone-else", "malleus.io/node-rank": "7"},
            "annotations": {"prometheus.io/port": "1"},
        },
        spec=PodSpecOverride(
            volumes=[{"name": "config", "emptyDir": {}}],
            containers=[
                ContainerOverride(
                    name="trainer",
                    env=[
                        EnvVar(name="MALLEUS_CONTROL_TOKEN", value="known"),
                        EnvVar(name="MALLEUS_NODE_RANK", value="0"),
                    ],
                    volume_mounts=[
                        VolumeMount(name="config", mount_path="/etc/malleus"),
                        VolumeMount(name="config", mount_path="/etc/malleus-tls"),
                    ],
                    resources={"requests": {"nvidia.com/gpu": 0, "cpu": "1", "rdma/hca": 1}},
                )
            ],
        ),
    )
    pod = apply_pod_template(plain, template)
    assert plain == before  # pure: the operator's pod is not changed in place
    assert pod["metadata"]["labels"]["malleus.io/job"] == "gpu-cluster"
    assert pod["metadata"]["labels"]["malleus.io/node-rank"] == "1"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "1"  # the job's own
    env = _env(pod)
    # the token is the Secret's file, which the trainer reads before any variable
    assert env["MALLEUS_CONTROL_TOKEN_FILE"] == "/etc/malleus-tls/token"
    assert [e["name"] for e in _trainer(pod)["env"]].count("MALLEUS_NODE_RANK") == 1
    assert env["MALLEUS_NODE_RANK"] == "1"
    (config,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    assert config == {"name": "config", "configMap": {"name": "gpu-cluster-config"}}
    assert _trainer(pod)["volumeMounts"] == _trainer(plain)["volumeMounts"]
    requests = _trainer(pod)["resources"]["requests"]
    assert requests == {"nvidia.com/gpu": "4", "rdma/hca": "1"}  # no cpu: spec.resources has none


def test_no_template_is_the_operators_pod_unchanged(make_job: Any) -> None:
    job = jobs.resolve(make_job())
    pod = workers.build_pod(job, REF, 0)
    assert apply_pod_template(pod, None) == pod
    assert apply_pod_template(pod, PodTemplate()) == pod


HOSTILE = {
    "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "privileged": True},
    "hostNetwork": True,
    "restartPolicy": "Always",
}
HOSTILE_CONTAINER = {
    "command": ["sh", "-c", "cat /etc/malleus-tls/tls.key"],
    "securityContext": {"runAsUser": 0, "privileged": True, "readOnlyRootFilesystem": False},
    "image": "evil:latest",
}


def _hostile() -> dict[str, Any]:
    manifest = _example()
    template = manifest["spec"]["podTemplate"]["spec"]
    template.update(copy.deepcopy(HOSTILE))
    template["containers"][0].update(copy.deepcopy(HOSTILE_CONTAINER))
    return manifest


def _assert_hardened(pod: dict[str, Any]) -> None:
    spec, trainer = pod["spec"], _trainer(pod)
    assert spec["securityContext"]["runAsUser"] == 1000
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "hostNetwork" not in spec and spec["restartPolicy"] == "Never"
    assert trainer["command"][0] == "torchrun"
    assert trainer["image"] == "registry.example.com/ml/malleus:0.1.0"
    assert trainer["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


@pytest.mark.usefixtures("cluster_crd")
def test_the_api_server_accepts_the_example_and_prunes_a_hostile_template(
    admin_api: AdminApi, job_namespace: str
) -> None:
    url = f"/apis/malleus.io/v1alpha1/namespaces/{job_namespace}/malleusjobs"
    good = admin_api.client.post(url, json=load_yaml(EXAMPLE))
    assert good.status_code == 201, good.text
    stored = good.json()
    assert stored["spec"]["podTemplate"] == validate_manifest(_example())[0]["spec"]["podTemplate"]
    manifest = _hostile()
    manifest["metadata"].update(name="hostile", namespace=job_namespace)
    response = admin_api.client.post(url, json=manifest)
    assert response.status_code == 201, response.text
    kept = response.json()["spec"]["podTemplate"]["spec"]
    assert not set(HOSTILE) & set(kept)
    trainer = kept["containers"][0]
    assert not (set(HOSTILE_CONTAINER) - {"securityContext"}) & set(trainer)
    # a securityContext may name capabilities to add, nothing else: the rest is pruned
    assert trainer.get("securityContext", {}) == {}
    _assert_hardened(_pod(response.json()))
    # kubectl's default (Strict) validation and `malleus check` refuse them outright.
    strict = {f.path for f in validate_manifest(manifest)[1]}
    assert {"spec.podTemplate.spec.securityContext", "spec.podTemplate.spec.hostNetwork"} <= strict
    assert "spec.podTemplate.spec.containers[0].command" in strict
    assert "spec.podTemplate.spec.containers[0].securityContext.privileged" in strict


def test_a_hostile_template_does_not_win_even_unpruned() -> None:
    """The operator reads bodies leniently (unknown fields pruned as the server does)."""
    _assert_hardened(_pod(_hostile()))


def test_the_built_pods_are_valid_kubernetes_pods() -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the test extra)"
    )
    manifest = _example()
    manifest["spec"]["podTemplate"]["spec"].update(
        serviceAccountName="trainer-sa", schedulerName="volcano"
    )
    job = jobs.resolve(manifest)
    for i in range(job.nodes):
        kv.validate(workers.build_pod(job, REF, i), kv.latest_version(), strict=True)


def test_the_crds_reserved_names_are_the_operators(make_job: Any) -> None:
    """The CEL rules name what the operator's pod uses: a new volume or env var of the
    operator's must be added there too (or a template could shadow it in vain)."""
    pod = workers.build_pod(jobs.resolve(make_job()), REF, 0)
    template = job_schema()["properties"]["spec"]["properties"]["podTemplate"]
    pod_spec = template["properties"]["spec"]
    (volume_rule,) = pod_spec["x-kubernetes-validations"]
    for volume in pod["spec"]["volumes"]:
        assert f"'{volume['name']}'" in volume_rule["rule"], volume["name"]
    container = pod_spec["properties"]["containers"]["items"]["properties"]
    (env_rule,) = container["env"]["x-kubernetes-validations"]
    for env in _trainer(pod)["env"]:
        name = env["name"]
        assert name.startswith("MALLEUS_") or f"'{name}'" in env_rule["rule"], name
    for kind in ("requests", "limits"):
        (rule,) = container["resources"]["properties"][kind]["x-kubernetes-validations"]
        assert all(f"'{r}'" in rule["rule"] for r in OPERATOR_RESOURCES)
    assert resources.GPU_RESOURCE in OPERATOR_RESOURCES


def _gpu_manifest(namespace: str, suffix: str) -> dict[str, Any]:
    """The example with a native sidecar and a DRA claim besides its init container, on a
    runtime class and priority class of this test's own; no node matches its selector, so its
    pods stay Pending."""
    manifest = _example()
    manifest["metadata"]["namespace"] = namespace
    spec = manifest["spec"]["podTemplate"]["spec"]
    spec["runtimeClassName"] = f"nvidia-{suffix}"
    spec["priorityClassName"] = f"training-{suffix}"
    spec["initContainers"].append(
        {"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always"}
    )
    spec["resourceClaims"] = [{"name": "nic", "resourceClaimTemplateName": "rdma-nic"}]
    spec["containers"][0]["resources"]["claims"] = [{"name": "nic"}]
    return manifest


def test_a_gpu_cluster_job_reaches_the_api_servers_pods_within_the_policy(
    admin_api: AdminApi, cluster_crd: dict[str, Any]
) -> None:
    """On the real control plane: the job with every GPU-cluster field is refused by the
    default policy (IPC_LOCK, a Secret's env: no pod created), and under a policy that allows
    them its worker pods are created with them (a native sidecar, the capability beside the
    operator's hardening, the runtime class, spread, DNS options, the DRA claim) and its store
    pod with the job's placement and its small footprint. Pod Security then says why
    ``allowedCapabilities`` is empty by default: ``restricted`` refuses the IPC_LOCK pod and
    admits the same pod without it, init and sidecar containers included."""
    del cluster_crd
    cluster = admin_api.cluster
    suffix = uuid.uuid4().hex[:8]
    namespace = cluster.create_namespace(f"gpu-{suffix}")
    strict = cluster.create_namespace(f"gpu-r-{suffix}", labels=RESTRICTED)
    runtime_class, priority_class = f"nvidia-{suffix}", f"training-{suffix}"
    classes = {
        "/apis/node.k8s.io/v1/runtimeclasses": {"handler": "nvidia"},
        "/apis/scheduling.k8s.io/v1/priorityclasses": {"value": 1000},
    }
    for (url, fields), name in zip(classes.items(), (runtime_class, priority_class), strict=True):
        made = admin_api.client.post(url, json={"metadata": {"name": name}, **fields})
        assert made.status_code == 201, made.text
    real = Cluster.connect(str(admin_api.kubeconfig))
    try:
        url = f"/apis/malleus.io/v1alpha1/namespaces/{namespace}/malleusjobs"
        stored = admin_api.client.post(url, json=_gpu_manifest(namespace, suffix))
        assert stored.status_code == 201, stored.text
        body = stored.json()
        job, ref = jobs.resolve(body), JobRef.from_body(body)
        plan, _ = asyncio.run(jobs.initial_plan(job))

        def ctx(policy: dict[str, Any] | None) -> Context:
            settings = Settings(metrics_port=0, pod_template_policy=json.dumps(policy or {}))
            return Context(cluster=real, settings=settings, metrics=OperatorMetrics())

        with pytest.raises(children.PolicyViolation) as refused:
            asyncio.run(children.ensure_children(ctx(None), job, ref, plan))
        paths = {f.path for f in refused.value.faults}
        assert "spec.podTemplate.spec.containers[0].securityContext.capabilities.add[0]" in paths
        assert admin_api.list("pods", namespace) == []
        opened = {"allowedCapabilities": ["IPC_LOCK"], "allowSecretEnv": True}
        asyncio.run(children.ensure_children(ctx(opened), job, ref, plan))
        pods = {p["metadata"]["name"]: p for p in admin_api.list("pods", namespace)}
        assert set(pods) == {*(f"gpu-cluster-node-{i}" for i in range(4)), "gpu-cluster-store"}
        pod = pods["gpu-cluster-node-0"]
        spec = pod["spec"]
        assert spec["runtimeClassName"] == runtime_class
        assert spec["dnsConfig"] == {"options": [{"name": "ndots", "value": "2"}]}
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "network.example.com/block"
        assert spec["resourceClaims"] == [{"name": "nic", "resourceClaimTemplateName": "rdma-nic"}]
        init, sidecar = spec["initContainers"]
        assert (init["name"], sidecar["name"], sidecar["restartPolicy"]) == (
            "fabric-check", "log-shipper", "Always",
        )  # fmt: skip
        for c in (init, sidecar):
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        trainer = spec["containers"][0]
        assert trainer["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
        assert trainer["resources"]["claims"] == [{"name": "nic"}]
        assert trainer["command"][0] == "torchrun"
        store_spec = pods["gpu-cluster-store"]["spec"]
        assert store_spec["nodeSelector"] == spec["nodeSelector"]
        assert {"key": "dedicated", "operator": "Equal", "value": "training",
                "effect": "NoSchedule"} in store_spec["tolerations"]  # fmt: skip
        assert store_spec["containers"][0]["resources"]["limits"] == {
            "cpu": "100m",
            "memory": "256Mi",
        }
        # Pod Security's restricted level: IPC_LOCK refused, the rest (sidecars too) admitted
        bare = workers.build_pod(job, JobRef(strict, "gpu-cluster", "u", 1), 1)
        # its owner (uid "u") does not exist: the garbage collector would take the pod
        del bare["metadata"]["ownerReferences"]
        posted = admin_api.client.post(f"/api/v1/namespaces/{strict}/pods", json=bare)
        assert posted.status_code == 403 and "IPC_LOCK" in posted.text, posted.text
        bare["spec"]["containers"][0]["securityContext"]["capabilities"].pop("add")
        posted = admin_api.client.post(f"/api/v1/namespaces/{strict}/pods", json=bare)
        assert posted.status_code == 201, posted.text
    finally:
        real.close()
        for url, name in zip(classes, (runtime_class, priority_class), strict=True):
            admin_api.client.delete(f"{url}/{name}")
        for ns in (namespace, strict):
            admin_api.client.delete(f"/api/v1/namespaces/{ns}")
