{{/* Names and labels. */}}
{{- define "vllm-neuron.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-neuron.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vllm-neuron.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-neuron.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vllm-neuron.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "vllm-neuron.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "vllm-neuron.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vllm-neuron.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "vllm-neuron.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.device) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* Secrets: the chart's own Secret holds whichever of the two values were given. */}}
{{- define "vllm-neuron.secretName" -}}
{{- include "vllm-neuron.fullname" . -}}
{{- end -}}

{{- define "vllm-neuron.createSecret" -}}
{{- if or (and .Values.apiKey.value (not .Values.apiKey.existingSecret)) (and .Values.hfToken.value (not .Values.hfToken.existingSecret)) -}}
true
{{- end -}}
{{- end -}}

{{/*
Neuron resource count. With cores, one logical NeuronCore per tensor-parallel rank. With whole devices, the
ranks rounded up to devices: a Trainium2 chip has 8 physical cores, i.e. 8 / LNC logical ones.
*/}}
{{- define "vllm-neuron.neuronCount" -}}
{{- if gt (int .Values.neuron.count) 0 -}}
{{- .Values.neuron.count -}}
{{- else if eq .Values.neuron.resourceName "aws.amazon.com/neuron" -}}
{{- $perDevice := div 8 (int .Values.neuron.logicalNcConfig) -}}
{{- div (add (int .Values.tensorParallelSize) (sub $perDevice 1)) $perDevice -}}
{{- else -}}
{{- .Values.tensorParallelSize -}}
{{- end -}}
{{- end -}}

{{/* --additional-config: the bucket sets (when given) merged over additionalConfig. */}}
{{- define "vllm-neuron.additionalConfig" -}}
{{- $config := deepCopy .Values.additionalConfig -}}
{{- with .Values.buckets.prefill }}{{ $_ := set $config "prefill_buckets" . }}{{ end -}}
{{- with .Values.buckets.decodeBatch }}{{ $_ := set $config "decode_batch_buckets" . }}{{ end -}}
{{- with .Values.buckets.context }}{{ $_ := set $config "context_buckets" . }}{{ end -}}
{{- with .Values.buckets.decodeContext }}{{ $_ := set $config "decode_context_buckets" . }}{{ end -}}
{{- if $config }}{{ toJson $config }}{{ end -}}
{{- end -}}

{{/* Arguments of `vllm-neuron serve` (the image's ENTRYPOINT), one per line as a YAML list; takes (dict "root" .
"role" role), role "" outside llm-d. */}}
{{- define "vllm-neuron.serveArgs" -}}
{{- $role := .role -}}
{{- with .root -}}
{{- with .Values.model.name }}
- {{ . | quote }}
{{- end }}
- "--host"
- "0.0.0.0"
- "--port"
- {{ include "vllm-neuron.enginePort" (dict "root" . "role" $role) | quote }}
- "--tensor-parallel-size"
- {{ .Values.tensorParallelSize | quote }}
- "--max-num-seqs"
- {{ .Values.maxNumSeqs | quote }}
{{- if gt (int .Values.maxModelLen) 0 }}
- "--max-model-len"
- {{ .Values.maxModelLen | quote }}
{{- end }}
{{- if gt (int .Values.maxNumBatchedTokens) 0 }}
- "--max-num-batched-tokens"
- {{ .Values.maxNumBatchedTokens | quote }}
{{- end }}
{{- with .Values.model.servedModelName }}
- "--served-model-name"
- {{ . | quote }}
{{- end }}
{{- with .Values.model.revision }}
- "--revision"
- {{ . | quote }}
{{- end }}
{{- with .Values.model.dtype }}
- "--dtype"
- {{ . | quote }}
{{- end }}
- "--shutdown-timeout"
- {{ .Values.server.shutdownTimeoutSeconds | quote }}
- "--max-num-queued-reqs"
- {{ include "vllm-neuron.maxRequestsInFlight" . | quote }}
{{- if gt (int .Values.server.maxQueuedPromptTokens) 0 }}
- "--max-num-queued-tokens"
- {{ .Values.server.maxQueuedPromptTokens | quote }}
{{- end }}
- "--readiness"
- {{ .Values.compile.readiness | quote }}
{{- if gt (int .Values.compile.workers) 0 }}
- "--compile-workers"
- {{ .Values.compile.workers | quote }}
{{- end }}
{{- with include "vllm-neuron.additionalConfig" . }}
- "--additional-config"
- {{ . | quote }}
{{- end }}
{{- if .Values.llmd.enabled }}
- "--block-size"
- {{ .Values.llmd.blockSize | quote }}
{{/* The picker recomputes block hashes from prompts: vLLM's default (sha256 over Python pickles) cannot be
reproduced outside Python; sha256_cbor is what llm-d's guides run. */}}
- "--prefix-caching-hash-algo"
- "sha256_cbor"
- "--kv-events-config"
- {{ include "vllm-neuron.llmd.kvEventsConfig" . | quote }}
{{- if .Values.llmd.prefill.enabled }}
- "--kv-transfer-config"
- {{ include "vllm-neuron.llmd.kvTransferConfig" . | quote }}
{{- end }}
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "vllm-neuron.compileCacheRoot" -}}
{{- if eq .Values.device "neuron" -}}
{{/* NEFFs compiled for one LNC value do not run under the other, and the plugin's cache key does not include
it: one folder per LNC value keeps them apart on the shared volume. */}}
{{- printf "%s/lnc%d" .Values.persistence.compileCache.mountPath (int .Values.neuron.logicalNcConfig) -}}
{{- else -}}
{{- .Values.persistence.compileCache.mountPath -}}
{{- end -}}
{{- end -}}

