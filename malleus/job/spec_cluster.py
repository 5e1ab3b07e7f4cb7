"""The MalleusJob spec's cluster sections: the pod template, the run policy and scheduling.

How the job's pods are shaped (`PodTemplate`: labels, env, volumes, node selection merged into
every worker pod), how long the job may run and its objects outlive it (`RunPolicy`), and how
its pods get places on nodes (`SchedulingSpec`, a coscheduler's `PodGroupSpec`). Only the
operator reads them; `malleus run` and the trainers never do. Apart from `malleus.job.spec`
(which holds the training, model and control-loop sections and `MalleusJobSpec` itself) so
that each reads on its own; every name here is importable from `malleus.job.spec` too, and the
same rule holds for defaults (they live in the CRD; see `malleus.job.spec`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .spec_base import StrictModel

__all__ = [
    "GPU_RESOURCE",
    "Capabilities",
    "ContainerOverride",
    "ContainerResources",
    "ContainerSecurity",
    "EnvVar",
    "ExtraContainer",
    "LocalObjectReference",
    "PodGroupApi",
    "PodGroupSpec",
    "PodSpecOverride",
    "PodTemplate",
    "PodTemplateMetadata",
    "ResourceClaimRef",
    "ResourceOverride",
    "RunPolicy",
    "SchedulingSpec",
    "VolumeMount",
]


GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource a GPU node offers (NVIDIA's device plugin): the trainer's alone."""


class PodTemplateMetadata(StrictModel):
    """Labels and annotations added to every worker pod (the operator's own keys win)."""

    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class EnvVar(StrictModel):
    """A core/v1 EnvVar for the trainer container; ``value_from`` is kept as Kubernetes reads it."""

    name: str
    value: str | None = None
    value_from: dict[str, Any] | None = None


class VolumeMount(StrictModel):
    """A core/v1 VolumeMount of one of the override's volumes."""

    name: str
    mount_path: str
    sub_path: str | None = None
    read_only: bool | None = None


class ResourceClaimRef(StrictModel):
    """A container's use of one of the pod's ``resourceClaims`` (dynamic resource allocation),
    by the claim's name in the pod (and one request of it)."""

    name: str
    request: str | None = None


class ResourceOverride(StrictModel):
    """Extra requests/limits (``rdma/hca``, hugepages): device plugins' resources the operator
    does not know; cpu, memory and ``nvidia.com/gpu`` stay the operator's. ``claims``: the
    pod's ``resourceClaims`` this container uses (a DRA NIC, say)."""

    requests: dict[str, int | str] = Field(default_factory=dict)
    limits: dict[str, int | str] = Field(default_factory=dict)
    claims: list[ResourceClaimRef] = Field(default_factory=list)


class Capabilities(StrictModel):
    """Linux capabilities added to a container; the operator drops ``ALL`` first, always.
    Only those the cluster admin's policy allows (``podTemplatePolicy.allowedCapabilities``)."""

    add: list[str] = Field(default_factory=list)


class ContainerSecurity(StrictModel):
    """The one part of a container's securityContext a job may ask for: capabilities to add
    (``IPC_LOCK`` for NCCL over InfiniBand). Everything else (privileged, running as root,
    privilege escalation, the root filesystem) is the operator's hardening and has no field."""

    capabilities: Capabilities = Field(default_factory=Capabilities)


class ContainerOverride(StrictModel):
    """Additions to the trainer container (the pod's only container)."""

    name: Literal["trainer"]
    env: list[EnvVar] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    resources: ResourceOverride = Field(default_factory=ResourceOverride)
    security_context: ContainerSecurity | None = None


class ContainerResources(StrictModel):
    """An init or sidecar container's own requests and limits (cpu and memory are its own;
    ``nvidia.com/gpu`` never: the job's GPUs are the trainer's)."""

    requests: dict[str, int | str] = Field(default_factory=dict)
    limits: dict[str, int | str] = Field(default_factory=dict)
    claims: list[ResourceClaimRef] = Field(default_factory=list)


class ExtraContainer(StrictModel):
    """An init container of the worker pods, or a native sidecar (``restartPolicy: Always``:
    started before the trainer, running beside it, stopped after it). The operator hardens it
    as it hardens the trainer (non-root, no privilege escalation, every capability dropped but
    those the policy lets the job add; the pod's seccomp profile); its env and the volumes it
    mounts pass the same policy as the trainer's."""

    name: str
    image: str
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    command: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list)
    working_dir: str | None = None
    env: list[EnvVar] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    resources: ContainerResources = Field(default_factory=ContainerResources)
    restart_policy: Literal["Always"] | None = None
    """``Always``: a native sidecar (Kubernetes >= 1.29), else a plain init container that runs
    to completion before the trainer starts."""
    security_context: ContainerSecurity | None = None


