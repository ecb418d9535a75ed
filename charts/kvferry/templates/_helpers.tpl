{{/* Name prefix of every object of this release. */}}
{{- define "kvferry.fullname" -}}
{{- printf "%s-kvferry" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; pass (dict "root" $ "component" "operator"). */}}
{{- define "kvferry.labels" -}}
app.kubernetes.io/name: kvferry
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* Selector labels (immutable) of one component. */}}
{{- define "kvferry.selectorLabels" -}}
app.kubernetes.io/name: kvferry
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvferry.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "kvferry.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The operator's permissions, one rule per kind (see operator-rbac.yaml):
- InferenceServices: kopf lists and watches them and patches its bookkeeping annotations; a
  child's event reads its owner; status is a subresource.
- Children: listed by label and watched, written by server-side apply (patch, plus create
  for an apply that creates), deleted when a spec no longer asks for them. The ConfigMap is
  never deleted.
- Secrets: read by name (the ones a spec names, the managed Redis password), the password
  created once and deleted with the managed Redis; never listed or watched.
- Events: kopf reports warnings as Kubernetes Events.
*/}}
{{- define "kvferry.operator.rules" -}}
- apiGroups: [kvferry.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvferry.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, networkpolicies]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list, watch, create, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