{{/* Environment shared by the server and the prewarm Job. */}}
{{- define "vllm-neuron.env" -}}
- name: VLLM_NEURON_DEVICE
  value: {{ .Values.device | quote }}
- name: VLLM_NEURON_CACHE_ROOT
  value: {{ include "vllm-neuron.compileCacheRoot" . | quote }}
- name: VLLM_NEURON_MODEL_CACHE
  value: {{ .Values.persistence.modelCache.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/hf" .Values.persistence.modelCache.mountPath | quote }}
- name: HOME
  value: /home/vllm
- name: VLLM_NO_USAGE_STATS
  value: "1"
- name: DO_NOT_TRACK
  value: "1"
{{- if eq .Values.device "neuron" }}
- name: NEURON_LOGICAL_NC_CONFIG
  value: {{ .Values.neuron.logicalNcConfig | quote }}
{{- end }}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret | default (include "vllm-neuron.secretName" .) }}
      key: {{ ternary .Values.apiKey.existingSecretKey "api-key" (ne .Values.apiKey.existingSecret "") }}
{{- end }}
{{- if or .Values.hfToken.existingSecret .Values.hfToken.value }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.existingSecret | default (include "vllm-neuron.secretName" .) }}
      key: {{ ternary .Values.hfToken.existingSecretKey "hf-token" (ne .Values.hfToken.existingSecret "") }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Resources: the user's CPU and memory plus, in neuron mode, the Neuron device plugin's resource. */}}
{{- define "vllm-neuron.resources" -}}
{{- $resources := deepCopy .Values.resources -}}
{{- if eq .Values.device "neuron" -}}
{{- $count := include "vllm-neuron.neuronCount" . -}}
{{- $requests := get $resources "requests" | default dict -}}
{{- $limits := get $resources "limits" | default dict -}}
{{- $_ := set $requests .Values.neuron.resourceName $count -}}
{{- $_ := set $limits .Values.neuron.resourceName $count -}}
{{- $_ := set $resources "requests" $requests -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "vllm-neuron.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/vllm
- name: shm
  mountPath: /dev/shm
- name: model-cache
  mountPath: {{ .Values.persistence.modelCache.mountPath }}
- name: compile-cache
  mountPath: {{ .Values.persistence.compileCache.mountPath }}
{{- end -}}

{{- define "vllm-neuron.cacheVolume" -}}
{{- $cache := index .root.Values.persistence .key -}}
- name: {{ .name }}
{{- if and $cache.enabled $cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $cache.existingClaim }}
{{- else if $cache.enabled }}
  persistentVolumeClaim:
    claimName: {{ printf "%s-%s" (include "vllm-neuron.fullname" .root) .name }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "vllm-neuron.volumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{ include "vllm-neuron.cacheVolume" (dict "root" . "key" "modelCache" "name" "model-cache") }}
{{ include "vllm-neuron.cacheVolume" (dict "root" . "key" "compileCache" "name" "compile-cache") }}
{{- end -}}

{{/* Scheduling: the user's nodeSelector and tolerations plus, in neuron mode, the trn2 ones. */}}
{{- define "vllm-neuron.scheduling" -}}
{{- $nodeSelector := deepCopy .Values.nodeSelector -}}
{{- $tolerations := .Values.tolerations -}}
{{- if eq .Values.device "neuron" -}}
{{- $nodeSelector = merge $nodeSelector .Values.neuron.nodeSelector -}}
{{- $tolerations = concat .Values.neuron.tolerations .Values.tolerations -}}
{{- end -}}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* Init containers: the volume-permissions one, and llm-d's routing sidecar in a disaggregated decode pod (a
native sidecar: an init container that keeps running). Takes (dict "root" . "role" role). */}}
{{- define "vllm-neuron.initContainers" -}}
{{- $role := .role -}}
{{- with .root -}}
{{- $sidecar := and (eq $role "decode") .Values.llmd.prefill.enabled -}}
{{- if or .Values.volumePermissions.enabled $sidecar }}
initContainers:
{{- end }}
{{- if .Values.volumePermissions.enabled }}
  - name: volume-permissions
    image: {{ include "vllm-neuron.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - chown
      - {{ printf "%d:%d" (int .Values.podSecurityContext.runAsUser) (int .Values.podSecurityContext.runAsGroup) | quote }}
      - {{ .Values.persistence.modelCache.mountPath | quote }}
      - {{ .Values.persistence.compileCache.mountPath | quote }}
    securityContext:
      runAsUser: 0
      runAsNonRoot: false
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities:
        drop: [ALL]
        add: [CHOWN]
    volumeMounts:
      - name: model-cache
        mountPath: {{ .Values.persistence.modelCache.mountPath }}
      - name: compile-cache
        mountPath: {{ .Values.persistence.compileCache.mountPath }}
{{- end }}
{{- if $sidecar }}
  # Takes the pod's port: a request the picker sent with a prefill pod in its headers is prefilled there
  # first (vLLM's kv_transfer_params handshake over NIXL), then decoded by the local server.
  - name: routing-sidecar
    image: {{ .Values.llmd.prefill.routingSidecar.image }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    restartPolicy: Always
    args:
      - {{ printf "--port=%d" (int .Values.server.port) | quote }}
      - {{ printf "--vllm-port=%d" (int .Values.llmd.prefill.routingSidecar.enginePort) | quote }}
      - "--connector=nixlv2"
      - "--secure-proxy=false"
    ports:
      - name: http
        containerPort: {{ .Values.server.port }}
        protocol: TCP
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by the Deployments and the prewarm Job; takes (dict "root" . "role" role). */}}
{{- define "vllm-neuron.podCommon" -}}
{{- $role := .role -}}
{{- with .root -}}
serviceAccountName: {{ include "vllm-neuron.serviceAccountName" . }}
# The server never calls the Kubernetes API.
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- include "vllm-neuron.scheduling" . }}
{{- include "vllm-neuron.initContainers" (dict "root" . "role" $role) }}
volumes:
  {{- include "vllm-neuron.volumes" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Requests in flight past which the server answers 429: server.maxRequestsInFlight, or the plugin's default
(vllm_neuron/config.py: maxNumSeqs running and twice as many waiting). With autoscaling on, the target of
waiting requests must lie below what may wait, or the autoscaler never sees it while requests get 429s.
*/}}
{{- define "vllm-neuron.maxRequestsInFlight" -}}
{{- $bound := int .Values.server.maxRequestsInFlight | default (mul 3 (int .Values.maxNumSeqs)) -}}
{{- $waiting := sub $bound (int .Values.maxNumSeqs) -}}
{{- if and .Values.autoscaling.enabled (ge (int .Values.autoscaling.targetWaitingRequests) (int $waiting)) -}}
{{- fail (printf "autoscaling.targetWaitingRequests=%d is not below the %d requests that may wait (server.maxRequestsInFlight %d minus maxNumSeqs %d): lower the target or raise server.maxRequestsInFlight" (int .Values.autoscaling.targetWaitingRequests) (int $waiting) (int $bound) (int .Values.maxNumSeqs)) -}}
{{- end -}}
{{- $bound -}}
{{- end -}}

