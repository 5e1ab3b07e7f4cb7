{{/* Chart name (or nameOverride), truncated to a DNS label. */}}
{{- define "malleus-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name, the prefix of every object's name: fullnameOverride, else release-name, or the
release name alone when it already holds the name.
*/}}
{{- define "malleus-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "malleus-operator.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "malleus-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "malleus-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Labels of every object the chart makes: commonLabels and the chart's own, which win on a
clash (so commonLabels cannot break a selector).
*/}}
{{- define "malleus-operator.labels" -}}
{{- $own := include "malleus-operator.selectorLabels" . | fromYaml -}}
{{- $_ := set $own "helm.sh/chart" (printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-") -}}
{{- $_ = set $own "app.kubernetes.io/version" .Chart.AppVersion -}}
{{- $_ = set $own "app.kubernetes.io/component" "operator" -}}
{{- $_ = set $own "app.kubernetes.io/part-of" "malleus" -}}
{{- $_ = set $own "app.kubernetes.io/managed-by" .Release.Service -}}
{{- toYaml (merge $own (deepCopy (.Values.commonLabels | default dict))) -}}
{{- end -}}

{{/* The operator pod's labels: its selector labels (which win), podLabels, commonLabels. */}}
{{- define "malleus-operator.podLabels" -}}
{{- $own := include "malleus-operator.selectorLabels" . | fromYaml -}}
{{- $extra := merge (deepCopy (.Values.podLabels | default dict)) (deepCopy (.Values.commonLabels | default dict)) -}}
{{- toYaml (merge $own $extra) -}}
{{- end -}}

{{- define "malleus-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "malleus-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "malleus-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Rules for the namespaced objects the operator handles: MalleusJobs and the children it makes.
Least privilege: exactly the verbs malleus.operator (kopf + k8s.py) uses.
*/}}
{{- define "malleus-operator.namespacedRules" -}}
# MalleusJobs: kopf watches them and patches its finalizer and progress annotations.
- apiGroups: ["malleus.io"]
  resources: ["malleusjobs"]
  verbs: ["get", "list", "watch", "patch"]
# Their status: phase, conditions, plan, stragglers, lastReplan.
- apiGroups: ["malleus.io"]
  resources: ["malleusjobs/status"]
  verbs: ["get", "patch"]
# Worker pods: created per job, watched for failures, deleted with the job.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "get", "list", "watch", "delete"]
# The headless Service: created, read by name, deleted with the job.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "get", "delete"]
# The job's Secret (its token and TLS certificates): created, read by name (never listed:
# listing Secrets would reveal every Secret's contents), patched when the certificates are
# renewed, deleted with the job.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "get", "patch", "delete"]
# The plan ConfigMap: rewritten at every re-plan.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "get", "patch", "delete"]
# Events on MalleusJobs (StragglerDetected, Replanned, Migrated, PodFailed, ...).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The per-job PodDisruptionBudget (a drain must not evict one worker of a running job):
# created, read by name, deleted with the job.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "get", "delete"]
{{- if .Values.metrics.podMonitor.enabled }}
# The per-job PodMonitor (metrics.podMonitor: the job's trainers scraped over HTTPS verified
# against the job's CA): created, read by name; the garbage collector deletes it with its job.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["create", "get"]
{{- end }}
{{- if .Values.networkPolicy.enabled }}
# The per-job NetworkPolicy (only the job's pods reach its rendezvous store and control port):
# created, read by name, deleted with the job.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get", "delete"]
{{- end }}
{{- if .Values.rbac.kueue }}
# Kueue Workloads (a job labelled kueue.x-k8s.io/queue-name is one Workload): created, read
# by name; their status patched to give an evicted job's quota back and to finish a finished
# job's; the garbage collector deletes them with their job.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["create", "get"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- with .Values.rbac.podGroups }}
{{- if .schedulerPlugins }}
# scheduler-plugins' PodGroups (spec.scheduling.podGroup.create): created, read by name; the
# garbage collector deletes them with their job.
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "get"]
{{- end }}
{{- if .volcano }}
# Volcano's PodGroups (spec.scheduling.podGroup.create): created, read by name; the garbage
# collector deletes them with their job.
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["create", "get"]
{{- end }}
{{- end }}
{{- if and (eq (include "malleus-operator.peering" .) "true") (not .Values.rbac.clusterWide) }}
# kopf peering: the KopfPeering of each watched namespace (read, watched, heartbeat patched).
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}

{{/*
The namespaces the operator watches without rbac.clusterWide, as a JSON list: the release
namespace, then every watchNamespaces entry (duplicates dropped).
*/}}
{{- define "malleus-operator.namespaces" -}}
{{- prepend .Values.watchNamespaces .Release.Namespace | uniq | toJson -}}
{{- end -}}

{{/* The operator pod's selector labels as k=v,k=v (its per-job NetworkPolicies admit it). */}}
{{- define "malleus-operator.selectorLabelsCsv" -}}
{{- $pairs := list -}}
{{- range $k, $v := include "malleus-operator.selectorLabels" . | fromYaml -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Cluster-scoped reads kopf needs to discover resources and namespaces; with peering
cluster-wide, its ClusterKopfPeering (kopf reads it and patches its own heartbeat into it). */}}
{{- define "malleus-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- if .Values.rbac.kueue }}
# The value of a queued job's WorkloadPriorityClass (kueue.x-k8s.io/priority-class), read by
# name: Kueue orders and preempts Workloads by the priority their maker sets.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloadpriorityclasses"]
  verbs: ["get"]
{{- end }}
{{- if and (eq (include "malleus-operator.peering" .) "true") .Values.rbac.clusterWide }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}

{{/* "true" when kopf peering (leader election) is on: peering.enabled, or, left null, more
than one replica. */}}
{{- define "malleus-operator.peering" -}}
{{- if kindIs "invalid" .Values.peering.enabled -}}
{{- gt (int .Values.replicaCount) 1 -}}
{{- else -}}
{{- .Values.peering.enabled -}}
{{- end -}}
{{- end -}}

{{/* Prefix of the aggregated user ClusterRoles (PREFIX-edit, PREFIX-view). */}}
{{- define "malleus-operator.userRolePrefix" -}}
{{- default "malleus" .Values.rbac.userRoles.namePrefix | trunc 58 | trimSuffix "-" -}}
{{- end -}}

{{/* A map as "k=v,k=v" (settings the operator reads from one environment variable). */}}
{{- define "malleus-operator.csv" -}}
{{- $pairs := list -}}
{{- range $k, $v := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
