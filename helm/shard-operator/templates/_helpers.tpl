{{/* Names and labels shared by every template. */}}

{{- define "shard-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: "<release>-shard-operator", or just the release when it already says so. */}}
{{- define "shard-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "shard-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shard-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "shard-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "shard-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "shard-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shard-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag, or repository@digest when a digest is given. Usage: include "shard-operator.image" (list .Values.image .Chart.AppVersion) */}}
{{- define "shard-operator.image" -}}
{{- $image := index . 0 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default (index . 1) $image.tag) }}
{{- end }}
{{- end }}

{{/* Namespaces where ShardedModels (and so worker pods) live, as a list. */}}
{{- define "shard-operator.workloadNamespaces" -}}
{{- $namespaces := .Values.networkPolicy.namespaces | default .Values.watchNamespaces | default (list .Release.Namespace) }}
{{- toJson $namespaces }}
{{- end }}

{{/* A setting as an environment value: integers without the ".0" or exponent YAML numbers may get. */}}
{{- define "shard-operator.settingValue" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}
{{- int64 . | toString | quote }}
{{- else }}
{{- toString . | quote }}
{{- end }}
{{- end }}