{{/*
llm-d (values llmd). The main Deployment is the decode pool; with llmd.prefill.enabled a prefill pool runs
beside it. The strings the servers and the endpoint picker must agree on are made here, once.
*/}}
{{- define "vllm-neuron.role" -}}
{{- if .Values.llmd.enabled }}decode{{ end -}}
{{- end -}}

{{/* Where vLLM listens: behind the routing sidecar in a disaggregated decode pod, on server.port otherwise. */}}
{{- define "vllm-neuron.enginePort" -}}
{{- if and (eq .role "decode") .root.Values.llmd.prefill.enabled -}}
{{- .root.Values.llmd.prefill.routingSidecar.enginePort -}}
{{- else -}}
{{- .root.Values.server.port -}}
{{- end -}}
{{- end -}}

{{- define "vllm-neuron.llmd.eppName" -}}
{{- printf "%s-epp" (include "vllm-neuron.fullname" . | trunc 59 | trimSuffix "-") -}}
{{- end -}}

{{/* The model the picker tokenizes prompts with: a Hugging Face repo id. */}}
{{- define "vllm-neuron.llmd.model" -}}
{{- required "llmd.enabled needs model.name (a Hugging Face repo id): the endpoint picker tokenizes prompts with its tokenizer" .Values.model.name -}}
{{- end -}}

