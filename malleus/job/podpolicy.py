"""What a MalleusJob may put in its pods: the cluster admin's `PodTemplatePolicy`, one judge.

``spec.podTemplate`` is merged into worker pods that the operator's ServiceAccount creates, so
whatever the template names the job's author gets without any right of their own to create
pods: a Secret or a PersistentVolumeClaim mounted, a ServiceAccount's token (projected), a
host path, a library preloaded into the trainers. The policy says which of these a job may use;
`policy_faults` judges a template against it and names each field that breaks it with the way
out (the chart value the admin would set). The same rules run in three places: the API
server (the chart's ValidatingAdmissionPolicy, ``templates/admission-policy.yaml``, whose
parameters the chart renders from the same ``podTemplatePolicy`` values), the operator before
it creates any pod, and ``malleus check`` (the default policy).

Pure and torch-free: pydantic models and functions of their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, field_validator

from malleus.errors import Fault

from .spec_base import StrictModel
from .spec_cluster import PodTemplate

__all__ = [
    "CHART_KEY",
    "DEFAULT_ALLOWED_ENV_NAMES",
    "DEFAULT_RESERVED_ENV_NAMES",
    "DEFAULT_RESERVED_ENV_PREFIXES",
    "DEFAULT_VOLUME_TYPES",
    "NEVER_CAPABILITIES",
    "OPERATOR_ENV_NAMES",
    "OPERATOR_ENV_PREFIXES",
    "PROJECTED_SOURCES",
    "PodTemplatePolicy",
    "capability_name",
    "env_reserved",
    "policy_faults",
]

CHART_KEY = "podTemplatePolicy"
"""The Helm values key (and the operator's setting) that holds the policy."""

DEFAULT_VOLUME_TYPES = ("persistentVolumeClaim", "configMap", "emptyDir", "csi")
"""Volume types a job may add by default: storage meant for the namespace's workloads. Off:
``secret`` (every Secret of the namespace, the operator's job tokens included, would be
readable by whoever may create a MalleusJob), ``hostPath`` (the node's files), and every other
type (``nfs``, ``iscsi``, ``ephemeral``, ...) until the admin lists it."""

PROJECTED_SOURCES = {
    "configMap": "configMap",
    "secret": "secret",
    "downwardAPI": "downwardAPI",
    "clusterTrustBundle": "clusterTrustBundle",
}
"""A ``projected`` volume's source kinds -> the volume type that allows each (a kind not here,
``podCertificate`` say, is allowed by its own name); its ``serviceAccountToken`` source is
allowed only by ``allowServiceAccountToken``."""

OPERATOR_ENV_NAMES = ("POD_IP", "NODE_NAME", "HOME", "PYTHONUNBUFFERED")
"""Env names the operator sets in every worker (`malleus.operator.workers`): never a job's,
whatever the policy (the CRD refuses them too)."""
OPERATOR_ENV_PREFIXES = ("MALLEUS_",)
"""Env prefixes that are the operator's and the trainers' own (``MALLEUS_STORE``,
``MALLEUS_CONTROL_TOKEN_FILE``, ``MALLEUS_FAULT``, ...): never a job's."""

# Why these: the job's image is the one piece of code the admin may vet (an image policy can pin
# registries); these names load other code into the trainers, or change where they connect or
# what the launch contract says, without changing the image.
#   LD_* (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT), GLIBC_TUNABLES, GCONV_PATH: the dynamic loader
#     and glibc load the libraries they name.
#   PYTHON* (PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, PYTHONINSPECT, ...): the interpreter imports
#     or runs what they name; PYTHONUNBUFFERED is the operator's.
#   NCCL_*: NCCL_NET_PLUGIN / NCCL_TUNER_PLUGIN / NCCL_PROFILER_PLUGIN load a library,
#     NCCL_COMM_ID redirects the bootstrap socket, NCCL_CONF_FILE / NCCL_TOPO_FILE /
#     NCCL_DEBUG_FILE read or write files; the tuning names that only pick devices, interfaces
#     and algorithms are let through by DEFAULT_ALLOWED_ENV_NAMES.
#   TORCH* (TORCH_*, TORCHELASTIC_*, TORCHINDUCTOR_*): TORCH_DISTRIBUTED_DEBUG logs collectives'
#     contents, TORCH_NCCL_* change how failures surface (the operator's recovery reads them),
#     TORCHELASTIC_USE_AGENT_STORE / TORCHELASTIC_RESTART_COUNT are read by the trainer,
#     TORCHINDUCTOR_* point compilation caches and compilers elsewhere.
#   PET_*: torchrun reads every option it is not given on the command line from PET_<OPTION>
#     (PET_RDZV_ENDPOINT, PET_LOG_DIR, ...): the operator's launch line must be the whole truth.
#   TRITON_*: TRITON_LIBCUDA_PATH loads a library, TRITON_PTXAS_PATH runs a program.
#   MASTER_ADDR / MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
#     ROLE_RANK, ...: torchrun's contract with the ranks (the operator sets the rendezvous).
#   NVIDIA_* (NVIDIA_VISIBLE_DEVICES=all), CUDA_VISIBLE_DEVICES: the container runtime and CUDA
#     pick GPUs by them, beside the device plugin's allocation (another job's GPUs).
DEFAULT_RESERVED_ENV_PREFIXES = (
    "LD_",
    "PYTHON",
    "NCCL_",
    "TORCH",
    "PET_",
    "TRITON_",
    "MASTER_",
    "NVIDIA_",
)
"""Env prefixes a job may not set by default (the comment above this says why, one by one)."""
DEFAULT_RESERVED_ENV_NAMES = (
    "GLIBC_TUNABLES",
    "GCONV_PATH",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
)
"""Env names a job may not set by default."""
DEFAULT_ALLOWED_ENV_NAMES = (
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_TIMEOUT",
    "NCCL_IB_RETRY_CNT",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_CROSS_NIC",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_BUFFSIZE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_NVLS_ENABLE",
)
"""Reserved by a prefix, yet allowed by default: NCCL's tuning knobs, which pick devices,
interfaces, algorithms and log levels, and neither load code nor name an address or a file
(what a GPU cluster's admin documents for its fabric)."""


NEVER_CAPABILITIES = ("ALL", "SYS_ADMIN")
"""Capabilities no policy may allow: ``ALL`` and ``SYS_ADMIN`` are a privileged container in
all but name (mounts, namespaces, devices: the node's root), and a job never runs privileged."""


def capability_name(name: str) -> str:
    """A capability as the policy compares it: upper case, without ``CAP_`` (the container
    runtimes take ``CAP_IPC_LOCK`` and ``IPC_LOCK`` alike)."""
    upper = name.strip().upper()
    return upper.removeprefix("CAP_")


class PodTemplatePolicy(StrictModel):
    """What ``spec.podTemplate`` may add to the worker pods; the defaults are the chart's.

    Written by the cluster admin (the Helm chart's ``podTemplatePolicy`` values: the operator
    reads them from its settings, the ValidatingAdmissionPolicy from a ConfigMap rendered from
    the same values). camelCase keys, as in the chart.
    """

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    allowed_volume_types: tuple[str, ...] = DEFAULT_VOLUME_TYPES
    """Volume types (the core/v1 Volume's key: ``persistentVolumeClaim``, ``secret``,
    ``hostPath``, ...) a template's volumes may have. A ``projected`` volume is judged by its
    sources (``configMap``, ``secret``, ``downwardAPI``, ``clusterTrustBundle`` each need their
    type here; ``serviceAccountToken`` needs ``allowServiceAccountToken``), so ``projected``
    itself is not a type to list."""
    allow_service_account_token: bool = False
    """Whether a ``projected`` volume may mount a ServiceAccount token (the pods run with
    ``automountServiceAccountToken: false``; this is the only other way one gets in)."""
    allowed_service_accounts: tuple[str, ...] = ()
    """``serviceAccountName`` values a template may give besides ``default`` (the namespace's,
    which every pod gets anyway). The operator's own ServiceAccount is refused whatever this
    says."""
    reserved_env_names: tuple[str, ...] = DEFAULT_RESERVED_ENV_NAMES
    """Env names the trainer container may not be given (the operator's own are always
    reserved: `OPERATOR_ENV_NAMES`)."""
    reserved_env_prefixes: tuple[str, ...] = DEFAULT_RESERVED_ENV_PREFIXES
    """Env name prefixes the trainer container may not be given (``MALLEUS_`` is always
    reserved)."""
    allowed_env_names: tuple[str, ...] = DEFAULT_ALLOWED_ENV_NAMES
    """Exceptions to ``reservedEnvPrefixes`` and ``reservedEnvNames``: names a job may set
    although a reserved prefix covers them (never the operator's own)."""
    allow_secret_env: bool = False
    """Whether an env var may take its value from a Secret (``valueFrom.secretKeyRef``). The
    template has no ``envFrom``; a Secret's keys reach the pods only through this or a
    ``secret`` volume."""
    allowed_capabilities: tuple[str, ...] = ()
    """Linux capabilities a job may add to its containers (the trainer, init and sidecar
    containers; each drops ``ALL`` first). Empty by default: Pod Security's ``restricted``
    and ``baseline`` levels refuse ``IPC_LOCK`` (NCCL over InfiniBand pins memory with it), so
    an admin who allows it also labels the GPU namespaces ``privileged``; a job asking for it
    elsewhere is refused when it is applied, not when its pods are. Never ``ALL`` or
    ``SYS_ADMIN`` (`NEVER_CAPABILITIES`)."""

    @field_validator("allowed_capabilities")
    @classmethod
    def _never_privileged(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = tuple(capability_name(c) for c in value)
        wrong = sorted(set(names) & set(NEVER_CAPABILITIES))
        if wrong:
            raise ValueError(f"{wrong}: a job's pods never run privileged, whatever the policy")
        return names

    @field_validator("allowed_volume_types")
    @classmethod
    def _no_projected(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        wrong = {"projected", "serviceAccountToken"} & set(value)
        if wrong:
            raise ValueError(
                f"{sorted(wrong)}: a projected volume is judged by its sources (list their "
                "types; a ServiceAccount token needs allowServiceAccountToken)"
            )
        return value

    @classmethod
    def from_json_text(cls, text: str) -> PodTemplatePolicy:
        """The policy of a JSON object (the chart's values as the operator's setting); the
        defaults for an empty text."""
        return cls.model_validate_json(text) if text.strip() else cls()


def env_reserved(name: str, policy: PodTemplatePolicy) -> str | None:
    """Why ``name`` may not be set in the trainer container (None: it may): ``"operator"``
    for the operator's own names, ``"policy"`` for the policy's."""
    if name in OPERATOR_ENV_NAMES or name.startswith(OPERATOR_ENV_PREFIXES):
        return "operator"
    if name in policy.allowed_env_names:
        return None
    if name in policy.reserved_env_names or name.startswith(policy.reserved_env_prefixes):
        return "policy"
    return None


def _way_out(setting: str, what: str) -> str:
    return (
        f"allowed only if the cluster admin sets {CHART_KEY}.{setting} {what} in the chart's values"
    )


def _volume_faults(
    volumes: list[dict[str, Any]], policy: PodTemplatePolicy, base: str
) -> list[Fault]:
    allowed = set(policy.allowed_volume_types)
    faults: list[Fault] = []
    for i, volume in enumerate(volumes):
        at = f"{base}.volumes[{i}]"
        for kind in sorted(k for k in volume if k != "name"):
            if kind == "projected":
                faults += _projected_faults(volume.get("projected"), policy, f"{at}.projected")
            elif kind not in allowed:
                faults.append(
                    Fault(
                        f"{at}.{kind}",
                        f"volume type {kind} is not allowed in the job's pods "
                        f"(allowed: {', '.join(policy.allowed_volume_types) or 'none'}); "
                        + _way_out("allowedVolumeTypes", f"to include {kind}"),
                    )
                )
    return faults


def _projected_faults(projected: Any, policy: PodTemplatePolicy, at: str) -> list[Fault]:
    sources = projected.get("sources") if isinstance(projected, Mapping) else None
    faults: list[Fault] = []
    for j, source in enumerate(sources if isinstance(sources, list) else []):
        for kind in sorted(source if isinstance(source, Mapping) else {}):
            where = f"{at}.sources[{j}].{kind}"
            if kind == "serviceAccountToken":
                if not policy.allow_service_account_token:
                    faults.append(
                        Fault(
                            where,
                            "a projected ServiceAccount token is not allowed in the job's pods; "
                            + _way_out("allowServiceAccountToken", "to true"),
                        )
                    )
            elif PROJECTED_SOURCES.get(kind, kind) not in policy.allowed_volume_types:
                faults.append(
                    Fault(
                        where,
                        f"a projected {kind} source is not allowed in the job's pods; "
                        + _way_out("allowedVolumeTypes", f"to include {kind}"),
                    )
                )
    return faults


def _account_faults(
    name: str | None, policy: PodTemplatePolicy, operator_account: str | None, at: str
) -> list[Fault]:
    if name is None:
        return []
    if operator_account and name == operator_account:
        return [
            Fault(
                at,
                f"{name!r} is the operator's own ServiceAccount: a job never runs under it, "
                "whatever the policy says",
            )
        ]
    if name == "default" or name in policy.allowed_service_accounts:
        return []
    allowed = ", ".join(["default", *policy.allowed_service_accounts])
    return [
        Fault(
            at,
            f"ServiceAccount {name!r} is not allowed for the job's pods (allowed: {allowed}); "
            + _way_out("allowedServiceAccounts", f"to include {name}"),
        )
    ]


def _env_faults(template: PodTemplate, policy: PodTemplatePolicy, base: str) -> list[Fault]:
    faults: list[Fault] = []
    containers = [
        *((f"{base}.containers[{c}]", x.env) for c, x in enumerate(template.spec.containers)),
        *(
            (f"{base}.initContainers[{c}]", x.env)
            for c, x in enumerate(template.spec.init_containers)
        ),
    ]
    for where, envs in containers:
        for i, env in enumerate(envs):
            at = f"{where}.env[{i}]"
            why = env_reserved(env.name, policy)
            if why == "operator":
                faults.append(Fault(f"{at}.name", f"{env.name} is the operator's own variable"))
            elif why == "policy":
                faults.append(
                    Fault(
                        f"{at}.name",
                        f"{env.name} is reserved (it loads code or changes the trainers' launch, "
                        "devices or connections); "
                        + _way_out("allowedEnvNames", f"to include {env.name}"),
                    )
                )
            ref = (env.value_from or {}).get("secretKeyRef")
            if ref is not None and not policy.allow_secret_env:
                faults.append(
                    Fault(
                        f"{at}.valueFrom.secretKeyRef",
                        "an env var from a Secret is not allowed in the job's pods; "
                        + _way_out("allowSecretEnv", "to true"),
                    )
                )
    return faults


def _capability_faults(template: PodTemplate, policy: PodTemplatePolicy, base: str) -> list[Fault]:
    allowed = set(policy.allowed_capabilities)
    faults: list[Fault] = []
    containers = [
        *(
            (f"{base}.containers[{c}]", x.security_context)
            for c, x in enumerate(template.spec.containers)
        ),
        *(
            (f"{base}.initContainers[{c}]", x.security_context)
            for c, x in enumerate(template.spec.init_containers)
        ),
    ]
    for where, security in containers:
        for i, name in enumerate(security.capabilities.add if security is not None else []):
            if capability_name(name) in allowed:
                continue
            never = capability_name(name) in NEVER_CAPABILITIES
            faults.append(
                Fault(
                    f"{where}.securityContext.capabilities.add[{i}]",
                    f"capability {name} is not allowed in the job's pods "
                    f"(allowed: {', '.join(policy.allowed_capabilities) or 'none'}); "
                    + (
                        "never allowed: a job's pods never run privileged"
                        if never
                        else _way_out("allowedCapabilities", f"to include {capability_name(name)}")
                    ),
                )
            )
    return faults


def policy_faults(
    template: PodTemplate | None,
    policy: PodTemplatePolicy,
    *,
    operator_service_account: str | None,
) -> list[Fault]:
    """Every way ``template`` (a job's ``spec.podTemplate``) breaks ``policy``, in field order:
    its volumes (a ``projected`` one by its sources), its ``serviceAccountName``, the env of the
    trainer and of every init or sidecar container (reserved names, values from Secrets) and
    the capabilities they add. Each fault names the exact field
    (``spec.podTemplate.spec.volumes[1].hostPath``) and the chart value that would allow it.

    ``operator_service_account``: the operator's own ServiceAccount's name (None: unknown, as
    in ``malleus check``), refused as ``serviceAccountName`` whatever the policy lists.
    """
    if template is None:
        return []
    base = "spec.podTemplate.spec"
    extra = template.spec
    return [
        *_volume_faults(extra.volumes, policy, base),
        *_account_faults(
            extra.service_account_name,
            policy,
            operator_service_account,
            f"{base}.serviceAccountName",
        ),
        *_env_faults(template, policy, base),
        *_capability_faults(template, policy, base),
    ]
