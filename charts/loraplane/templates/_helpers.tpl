{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplane.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplane
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "operator") */}}
{{- define "loraplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplane.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* An image reference; the tag defaults to the chart's appVersion: (dict "root" $ "image" .Values.x.image) */}}
{{- define "loraplane.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "loraplane.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "loraplane.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplane.objectStoreName" -}}
{{- printf "%s-object-store" (include "loraplane.fullname" .) }}
{{- end }}

{{- define "loraplane.objectStoreSecret" -}}
{{- default (include "loraplane.objectStoreName" .) .Values.objectStore.existingSecret }}
{{- end }}

{{/* A random value kept across upgrades: the live Secret's key when there is one (lookup is
empty offline and on first install). (dict "root" $ "secret" name "key" key "length" n) */}}
{{- define "loraplane.keptRandom" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .secret }}
{{- $data := dig "data" (dict) $live }}
{{- if hasKey $data .key }}
{{- index $data .key | b64dec }}
{{- else }}
{{- randAlphaNum .length }}
{{- end }}
{{- end }}

{{/* Every container here runs with these; the images run as a numeric non-root user. */}}
{{- define "loraplane.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end }}

{{- define "loraplane.podSecurity" -}}
runAsNonRoot: true
seccompProfile:
  type: RuntimeDefault
{{- end }}


{{/* "true" when the operator runs as peered replicas (operator.replicas >= 2), else empty. One
replica (or 0) runs --standalone: no peering objects, no kopf.dev rules, a Recreate rollout. */}}
{{- define "loraplane.operatorPeered" -}}
{{- if ge (int .Values.operator.replicas) 2 }}true{{ end }}
{{- end }}

{{/* The peering kind kopf uses for the watch mode (kopf's peering.guess_selectors): cluster-wide
operators peer through a ClusterKopfPeering, namespaced ones (--namespace) through a KopfPeering
in each namespace they watch. */}}
{{- define "loraplane.peeringKind" -}}
{{- if .Values.operator.watchNamespaces }}KopfPeering{{ else }}ClusterKopfPeering{{ end }}
{{- end }}

{{/* The peering object's name, the operator's --peering value. */}}
{{- define "loraplane.peeringName" -}}
{{- include "loraplane.fullname" . }}
{{- end }}

{{/* "true" when Helm can map the peering kind now: the cluster serves it. A custom resource whose
CRD is created by the same release cannot be built by Helm, so the peering object renders only
from the install or upgrade after the one that registered its CRD. */}}
{{- define "loraplane.peeringServed" -}}
{{- if .Capabilities.APIVersions.Has (printf "kopf.dev/v1/%s" (include "loraplane.peeringKind" .)) }}true{{ end }}
{{- end }}
