"""What a MalleusJob may put in its pods: `malleus.job.podpolicy.policy_faults`, the chart that
carries the same policy to the operator and to the API server, and ``malleus check``.

The attacks are `pod_policy_cases.ATTACKS`, the same list the real-API-server check applies
with ``kubectl`` (``scripts/check-pod-policy-vap.sh``), so both judges answer for one list.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from malleus.cli import main
from malleus.errors import Fault
from malleus.job.podpolicy import (
    DEFAULT_RESERVED_ENV_PREFIXES,
    OPERATOR_ENV_NAMES,
    OPERATOR_ENV_PREFIXES,
    PodTemplatePolicy,
    policy_faults,
)
from malleus.job.spec import PodTemplate
from malleus.operator.settings import Settings
from tests.chart import render
from tests.security.pod_policy_cases import (
    ATTACKS,
    COMPLIANT_TEMPLATE,
    OPERATOR_SA,
    Attack,
    compliant_job,
    job_manifest,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = PodTemplatePolicy()


def faults(
    template: dict[str, Any], policy: PodTemplatePolicy = DEFAULT, sa: str | None = None
) -> list[Fault]:
    """The faults of ``template`` (a ``spec.podTemplate``) under ``policy``."""
    return policy_faults(PodTemplate.model_validate(template), policy, operator_service_account=sa)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.id)
def test_each_attack_is_one_fault_at_its_field_with_the_way_out(attack: Attack) -> None:
    (fault,) = faults(attack.template, sa=OPERATOR_SA)
    assert fault.path == attack.field
    if attack.id == "operator-service-account":
        assert "operator's own ServiceAccount" in fault.message
    else:
        assert "allowed only if the cluster admin sets podTemplatePolicy." in fault.message
        assert "in the chart's values" in fault.message


def test_the_compliant_template_and_no_template_pass() -> None:
    assert faults(COMPLIANT_TEMPLATE, sa=OPERATOR_SA) == []
    assert policy_faults(None, DEFAULT, operator_service_account=OPERATOR_SA) == []


def test_the_operator_account_is_refused_whatever_the_policy_lists() -> None:
    open_door = PodTemplatePolicy(allowed_service_accounts=(OPERATOR_SA, "trainer-sa"))
    template = {"spec": {"serviceAccountName": OPERATOR_SA}}
    (fault,) = faults(template, open_door, sa=OPERATOR_SA)
    assert "operator's own" in fault.message
    assert faults({"spec": {"serviceAccountName": "trainer-sa"}}, open_door, sa=OPERATOR_SA) == []
    # unknown (malleus check): judged by the list alone
    (fault,) = faults(template, sa=None)
    assert "podTemplatePolicy.allowedServiceAccounts" in fault.message


def test_every_volume_key_is_judged_not_only_the_first() -> None:
    """The CRD keeps volumes as given: a volume naming emptyDir AND hostPath is still a
    hostPath (the API server refuses such a pod, but the policy must not rely on it)."""
    template = {"spec": {"volumes": [{"name": "x", "emptyDir": {}, "hostPath": {"path": "/"}}]}}
    assert [f.path for f in faults(template)] == ["spec.podTemplate.spec.volumes[0].hostPath"]


def test_a_projected_volume_is_judged_by_its_sources() -> None:
    sources = [
        {"configMap": {"name": "c"}},
        {"secret": {"name": "s"}},
        {"downwardAPI": {"items": []}},
        {"serviceAccountToken": {"path": "t", "audience": "vault"}},
    ]
    template = {"spec": {"volumes": [{"name": "p", "projected": {"sources": sources}}]}}
    base = "spec.podTemplate.spec.volumes[0].projected.sources"
    assert [f.path for f in faults(template)] == [
        f"{base}[1].secret",
        f"{base}[2].downwardAPI",
        f"{base}[3].serviceAccountToken",
    ]
    wide = PodTemplatePolicy(
        allowed_volume_types=(*DEFAULT.allowed_volume_types, "secret", "downwardAPI"),
        allow_service_account_token=True,
    )
    assert faults(template, wide) == []


def test_the_admin_can_open_each_door_but_never_the_operators_env() -> None:
    template = {
        "spec": {
            "volumes": [{"name": "h", "hostPath": {"path": "/data"}}],
            "containers": [
                {
                    "name": "trainer",
                    "env": [
                        {"name": "LD_PRELOAD", "value": "/data/x.so"},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    ],
                }
            ],
        }
    }
    assert len(faults(template)) == 3
    opened = PodTemplatePolicy(
        allowed_volume_types=("hostPath",), allowed_env_names=("LD_PRELOAD",), allow_secret_env=True
    )
    assert faults(template, opened) == []
    ours = {"spec": {"containers": [{"name": "trainer", "env": [{"name": "HOME", "value": "/"}]}]}}
    (fault,) = faults(
        ours, PodTemplatePolicy(allowed_env_names=("HOME",), reserved_env_prefixes=())
    )
    assert fault.message == "HOME is the operator's own variable"


@pytest.mark.parametrize(
    "name",
    [
        "LD_LIBRARY_PATH",
        "PYTHONSTARTUP",
        "NCCL_COMM_ID",
        "TORCH_DISTRIBUTED_DEBUG",
        "TORCHELASTIC_USE_AGENT_STORE",
        "PET_RDZV_ENDPOINT",
        "MASTER_ADDR",
        "RANK",
        "WORLD_SIZE",
        "NVIDIA_VISIBLE_DEVICES",
        "CUDA_VISIBLE_DEVICES",
        "TRITON_PTXAS_PATH",
        "GLIBC_TUNABLES",
    ],
)
def test_names_that_load_code_or_rewire_the_launch_are_reserved(name: str) -> None:
    template = {
        "spec": {"containers": [{"name": "trainer", "env": [{"name": name, "value": "x"}]}]}
    }
    (fault,) = faults(template)
    assert fault.path == "spec.podTemplate.spec.containers[0].env[0].name"


def test_capabilities_only_as_the_admin_allows_and_never_privileged() -> None:
    """The trainer and every init container are judged; ``CAP_IPC_LOCK`` is ``IPC_LOCK``;
    no policy allows ALL or SYS_ADMIN (the values schema refuses them too)."""
    adds = {"capabilities": {"add": ["CAP_IPC_LOCK"]}}
    template = {
        "spec": {
            "containers": [{"name": "trainer", "securityContext": adds}],
            "initContainers": [{"name": "a", "image": "i", "securityContext": adds}],
        }
    }
    assert [f.path.split(".")[3] for f in faults(template)] == [
        "containers[0]",
        "initContainers[0]",
    ]
    ib = PodTemplatePolicy(allowed_capabilities=("ipc_lock",))
    assert ib.allowed_capabilities == ("IPC_LOCK",)
    assert faults(template, ib) == []
    for never in ("ALL", "SYS_ADMIN", "cap_sys_admin"):
        with pytest.raises(ValueError, match="never run privileged"):
            PodTemplatePolicy(allowed_capabilities=("IPC_LOCK", never))
    template["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["ALL"]}}
    (fault,) = faults(template, ib)
    assert "never allowed" in fault.message
    schema = json.loads((ROOT / "helm/malleus-operator/values.schema.json").read_text())
    item = schema["properties"]["podTemplatePolicy"]["properties"]["allowedCapabilities"]["items"]
    assert {"ALL", "SYS_ADMIN"} <= set(item["not"]["enum"])


def test_projected_is_not_a_type_to_list() -> None:
    with pytest.raises(ValueError, match="judged by its sources"):
        PodTemplatePolicy(allowed_volume_types=("projected",))


# ---- the chart carries the same policy ------------------------------------------------------


def _values_policy() -> dict[str, Any]:
    values = yaml.safe_load((ROOT / "helm/malleus-operator/values.yaml").read_text())
    return values["podTemplatePolicy"]


def test_the_charts_defaults_are_the_models() -> None:
    assert PodTemplatePolicy.model_validate(_values_policy()) == DEFAULT
    assert set(_values_policy()) == {f.alias for f in PodTemplatePolicy.model_fields.values()}


def test_the_operator_reads_the_charts_policy_and_its_own_account() -> None:
    docs = render("podTemplatePolicy.allowSecretEnv=true")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    raw = env["MALLEUS_OPERATOR_POD_TEMPLATE_POLICY"]["value"]
    assert PodTemplatePolicy.from_json_text(raw) == DEFAULT.model_copy(
        update={"allow_secret_env": True}
    )
    account = env["MALLEUS_OPERATOR_SERVICE_ACCOUNT"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert account == "spec.serviceAccountName"
    settings = Settings.from_env({"MALLEUS_OPERATOR_POD_TEMPLATE_POLICY": raw})
    assert settings.template_policy().allow_secret_env is True
    with pytest.raises(ValueError, match="projected"):
        Settings.from_env(
            {"MALLEUS_OPERATOR_POD_TEMPLATE_POLICY": '{"allowedVolumeTypes": ["projected"]}'}
        )


def _admission(*sets: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    docs = render(*sets)
    (params,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and "pod-template-policy" in d["metadata"]["name"]
    ]
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    return params, policy, binding


def test_the_admission_policy_takes_its_params_from_the_same_values() -> None:
    params, policy, binding = _admission("podTemplatePolicy.allowedServiceAccounts={trainer}")
    data = params["data"]
    expected = DEFAULT.model_copy(update={"allowed_service_accounts": ("trainer",)})
    for key, value in expected.model_dump(by_alias=True).items():
        got = data[key]
        if isinstance(value, tuple):
            assert [x for x in got.split("\n") if x] == list(value), key
        else:
            assert got == str(value).lower(), key
    assert data["allowedServiceAccounts"] == "trainer"
    assert data["operatorServiceAccount"] == "rel-malleus-operator"
    assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ConfigMap"}
    assert binding["spec"]["validationActions"] == ["Deny"]
    ref = binding["spec"]["paramRef"]
    assert (ref["name"], ref["namespace"]) == (params["metadata"]["name"], "malleus-system")
    assert ref["parameterNotFoundAction"] == "Deny"
    assert policy["spec"]["failurePolicy"] == "Fail"
    # the operator's own env names are in the CEL as they are in the model
    cel = json.dumps(policy["spec"])
    for name in OPERATOR_ENV_NAMES:
        assert f"'{name}'" in cel
    for prefix in OPERATOR_ENV_PREFIXES:
        assert f"startsWith('{prefix}')" in cel
    assert set(DEFAULT_RESERVED_ENV_PREFIXES) <= set(data["reservedEnvPrefixes"].split("\n"))


@pytest.mark.parametrize(
    ("sets", "namespaces"),
    [
        ((), ["malleus-system"]),
        (("watchNamespaces={ml,research}",), ["malleus-system", "ml", "research"]),
        (("rbac.clusterWide=true",), None),
    ],
)
def test_the_binding_covers_the_namespaces_the_operator_watches(
    sets: tuple[str, ...], namespaces: list[str] | None
) -> None:
    _, _, binding = _admission(*sets)
    selector = binding["spec"]["matchResources"]["namespaceSelector"]
    if namespaces is None:
        assert selector == {}
        return
    (expr,) = selector["matchExpressions"]
    assert (expr["key"], expr["operator"], expr["values"]) == (
        "kubernetes.io/metadata.name",
        "In",
        namespaces,
    )


def test_the_admission_policy_can_be_turned_off() -> None:
    kinds = {d["kind"] for d in render("admissionPolicy.enabled=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


# ---- malleus check ----------------------------------------------------------------------------


def _check(path: Path, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", str(path), "--no-file-check", *argv])
    return code, out.getvalue(), err.getvalue()


def test_malleus_check_applies_the_default_policy(tmp_path: Path) -> None:
    attack = next(a for a in ATTACKS if a.id == "hostpath-volume")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_manifest("hostpath", "ml", attack.template)))
    code, out, err = _check(path)
    assert (code, out) == (2, "")
    assert err.splitlines()[1] == (
        "  - spec.podTemplate.spec.volumes[1].hostPath: volume type hostPath is not allowed in the "
        "job's pods (allowed: persistentVolumeClaim, configMap, emptyDir, csi); allowed only if "
        "the cluster admin sets podTemplatePolicy.allowedVolumeTypes to include hostPath in the "
        "chart's values"
    )
    code, out, _ = _check(path, "--json")
    verdict = json.loads(out)
    assert code == 2 and verdict["valid"] is False and verdict["hint"] is None
    assert [f["path"] for f in verdict["faults"]] == [attack.field]
    path.write_text(yaml.safe_dump(compliant_job("fine", "ml")))
    code, out, err = _check(path)
    assert (code, err) == (0, ""), err
    assert out.startswith("job fine: valid")