{{/*
vLLM's --kv-events-config: each server's ZMQ publisher connects to the picker's port. The topic names the
pod's endpoint and served model, as llm-d's picker expects ($(POD_IP) is expanded by Kubernetes).
*/}}
{{- define "vllm-neuron.llmd.kvEventsConfig" -}}
{{- $endpoint := printf "tcp://%s.%s.svc:%d" (include "vllm-neuron.llmd.eppName" .) .Release.Namespace (int .Values.llmd.epp.kvEventsPort) -}}
{{- $model := .Values.model.servedModelName | default (include "vllm-neuron.llmd.model" .) -}}
{{- $topic := printf "kv@$(POD_IP):%d@%s" (int .Values.server.port) $model -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" $endpoint "topic" $topic | toJson -}}
{{- end -}}

{{/* vLLM's --kv-transfer-config for prefill/decode: NIXL both ways, as llm-d's P/D guide runs it. */}}
{{- define "vllm-neuron.llmd.kvTransferConfig" -}}
{{- dict "kv_connector" "NixlConnector" "kv_role" "kv_both" | toJson -}}
{{- end -}}

{{/* Labels of a pool's pods (and its selector): the role llm-d's filters read. */}}
{{- define "vllm-neuron.roleLabels" -}}
{{- with .role -}}
llm-d.ai/role: {{ . }}
{{- end -}}
{{- end -}}
