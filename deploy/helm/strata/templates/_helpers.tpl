{{/* Names and labels */}}
{{- define "strata.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "strata.labels" -}}
{{ include "strata.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Values the schema cannot relate: refused with the fix, never ignored */}}
{{- define "strata.check" -}}
{{- $v := .Values -}}
{{- if eq $v.engine.device "cuda" -}}
{{- $gpus := mul $v.gpu.count (ternary $v.multiNode.size 1 $v.multiNode.enabled) -}}
{{- if ne (int $v.engine.tensorParallelSize) (int $gpus) -}}
{{- fail (printf "engine.tensorParallelSize=%v but a replica has %v GPUs (gpu.count x multiNode.size): make them equal (strata deploy render does)" $v.engine.tensorParallelSize $gpus) -}}
{{- end -}}
{{- else if gt (int $v.engine.tensorParallelSize) 1 -}}
{{- fail "engine.tensorParallelSize > 1 on CPU pods is not supported by this chart: tensor parallelism cannot pay on one pod's cores; use 1" -}}
{{- end -}}
{{- if and $v.autoscaling.enabled (lt (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) -}}
{{- fail "autoscaling.maxReplicas must be >= autoscaling.minReplicas" -}}
{{- end -}}
{{- if and $v.autoscaling.enabled $v.multiNode.enabled -}}
{{- fail "autoscaling with multiNode (LeaderWorkerSet) is not supported by this chart: scale the LeaderWorkerSet's replicas yourself" -}}
{{- end -}}
{{- end -}}

{{/* Grace period: preStop sleep + drain timeout + 10 s for the process to exit */}}
{{- define "strata.gracePeriod" -}}
{{- add .Values.server.preStopSleepSeconds .Values.server.drainTimeoutSeconds 10 -}}
{{- end -}}

{{/* `strata serve` arguments, the same on every pod of a replica */}}
{{- define "strata.serveArgs" -}}
{{- $v := .Values -}}
- serve
- --host
- 0.0.0.0
- --port
- {{ $v.server.port | quote }}
- --model
- {{ $v.model.path | quote }}
- --served-model-name
- {{ $v.model.servedName | quote }}
- --device
- {{ $v.engine.device }}
- --dtype
- {{ $v.engine.dtype }}
- --tensor-parallel-size
- {{ $v.engine.tensorParallelSize | quote }}
- --kv-cache-memory
- {{ $v.engine.kvCacheMemory | quote }}
{{- if $v.engine.maxModelLen }}
- --max-model-len
- {{ $v.engine.maxModelLen | quote }}
{{- end }}
{{- if $v.engine.quantization }}
- --quantization
- {{ $v.engine.quantization }}
{{- end }}
{{- if eq $v.engine.device "cpu" }}
- --threads
- {{ $v.engine.threads | default $v.resources.cpu | quote }}
{{- end }}
- --max-queue
- {{ $v.server.maxQueue | quote }}
- --drain-timeout
- {{ $v.server.drainTimeoutSeconds | quote }}
- --startup-timeout
- {{ $v.server.startupTimeoutSeconds | quote }}
{{- range $v.engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The pod's common parts: security, volumes, scheduling */}}
{{- define "strata.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "strata.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "strata.resources" -}}
{{- $v := .Values -}}
requests:
  cpu: {{ $v.resources.cpu | quote }}
  memory: {{ $v.resources.memory | quote }}
limits:
  cpu: {{ $v.resources.cpu | quote }}
  memory: {{ $v.resources.memory | quote }}
  {{- if gt (int $v.gpu.count) 0 }}
  {{ $v.gpu.resourceName }}: {{ $v.gpu.count | quote }}
  {{- end }}
{{- end -}}

{{- define "strata.env" -}}
- name: HOME
  value: /tmp
- name: STRATA_CACHE
  value: /cache/strata
- name: NUMBA_CACHE_DIR
  value: /cache/numba
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .Values.server.apiKeySecret.name }}
- name: STRATA_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.server.apiKeySecret.name }}
      key: {{ .Values.server.apiKeySecret.key }}
{{- end }}
{{- end -}}

{{- define "strata.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end -}}

{{- define "strata.volumes" -}}
- name: model
{{- if eq .Values.model.volume.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.model.volume.hostPath }}
    type: Directory
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end -}}

{{- define "strata.scheduling" -}}
{{- $sel := deepCopy .Values.nodeSelector -}}
{{- if .Values.gpu.product -}}
{{- $_ := set $sel "nvidia.com/gpu.product" .Values.gpu.product -}}
{{- end -}}
{{- with $sel }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tol := .Values.tolerations -}}
{{- if and (gt (int .Values.gpu.count) 0) (not $tol) -}}
{{- $tol = list (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") -}}
{{- end -}}
{{- with $tol }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "strata.podAnnotations" -}}
{{- range $k, $val := .Values.plan }}
plan.strata.dev/{{ $k }}: {{ $val | quote }}
{{- end }}
{{- range $k, $val := .Values.podAnnotations }}
{{ $k }}: {{ $val | quote }}
{{- end }}
{{- end -}}

{{/* Probes of the HTTP-serving container (rank 0) */}}
{{- define "strata.probes" -}}
{{- $p := .Values.probes -}}
startupProbe:
  httpGet:
    path: /ready
    port: http
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ add (div .Values.server.startupTimeoutSeconds $p.periodSeconds) 1 }}
readinessProbe:
  httpGet:
    path: /ready
    port: http
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
livenessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
{{- end -}}

{{- define "strata.lifecycle" -}}
preStop:
  exec:
    command: ["sleep", {{ .Values.server.preStopSleepSeconds | quote }}]
{{- end -}}
