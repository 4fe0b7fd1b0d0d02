{{/* Names: the release's full name, then one suffix per object (-gateway, -replica, -etcd, ...). */}}
{{- define "router-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "router-sidecar.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "router-sidecar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "gateway"). etcd's Pods are named etcd. */}}
{{- define "router-sidecar.selectorLabels" -}}
{{- $name := include "router-sidecar.name" .ctx }}
{{- if hasPrefix "etcd" .component }}{{ $name = .component }}{{ end -}}
app.kubernetes.io/name: {{ $name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if not (hasPrefix "etcd" .component) }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{/* All labels of one component's objects. */}}
{{- define "router-sidecar.labels" -}}
{{ include "router-sidecar.selectorLabels" . }}
{{- if hasPrefix "etcd" .component }}
app.kubernetes.io/component: coordination
{{- end }}
app.kubernetes.io/part-of: router-sidecar
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
helm.sh/chart: {{ include "router-sidecar.chart" .ctx }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* An image reference from {repository, tag, digest}; the tag defaults to the chart's appVersion. */}}
{{- define "router-sidecar.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (toString (.image.tag | default .ctx.Chart.AppVersion)) }}
{{- end }}
{{- end }}

{{/* What --etcd gets: the chart's client Service, or etcd.endpoints. */}}
{{- define "router-sidecar.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "%s-etcd:2379" (include "router-sidecar.fullname" .) }}
{{- else if .Values.etcd.endpoints }}
{{- .Values.etcd.endpoints }}
{{- else }}
{{- fail "etcd: set etcd.endpoints to your etcd (HOST:PORT or http://HOST:PORT), or etcd.enabled=true for a StatefulSet in the release" }}
{{- end }}
{{- end }}

{{/* The endpoint picker's HOST:PORT, or a failure saying what is missing. */}}
{{- define "router-sidecar.endpointPickerAddress" -}}
{{- $epp := .Values.endpointPicker }}
{{- if $epp.address }}
{{- $epp.address }}
{{- else if $epp.container.enabled }}
{{- printf "127.0.0.1:%d" (int $epp.container.grpcPort) }}
{{- else }}
{{- fail "endpointPicker.enabled: set endpointPicker.address (HOST:PORT of the EPP's ext_proc server) or endpointPicker.container.enabled=true (the EPP in the gateway Pod)" }}
{{- end }}
{{- end }}

{{/* The InferencePool's name. */}}
{{- define "router-sidecar.inferencePoolName" -}}
{{- .Values.inferencePool.name | default (include "router-sidecar.fullname" .) }}
{{- end }}

{{/* The port the replicas are reached at (the agent's --advertise): the front's, or the engine's. */}}
{{- define "router-sidecar.replicaPort" -}}
{{- include "router-sidecar.advertisedPort" .Values.replica }}
{{- end }}

{{/* The same for a replica set's values (replica's, or a pool's merged over them). */}}
{{- define "router-sidecar.advertisedPort" -}}
{{- if .agent.front.enabled }}{{ int .agent.front.port }}{{ else }}{{ int .engine.port }}{{ end }}
{{- end }}

{{/* Value checks that hold for every render. */}}
{{- define "router-sidecar.validate" -}}
{{- if and .Values.endpointPicker.container.enabled (not .Values.endpointPicker.enabled) }}
{{- fail "endpointPicker.container.enabled needs endpointPicker.enabled=true" }}
{{- end }}
{{- if and .Values.endpointPicker.container.enabled .Values.endpointPicker.address }}
{{- fail "endpointPicker: set address or container.enabled, not both (the EPP in the Pod is reached on loopback)" }}
{{- end }}
{{- if and .Values.etcd.enabled .Values.etcd.endpoints }}
{{- fail "etcd: endpoints is for an etcd you run; with etcd.enabled=true the chart's own is used (unset one)" }}
{{- end }}
{{- if and .Values.etcd.enabled (lt (int .Values.etcd.replicaCount) 1) }}
{{- fail "etcd.replicaCount must be at least 1 (3 or 5 for a cluster that survives a member's loss)" }}
{{- end }}
{{- end }}
