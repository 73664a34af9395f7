{{/* Names, labels and the pieces every Sortie container shares. */}}

{{- define "sortie.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sortie.fullname" -}}
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

{{- define "sortie.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "sortie.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sortie
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "sortie.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sortie.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "sortie.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sortie.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sortie.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Whether the Kafka properties Secret is mounted. */}}
{{- define "sortie.kafkaSecretEnabled" -}}
{{- if or .Values.kafka.existingSecret .Values.kafka.properties .Values.kafka.files }}true{{ end }}
{{- end }}

{{- define "sortie.kafkaSecretName" -}}
{{- default (printf "%s-kafka" (include "sortie.fullname" .)) .Values.kafka.existingSecret }}
{{- end }}

{{/* The Secret's data: kafka.properties and the extra files. */}}
{{- define "sortie.kafkaSecretData" -}}
{{- if .Values.kafka.properties }}
kafka.properties: |
  {{- range $key, $value := .Values.kafka.properties }}
  {{ $key }}={{ $value }}
  {{- end }}
{{- end }}
{{- range $name, $content := .Values.kafka.files }}
{{ $name }}: {{ $content | quote }}
{{- end }}
{{- end }}

{{/* The topology file. */}}
{{- define "sortie.topicsYaml" -}}
{{- if .Values.topics.topicsYaml }}
{{- .Values.topics.topicsYaml }}
{{- else }}
{{- .Files.Get "files/topics.yaml" }}
{{- end }}
{{- end }}

{{/* envFrom + env every Sortie container gets. */}}
{{- define "sortie.commonEnv" -}}
envFrom:
  - configMapRef:
      name: {{ include "sortie.fullname" . }}-config
env:
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- if include "sortie.kafkaSecretEnabled" . }}
  - name: SORTIE__KAFKA__PROPERTIES_FILE
    value: /etc/sortie/kafka/kafka.properties
  {{- end }}
{{- end }}

{{/* The Kafka Secret's volume mount and volume, when there is one. */}}
{{- define "sortie.kafkaVolumeMount" -}}
{{- if include "sortie.kafkaSecretEnabled" . }}
- name: kafka
  mountPath: /etc/sortie/kafka
  readOnly: true
{{- end }}
{{- end }}

{{- define "sortie.kafkaVolume" -}}
{{- if include "sortie.kafkaSecretEnabled" . }}
- name: kafka
  secret:
    secretName: {{ include "sortie.kafkaSecretName" . }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every workload: (dict "root" $ "pod" .Values.gateway) */}}
{{- define "sortie.podSpecCommon" -}}
serviceAccountName: {{ include "sortie.serviceAccountName" .root }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .pod.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Probes on a service's real health endpoints: (dict "port" "metrics") */}}
{{- define "sortie.probes" -}}
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 6
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 3
{{- end }}

{{/* The hook Job's `sortie topology apply` container body (after its name). */}}
{{- define "sortie.topologyContainer" -}}
{{- $v := .root.Values -}}
image: {{ include "sortie.image" .root }}
imagePullPolicy: {{ $v.image.pullPolicy }}
args:
  - topology
  - apply
  - --file
  - /etc/sortie/topology/topics.yaml
  - --prefix
  - {{ $v.topics.prefix | quote }}
  - --partitions
  - {{ $v.topics.runPartitions | quote }}
  - --replication-factor
  - {{ $v.topics.replicationFactor | quote }}
  {{- with $v.topics.minInsyncReplicas }}
  - --min-insync-replicas
  - {{ . | quote }}
  {{- end }}
  - --bootstrap-servers
  - {{ $v.kafka.bootstrapServers | quote }}
{{ include "sortie.topologyContainerCommon" . }}
{{- end }}

{{/* Env, mounts, resources and security of the hook Job's containers. */}}
{{- define "sortie.topologyContainerCommon" -}}
{{- $v := .root.Values -}}
env:
  - name: SORTIE__LOG__LEVEL
    value: {{ $v.log.level | quote }}
  - name: SORTIE__LOG__FORMAT
    value: {{ $v.log.format | quote }}
  {{- if include "sortie.kafkaSecretEnabled" .root }}
  - name: SORTIE__KAFKA__PROPERTIES_FILE
    value: /etc/sortie/kafka/kafka.properties
  {{- end }}
resources:
  {{- toYaml $v.topologyJob.resources | nindent 2 }}
securityContext:
  {{- toYaml $v.securityContext | nindent 2 }}
volumeMounts:
  - name: topology
    mountPath: /etc/sortie/topology
    readOnly: true
  - name: tmp
    mountPath: /tmp
  {{- if include "sortie.kafkaSecretEnabled" .root }}
  - name: kafka
    mountPath: /etc/sortie/kafka
    readOnly: true
  {{- end }}
{{- end }}

{{/*
The blob store (README "Large payloads") for the gateway or an executor: the store, its
S3 endpoint and threshold as the component's environment (`section` is GATEWAY or
EXECUTOR), and AWS credentials and region for an s3:// store.
*/}}
{{- define "sortie.blobEnv" -}}
{{- $b := .root.Values.blobs }}
{{- if $b.store }}
- name: SORTIE__{{ .section }}__BLOB_STORE
  value: {{ $b.store | quote }}
- name: SORTIE__{{ .section }}__BLOB_THRESHOLD
  value: {{ $b.thresholdBytes | quote }}
{{- if $b.s3Endpoint }}
- name: SORTIE__{{ .section }}__BLOB_S3_ENDPOINT
  value: {{ $b.s3Endpoint | quote }}
{{- end }}
{{- if $b.region }}
- name: AWS_REGION
  value: {{ $b.region | quote }}
{{- end }}
{{- if $b.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $b.existingSecret }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $b.existingSecret }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}
{{- end }}

