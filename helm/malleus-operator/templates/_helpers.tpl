{{/* Chart name, truncated to a DNS label. */}}
{{- define "malleus-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release-chart, or the release name when it already holds the chart name. */}}
{{- define "malleus-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "malleus-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "malleus-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "malleus-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "malleus-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: malleus
app.kubernetes.io/managed-by: {{ .Release.Service }}
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
# The headless Service and the control-token Secret: created, read by name (never listed:
# listing Secrets would reveal every Secret's contents), deleted with the job.
- apiGroups: [""]
  resources: ["services", "secrets"]
  verbs: ["create", "get", "delete"]
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
{{- if .Values.networkPolicy.enabled }}
# The per-job NetworkPolicy (only the job's pods reach its rendezvous store and control port):
# created, read by name, deleted with the job.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get", "delete"]
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

{{/* Cluster-scoped reads kopf needs to discover resources and namespaces. */}}
{{- define "malleus-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end -}}
