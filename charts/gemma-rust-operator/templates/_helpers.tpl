{{/*
Names and labels shared by every template. Kept small on purpose (cert-manager's and
prometheus-node-exporter's charts are the model): selector labels are separate from the full label set
and never carry a version, because a Deployment's selector is immutable.
*/}}

{{/* The chart name, or nameOverride. Truncated to 63 characters, the label value limit. */}}
{{- define "gemma-rust-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource name prefix: fullnameOverride, or the release name when it already contains the chart
name (helm install gemma-rust-operator ...), or "<release>-<chart>".
*/}}
{{- define "gemma-rust-operator.fullname" -}}
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

{{/* Labels that select the operator pod: stable across upgrades, so no version. */}}
{{- define "gemma-rust-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gemma-rust-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every object's labels: the selector labels plus chart, version and manager. */}}
{{- define "gemma-rust-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "gemma-rust-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gemma-rust-operator
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "gemma-rust-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gemma-rust-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: set the name of an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: a digest wins over a tag; the tag defaults to the chart's appVersion. */}}
{{- define "gemma-rust-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Namespaces where GemmaRustServers run, for the NetworkPolicies: the release's by default. */}}
{{- define "gemma-rust-operator.serverNamespaces" -}}
{{- if .Values.networkPolicy.namespaces }}
{{- toJson .Values.networkPolicy.namespaces }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}