{{/* A directory blob store's shared volume (blobs.fileClaim), when there is one. */}}
{{- define "sortie.blobVolumeMount" -}}
{{- if and .Values.blobs.store .Values.blobs.fileClaim }}
- name: blobs
  mountPath: /var/lib/sortie/blobs
{{- end }}
{{- end }}

{{- define "sortie.blobVolume" -}}
{{- if and .Values.blobs.store .Values.blobs.fileClaim }}
- name: blobs
  persistentVolumeClaim:
    claimName: {{ .Values.blobs.fileClaim }}
{{- end }}
{{- end }}

{{/*
Sealed payloads (README "Encryption and deletion") for the reducer, the gateway or an
executor: the KEK keyring file, the key store and its S3 settings. `blobs` is true where
the blob store's AWS settings are already in the environment (gateway, executors): the
key store then shares them.
*/}}
{{- define "sortie.sealEnv" -}}
{{- $s := .root.Values.seal }}
{{- if $s.keyStore }}
{{- if not (or $s.kekKeyring $s.existingKekSecret) }}
{{- fail "seal.keyStore needs seal.kekKeyring or seal.existingKekSecret" }}
{{- end }}
- name: SORTIE__SEAL__KEYRING
  value: /etc/sortie/kek/kek.yaml
- name: SORTIE__SEAL__KEY_STORE
  value: {{ $s.keyStore | quote }}
- name: SORTIE__SEAL__CACHE_MS
  value: {{ $s.cacheMs | quote }}
{{- if $s.s3Endpoint }}
- name: SORTIE__SEAL__S3_ENDPOINT
  value: {{ $s.s3Endpoint | quote }}
{{- end }}
{{- $b := .root.Values.blobs }}
{{- $shared := and .blobs $b.store }}
{{- if and $shared $b.existingSecret $s.existingSecret (ne $b.existingSecret $s.existingSecret) }}
{{- fail "seal.existingSecret must be blobs.existingSecret: the gateway and executors have one set of AWS credentials" }}
{{- end }}
{{- if and $s.region (not (and $shared $b.region)) }}
- name: AWS_REGION
  value: {{ $s.region | quote }}
{{- end }}
{{- if and $s.existingSecret (not (and $shared $b.existingSecret)) }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $s.existingSecret }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $s.existingSecret }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}
{{- end }}

{{- define "sortie.sealVolumeMount" -}}
{{- if .Values.seal.keyStore }}
- name: kek
  mountPath: /etc/sortie/kek
  readOnly: true
{{- if .Values.seal.fileClaim }}
- name: run-keys
  mountPath: /var/lib/sortie/run-keys
{{- end }}
{{- end }}
{{- end }}

{{- define "sortie.sealVolume" -}}
{{- if .Values.seal.keyStore }}
- name: kek
  secret:
    secretName: {{ default (printf "%s-kek" (include "sortie.fullname" .)) .Values.seal.existingKekSecret }}
{{- if .Values.seal.fileClaim }}
- name: run-keys
  persistentVolumeClaim:
    claimName: {{ .Values.seal.fileClaim }}
{{- end }}
{{- end }}
{{- end }}