class LocalObjectReference(StrictModel):
    """A Secret in the job's namespace, by name (an image pull secret)."""

    name: str


class PodSpecOverride(StrictModel):
    """The pod spec fields a job may set; deep Kubernetes types (affinity, tolerations,
    volumes) are kept as given, for the API server to judge when the pod is created."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    affinity: dict[str, Any] | None = None
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    service_account_name: str | None = None
    priority_class_name: str | None = None
    scheduler_name: str | None = None
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    containers: list[ContainerOverride] = Field(default_factory=list)
    init_containers: list[ExtraContainer] = Field(default_factory=list)
    """Run before the trainer (a fabric check, a model prefetch), or beside it with
    ``restartPolicy: Always`` (a log shipper, a metrics agent)."""
    runtime_class_name: str | None = None
    """The container runtime handler (``nvidia`` where the GPU runtime is not the default)."""
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list)
    """core/v1 TopologySpreadConstraints (spread over racks or fabric blocks)."""
    resource_claims: list[dict[str, Any]] = Field(default_factory=list)
    """core/v1 PodResourceClaims (dynamic resource allocation: RDMA NICs, IMEX channels); a
    container uses one by naming it in its ``resources.claims``."""
    dns_config: dict[str, Any] | None = None
    """core/v1 PodDNSConfig (nameservers, searches, options such as ``ndots``), added to the
    cluster's DNS settings (the pods keep ``dnsPolicy: ClusterFirst``)."""

    @field_validator("init_containers")
    @classmethod
    def _not_the_trainer(cls, value: list[ExtraContainer]) -> list[ExtraContainer]:
        names = [c.name for c in value]
        if "trainer" in names or len(set(names)) != len(names):
            raise ValueError("init container names must be unique and not trainer")
        for c in value:
            if any(
                GPU_RESOURCE in amounts for amounts in (c.resources.requests, c.resources.limits)
            ):
                raise ValueError(f"init container {c.name}: the job's GPUs are the trainer's")
        return value


class PodTemplate(StrictModel):
    """A PodTemplateSpec-shaped override merged into every worker pod (`operator/workers.py`
    says which of the operator's fields win)."""

    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata)
    spec: PodSpecOverride = Field(default_factory=PodSpecOverride)

    def trainer(self) -> ContainerOverride:
        """The trainer container's override (empty when none is given)."""
        return (
            self.spec.containers[0] if self.spec.containers else ContainerOverride(name="trainer")
        )


class RunPolicy(StrictModel):
    """How long a job may run, and how long its objects outlive it (unset: no limit)."""

    active_deadline_seconds: int | None = None
    """Fail the job once it has run this long since its pods were created."""
    ttl_seconds_after_finished: int | None = None
    """Delete the job's children this long after it Succeeded or Failed (the job stays)."""


PodGroupApi = Literal["scheduler-plugins", "volcano"]


class PodGroupSpec(StrictModel):
    """The pod group a coscheduler admits as one gang (Volcano, scheduler-plugins): the operator
    labels and annotates every worker with ``name``. With ``create`` it also creates the
    PodGroup object (``minMember`` = ``spec.nodes``, owned by the job); without, the PodGroup is
    the installer's (or the scheduler's) to create."""

    name: str
    create: PodGroupApi | None = None
    """Which PodGroup the operator creates: scheduler-plugins' ``scheduling.x-k8s.io/v1alpha1``
    or Volcano's ``scheduling.volcano.sh/v1beta1`` (unset: none)."""
    queue: str | None = None
    """The Volcano queue of the PodGroup (``create: volcano`` only; unset: Volcano's default)."""


class SchedulingSpec(StrictModel):
    """How the job's pods get (or fail to get) places on nodes."""

    schedule_timeout_seconds: int = 600
    """Fail the job (reason ``ScheduleTimeout``) when its pods are not all running this long
    after they were created: a gang that got half its GPUs must not hold them forever."""
    pod_group: PodGroupSpec | None = None
    """Label every worker for a coscheduler's PodGroup (unset: none)."""
