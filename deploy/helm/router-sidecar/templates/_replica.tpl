{{/* The objects of one replica set: the chart's own (values: replica) and each of replicaPools, another
model's replicas (a fallback pool). Called with (dict "ctx" $ "r" VALUES "component" NAME ...): VALUES are
the set's values (a pool's merged over replica's), NAME its objects' suffix and component label. */}}

{{/* The Deployment: (dict "ctx" $ "r" VALUES "component" NAME "fingerprintConfigMap" SUFFIX
"fingerprintChecksum" SHA256 "pool" POOL-NAME-OR-EMPTY). */}}
{{- define "router-sidecar.replicaDeployment" -}}
{{- $ctx := .ctx }}
{{- $r := .r }}
{{- $component := .component }}
{{- $fullname := include "router-sidecar.fullname" $ctx }}
{{- $front := $r.agent.front }}
{{- $port := include "router-sidecar.advertisedPort" $r }}
{{- $restricted := toYaml $ctx.Values.containerSecurityContext }}
# One engine replica per Pod: vLLM plus `router-sidecar replica`, the agent that registers the replica in
# etcd (with its compatibility fingerprint) for as long as the engine answers. Gateways find replicas in
# that registry (served to Envoy over EDS), not through a Service, so there is none.
#
# The agent is a native sidecar: it starts before the engine, probes it, registers it once it is healthy,
# and withdraws it when it stops answering or when the agent itself is stopped.
{{- with .pool }}
#
# Replica pool {{ . }} (values: replicaPools): another model's replicas beside the chart's own, e.g.
# the model the policy's fallback.models names; registered like any replica, gateways find them there.
{{- end }}
{{- if $front.enabled }}
#
# Replica-side fence (docs/replica-fence.md): the agent fronts the engine with its own Envoy on :{{ $front.port }} and
# stops an attempt's stream itself when its lease is revoked or about to expire, so the gateway's fence is
# proven by a cancel ack instead of waiting out the lease. The engine listens on loopback only: every
# request has to pass the fence.
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ $component }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "router-sidecar.labels" (dict "ctx" $ctx "component" $component) | nindent 4 }}
spec:
  replicas: {{ $r.replicaCount }}
  selector:
    matchLabels:
      {{- include "router-sidecar.selectorLabels" (dict "ctx" $ctx "component" $component) | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  template:
    metadata:
      labels:
        {{- include "router-sidecar.labels" (dict "ctx" $ctx "component" $component) | nindent 8 }}
        {{- with $r.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        kubectl.kubernetes.io/default-container: engine
        checksum/fingerprint: {{ .fingerprintChecksum }}
        checksum/etcd: {{ include (print $ctx.Template.BasePath "/configmap-etcd.yaml") $ctx | sha256sum }}
        {{- with $r.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      {{- with $ctx.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $r.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $ctx.Values.podSecurityContext | nindent 8 }}
      {{- with $r.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $r.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $r.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      initContainers:
        - name: replica-agent
          image: {{ include "router-sidecar.image" (dict "ctx" $ctx "image" $ctx.Values.image) }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          restartPolicy: Always
          command: ["router-sidecar"]
          {{- if $front.enabled }}
          # The agent's Envoy takes the gateways' requests on :{{ $front.port }}; the engine is on loopback.
          {{- else }}
          # The engine listens on the Pod IP; gateways route to the advertised address directly.
          {{- end }}
          args:
            - replica
            - --engine
            - 127.0.0.1:{{ $r.engine.port }}
            {{- if $front.enabled }}
            - --front
            - 0.0.0.0:{{ $front.port }}
            {{- end }}
            - --advertise
            - $(POD_IP):{{ $port }}
            - --etcd
            - $(ROUTER_SIDECAR_ETCD)
            - --fingerprint
            - /etc/router-sidecar/fingerprint.yaml
            - --ttl
            - {{ $r.agent.ttl | quote }}
            - --interval
            - {{ $r.agent.interval | quote }}
            {{- if $front.enabled }}
            - --fence-margin
            - {{ $front.fenceMargin | quote }}
            {{- end }}
          {{- if $front.enabled }}
          ports:
            - {name: front, containerPort: {{ $front.port }}, protocol: TCP}
          {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef: {fieldPath: status.podIP}
            - name: ROUTER_SIDECAR_ETCD
              valueFrom:
                configMapKeyRef: {name: {{ $fullname }}-etcd, key: ROUTER_SIDECAR_ETCD}
          securityContext:
            {{- $restricted | nindent 12 }}
          resources:
            {{- toYaml (ternary $front.resources $r.agent.resources $front.enabled) | nindent 12 }}
          volumeMounts:
            - {name: fingerprint, mountPath: /etc/router-sidecar, readOnly: true}
            - {name: agent-tmp, mountPath: /tmp}
      containers:
        - name: engine
          image: {{ include "router-sidecar.image" (dict "ctx" $ctx "image" $r.engine.image) }}
          imagePullPolicy: {{ $r.engine.image.pullPolicy }}
          command: ["vllm"]
          # The model: state the same model_id (and revision, dtype, ...) in the fingerprint: the agent
          # refuses to register a replica whose file and engine disagree.
          args:
            - serve
            - {{ $r.engine.model }}
            - --host
            - {{ ternary "127.0.0.1" "0.0.0.0" $front.enabled }}
            - --port
            - {{ $r.engine.port | quote }}
            {{- with $r.engine.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with $r.engine.env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- if not $front.enabled }}
          ports:
            - {name: engine, containerPort: {{ $r.engine.port }}, protocol: TCP}
          {{- else }}
          # Loopback only: nothing outside the Pod connects to it.
          {{- end }}
          # exec probes on loopback, so the same probes hold when the engine listens on 127.0.0.1 behind the
          # replica-side Envoy. Loading a model takes minutes: a long startupProbe.
          startupProbe:
            exec:
              command: &engine-health
                - python3
                - -c
                - "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{{ $r.engine.port }}/health', timeout=2)"
            {{- toYaml $r.engine.startupProbe | nindent 12 }}
          readinessProbe:
            exec:
              command: *engine-health
            {{- toYaml $r.engine.readinessProbe | nindent 12 }}
          livenessProbe:
            exec:
              command: *engine-health
            {{- toYaml $r.engine.livenessProbe | nindent 12 }}
          securityContext:
            {{- $restricted | nindent 12 }}
          resources:
            {{- toYaml $r.engine.resources | nindent 12 }}
          volumeMounts:
            - {name: models, mountPath: /models}
            - {name: engine-home, mountPath: /home/engine}
            - {name: engine-tmp, mountPath: /tmp}
            - {name: dshm, mountPath: /dev/shm}
      volumes:
        - name: fingerprint
          configMap:
            name: {{ $fullname }}-{{ .fingerprintConfigMap }}
        - name: agent-tmp
          emptyDir: {sizeLimit: 64Mi}
        # The weights (replica.engine.modelsVolume): a PersistentVolumeClaim or a pre-populated volume
        # keeps a restart from downloading them again.
        - name: models
          {{- toYaml $r.engine.modelsVolume | nindent 10 }}
        - name: engine-home
          emptyDir: {sizeLimit: 8Gi}
        - name: engine-tmp
          emptyDir: {sizeLimit: 8Gi}
        # PyTorch's worker processes share tensors through /dev/shm; the runtime's default is 64 MiB.
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ $r.engine.shmSizeLimit }}}
{{- end }}

{{/* What the engine cannot report about itself: (dict "ctx" $ "name" SUFFIX "fingerprint" MAP "what"
VALUES-KEY), the ConfigMap <fullname>-SUFFIX. */}}
{{- define "router-sidecar.fingerprintConfigMap" -}}
# What the engine cannot report about itself (values: {{ .what }}, docs/replica-agent.md).
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "router-sidecar.fullname" .ctx }}-{{ .name }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "router-sidecar.labels" (dict "ctx" .ctx "component" "config") | nindent 4 }}
data:
  fingerprint.yaml: |
    {{- toYaml .fingerprint | nindent 4 }}
{{- end }}

{{/* Only gateways reach a replica set's engines: (dict "ctx" $ "component" NAME "port" PORT). */}}
{{- define "router-sidecar.replicaNetworkPolicy" -}}
# Only gateways reach the engines: an engine answers anyone who connects, and a request that bypasses the
# gateway is neither journaled nor fenced. (Admit your metrics scraper with networkPolicy.replicaExtraFrom.)
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "router-sidecar.fullname" .ctx }}-{{ .component }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "router-sidecar.labels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "router-sidecar.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 6 }}
  policyTypes: ["Ingress"]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              {{- include "router-sidecar.selectorLabels" (dict "ctx" .ctx "component" "gateway") | nindent 14 }}
        {{- with .ctx.Values.networkPolicy.replicaExtraFrom }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - {protocol: TCP, port: {{ .port }}}
{{- end }}
