"""``spec.podTemplate`` merged into a worker pod the operator built: one pure function.

A real GPU cluster needs what only its admin knows (node pools, RDMA devices, NCCL interfaces,
pull secrets, a scheduler), so a job may add to its pods; but the operator's pod is also the
job's contract (torchrun's command line, the control token and TLS identity, the hardening), so
what the operator set is never replaced (`apply_pod_template` lists who wins). The CRD keeps a
template from naming most of the operator's fields at all; this function is the guarantee.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from malleus.job.spec import GPU_RESOURCE, ContainerSecurity, ExtraContainer, PodTemplate

__all__ = ["OPERATOR_RESOURCES", "SHM_PATH", "apply_pod_template", "build_extra_container"]

OPERATOR_RESOURCES = frozenset({"cpu", "memory", GPU_RESOURCE})
"""Resources only ``spec.resources`` and ``spec.gpusPerNode`` set (the planner and the
one-process-per-GPU launch depend on them); a template's amounts for them are ignored (and the
CRD refuses them)."""

SHM_PATH = "/dev/shm"
"""The one operator mount a job may replace (NCCL's shared memory wants a size)."""
_SHM_VOLUME = "dshm"


def _affinity(ours: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job's affinity with the operator's required anti-affinity terms kept beside its own:
    a term list the job gives is extended, never replaced, so one worker per node still holds."""
    merged: dict[str, Any] = copy.deepcopy(dict(theirs or {}))
    for kind, rules in (ours or {}).items():
        target = merged.setdefault(kind, {})
        for when, terms in rules.items():
            target[when] = [*target.get(when, []), *copy.deepcopy(terms)]
    return merged


def _capabilities(security: ContainerSecurity | None) -> dict[str, Any]:
    """Every capability dropped, then the template's added back (the policy judged which)."""
    added = list(security.capabilities.add) if security is not None else []
    return {"drop": ["ALL"], **({"add": added} if added else {})}


def build_extra_container(extra: ExtraContainer) -> dict[str, Any]:
    """An init or sidecar container of ``spec.podTemplate.spec.initContainers``, hardened as
    the operator hardens the trainer: non-root, no privilege escalation, a read-only root
    filesystem (an emptyDir of the template's is where it writes), every capability dropped
    but those added (within the admin's policy); the pod's own securityContext (run-as user,
    seccomp) applies to it as to the trainer."""
    container: dict[str, Any] = {"name": extra.name, "image": extra.image}
    for key, value in (
        ("imagePullPolicy", extra.image_pull_policy),
        ("command", extra.command),
        ("args", extra.args),
        ("workingDir", extra.working_dir),
        ("restartPolicy", extra.restart_policy),
    ):
        if value:
            container[key] = copy.deepcopy(value)
    if extra.env:
        container["env"] = [e.model_dump(by_alias=True, exclude_none=True) for e in extra.env]
    if extra.volume_mounts:
        container["volumeMounts"] = [
            m.model_dump(by_alias=True, exclude_none=True) for m in extra.volume_mounts
        ]
    resources: dict[str, Any] = {}
    for kind, amounts in (
        ("requests", extra.resources.requests),
        ("limits", extra.resources.limits),
    ):
        kept = {
            k: str(v) for k, v in amounts.items() if k != GPU_RESOURCE
        }  # the trainer's GPUs only
        if kept:
            resources[kind] = kept
    if extra.resources.claims:
        resources["claims"] = [
            c.model_dump(by_alias=True, exclude_none=True) for c in extra.resources.claims
        ]
    if resources:
        container["resources"] = resources
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": _capabilities(extra.security_context),
    }
    return container


def apply_pod_template(pod: Mapping[str, Any], template: PodTemplate | None) -> dict[str, Any]:
    """``pod`` (the operator's, from `workers.build_pod`) with ``template`` merged in, key by
    key; a new dict (``pod`` is not changed).

    - **The operator wins**: the pod's name, namespace, ownerReferences and the labels and
      annotations it sets (its selector labels, the scrape annotations); the trainer
      container's name, image, command, ports and every env var it sets (``MALLEUS_*``,
      ``POD_IP``, ``HOME``, ...); the pod and container security contexts; ``restartPolicy``,
      ``hostname``/``subdomain``, ``automountServiceAccountToken: false`` (no
      token is automounted; a projected token volume is refused by the pod template policy,
      `malleus.job.podpolicy`, unless the admin allows it); its volumes (config, control-tls, tmp,
      checkpoints) and their mount paths; the `OPERATOR_RESOURCES` amounts; its GPU toleration
      and one-worker-per-node anti-affinity (kept beside the template's terms).
    - **The template adds**: labels, annotations, ``nodeSelector``, affinity terms,
      tolerations, ``imagePullSecrets``, ``serviceAccountName``, ``priorityClassName``,
      ``schedulerName``, volumes, and the trainer's env, volumeMounts and other resources
      (``rdma/hca``) and resource claims; the pod's ``runtimeClassName``,
      ``topologySpreadConstraints``, ``resourceClaims`` and ``dnsConfig`` (the operator sets
      none of them); capabilities added to the trainer's (``IPC_LOCK``; the operator's
      ``drop: [ALL]`` and the rest of its security context stay); init and native sidecar
      containers (`build_extra_container`: hardened like the trainer, the trainer's name
      never theirs).
    - **The template replaces** the operator's ``/dev/shm`` (an unsized memory emptyDir) by
      mounting a volume of its own there (a ``sizeLimit``-ed one, say).
    """
    merged: dict[str, Any] = copy.deepcopy(dict(pod))
    if template is None:
        return merged
    meta, spec = merged["metadata"], merged["spec"]
    meta["labels"] = {**template.metadata.labels, **meta.get("labels", {})}
    meta["annotations"] = {**template.metadata.annotations, **meta.get("annotations", {})}
    extra = template.spec
    if extra.node_selector:
        spec["nodeSelector"] = {**extra.node_selector, **spec.get("nodeSelector", {})}
    if extra.affinity or spec.get("affinity"):
        spec["affinity"] = _affinity(spec.get("affinity"), extra.affinity)
    tolerations = list(spec.get("tolerations", []))
    tolerations += [dict(t) for t in extra.tolerations if t not in tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    if extra.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in extra.image_pull_secrets]
    for key, value in (
        ("serviceAccountName", extra.service_account_name),
        ("priorityClassName", extra.priority_class_name),
        ("schedulerName", extra.scheduler_name),
        ("runtimeClassName", extra.runtime_class_name),
    ):
        if value:
            spec[key] = value
    for key, items in (
        ("topologySpreadConstraints", extra.topology_spread_constraints),
        ("resourceClaims", extra.resource_claims),
    ):
        if items:
            spec[key] = [*spec.get(key, []), *copy.deepcopy(items)]
    if extra.dns_config:
        spec["dnsConfig"] = copy.deepcopy(extra.dns_config)
    container = spec["containers"][0]
    ours_named = {c["name"] for c in spec["containers"]}
    inits = [build_extra_container(c) for c in extra.init_containers if c.name not in ours_named]
    if inits:
        spec["initContainers"] = [*spec.get("initContainers", []), *inits]
    trainer = template.trainer()
    mounts: list[dict[str, Any]] = container["volumeMounts"]
    taken = {m["mountPath"] for m in mounts}
    theirs = [m.model_dump(by_alias=True, exclude_none=True) for m in trainer.volume_mounts]
    if any(m["mountPath"] == SHM_PATH for m in theirs):
        mounts[:] = [m for m in mounts if m["mountPath"] != SHM_PATH]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != _SHM_VOLUME]
        taken.discard(SHM_PATH)
    mounts += [m for m in theirs if m["mountPath"] not in taken]
    names = {v["name"] for v in spec["volumes"]}
    spec["volumes"] += [copy.deepcopy(v) for v in extra.volumes if v.get("name") not in names]

    env: list[dict[str, Any]] = container["env"]
    ours = {e["name"] for e in env}
    env += [
        e.model_dump(by_alias=True, exclude_none=True) for e in trainer.env if e.name not in ours
    ]
    resources = container.setdefault("resources", {})
    for kind, amounts in (
        ("requests", trainer.resources.requests),
        ("limits", trainer.resources.limits),
    ):
        if amounts:
            added = {k: str(v) for k, v in amounts.items() if k not in OPERATOR_RESOURCES}
            resources[kind] = {**added, **resources.get(kind, {})}
    if trainer.resources.claims:
        resources["claims"] = [
            c.model_dump(by_alias=True, exclude_none=True) for c in trainer.resources.claims
        ]
    if trainer.security_context is not None and trainer.security_context.capabilities.add:
        hardening = container.setdefault("securityContext", {})
        hardening["capabilities"] = {
            **_capabilities(trainer.security_context),
            "drop": ["ALL"],  # whatever the operator's said, never less than all
        }
    return merged
