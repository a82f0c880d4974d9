{{/* vim: set filetype=mustache: */}}
{{/*
Naming, labels, images and credentials shared by every template (Bitnami-style: every helper is
prefixed with the chart name).
*/}}

{{/* Chart name, overridable with .Values.nameOverride. */}}
{{- define "gemma-platform.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified app name, truncated at 63 characters (DNS label limit). Components append a suffix
of their own, so keep release names short.
*/}}
{{- define "gemma-platform.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component: <fullname>-<component>. Usage: include "gemma-platform.componentName" (dict "ctx" $ "component" "web") */}}
{{- define "gemma-platform.componentName" -}}
{{- printf "%s-%s" (include "gemma-platform.fullname" .ctx) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gemma-platform.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Standard labels (app.kubernetes.io/*) plus .Values.commonLabels. */}}
{{- define "gemma-platform.labels" -}}
helm.sh/chart: {{ include "gemma-platform.chart" . }}
{{ include "gemma-platform.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "gemma-platform.name" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gemma-platform.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gemma-platform.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one component. Usage: include "gemma-platform.componentLabels" (dict "ctx" $ "component" "web") */}}
{{- define "gemma-platform.componentLabels" -}}
{{ include "gemma-platform.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Selector labels of one component (immutable once deployed: never add to them). */}}
{{- define "gemma-platform.componentSelectorLabels" -}}
{{ include "gemma-platform.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* metadata.annotations content from .Values.commonAnnotations merged with extra ones. */}}
{{- define "gemma-platform.annotations" -}}
{{- $all := merge (deepCopy (default dict .extra)) (deepCopy (default dict .ctx.Values.commonAnnotations)) -}}
{{- if $all }}
{{- toYaml $all }}
{{- end -}}
{{- end -}}

{{/*
Image reference. registry/repository:tag@digest; the tag defaults to the chart's appVersion, never
"latest". Usage: include "gemma-platform.image" (dict "image" .Values.image "ctx" $)
*/}}
{{- define "gemma-platform.image" -}}
{{- $registry := default .image.registry .ctx.Values.global.imageRegistry -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag | toString -}}
{{- if eq $tag "latest" -}}
{{- fail "image tag \"latest\" is not allowed: pin a version (or a digest)" -}}
{{- end -}}
{{- $ref := ternary (printf "%s/%s" $registry .image.repository) .image.repository (ne $registry "") -}}
{{- if .image.digest -}}
{{- printf "%s:%s@%s" $ref $tag .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $ref $tag -}}
{{- end -}}
{{- end -}}

{{/* imagePullSecrets block, or nothing. Call sites: with include ... }}{{ . | nindent N }} */}}
{{- define "gemma-platform.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . | quote }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "gemma-platform.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gemma-platform.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gemma-platform.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "gemma-platform.componentName" (dict "ctx" . "component" "operator")) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gemma-platform.web.serviceName" -}}
{{- include "gemma-platform.componentName" (dict "ctx" . "component" "web") -}}
{{- end -}}

{{/* In-cluster control-plane URL the operator calls. */}}
{{- define "gemma-platform.controlPlaneUrl" -}}
{{- if .Values.operator.controlPlaneUrl -}}
{{- .Values.operator.controlPlaneUrl -}}
{{- else -}}
{{- printf "http://%s.%s.svc:%v" (include "gemma-platform.web.serviceName" .) .Release.Namespace .Values.web.service.port -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- credentials ---- */}}

{{/* Secret holding SECRET_KEY, API_KEY_HMAC_KEY, OPERATOR_TOKEN, METRICS_TOKEN. */}}
{{- define "gemma-platform.auth.secretName" -}}
{{- default (include "gemma-platform.componentName" (dict "ctx" . "component" "auth")) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "gemma-platform.postgresql.fullname" -}}
{{- include "gemma-platform.componentName" (dict "ctx" . "component" "postgresql") -}}
{{- end -}}

{{- define "gemma-platform.postgresql.secretName" -}}
{{- default (include "gemma-platform.postgresql.fullname" .) .Values.postgresql.auth.existingSecret -}}
{{- end -}}

{{- define "gemma-platform.redis.fullname" -}}
{{- include "gemma-platform.componentName" (dict "ctx" . "component" "redis") -}}
{{- end -}}

{{- define "gemma-platform.redis.secretName" -}}
{{- default (include "gemma-platform.redis.fullname" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "gemma-platform.minio.fullname" -}}
{{- include "gemma-platform.componentName" (dict "ctx" . "component" "minio") -}}
{{- end -}}

{{/* Secret holding the in-cluster MinIO's root user and password. */}}
{{- define "gemma-platform.minio.secretName" -}}
{{- default (include "gemma-platform.minio.fullname" .) .Values.minio.auth.existingSecret -}}
{{- end -}}

{{/*
Secret holding the adapter store's S3 access key id and secret: adapterStore.existingSecret, or the
one the chart generates for the in-cluster MinIO's platform user.
*/}}
{{- define "gemma-platform.adapterStore.secretName" -}}
{{- if .Values.adapterStore.existingSecret -}}
{{- .Values.adapterStore.existingSecret -}}
{{- else if .Values.minio.enabled -}}
{{- include "gemma-platform.componentName" (dict "ctx" . "component" "adapter-store") -}}
{{- else -}}
{{- fail "adapterStore.existingSecret is required when minio.enabled is false (the S3 keys of the adapter store)" -}}
{{- end -}}
{{- end -}}

{{/* The adapter store's S3 endpoint: adapterStore.endpointUrl, else the in-cluster MinIO. */}}
{{- define "gemma-platform.adapterStore.endpointUrl" -}}
{{- if .Values.adapterStore.endpointUrl -}}
{{- .Values.adapterStore.endpointUrl -}}
{{- else if .Values.minio.enabled -}}
{{- printf "http://%s:9000" (include "gemma-platform.minio.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
A random secret value that stays the same across upgrades: the value already stored in the live
Secret when there is one (lookup), a new random one otherwise. `helm template` and --dry-run have
no cluster, so they always print a new value. Returns the base64-encoded value.
Usage: include "gemma-platform.stableSecretValue" (dict "ctx" $ "secret" "name" "key" "SECRET_KEY" "length" 64)
*/}}
{{- define "gemma-platform.stableSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .secret -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key -}}
{{- else -}}
{{- randAlphaNum (int .length) | b64enc -}}
{{- end -}}
{{- end -}}

{{/*
Annotations of a chart-generated Secret. The Secrets are normal release resources, never hooks: a
hook with before-hook-creation is deleted and re-created by every upgrade, and pods starting in
that gap fail. "keep" so that `helm uninstall` never loses a database password that a retained
volume still uses. The migration hook finds them: it runs post-install when the chart generates a
Secret it reads (see "gemma-platform.migrations.hook"), and every upgrade finds them in place.
*/}}
{{- define "gemma-platform.generatedSecretAnnotations" -}}
helm.sh/resource-policy: keep
{{- end -}}

{{/*
When the migration Job runs. Before the new code on upgrade; on first install before the release's
normal resources (pre-install) unless it needs one of them: the in-cluster database, or a Secret
the chart generates (auth, database or Redis password), which Helm creates only after pre-install
hooks (the adapter store's Secret included).
*/}}
{{- define "gemma-platform.migrations.hook" -}}
{{- $generatesRedisSecret := and .Values.redis.enabled (not .Values.redis.auth.existingSecret) -}}
{{- $generatesStoreSecret := and .Values.minio.enabled (not .Values.adapterStore.existingSecret) -}}
{{- if or .Values.postgresql.enabled (not .Values.auth.existingSecret) $generatesRedisSecret $generatesStoreSecret -}}
post-install,pre-upgrade
{{- else -}}
pre-install,pre-upgrade
{{- end -}}
{{- end -}}

{{/*
Environment every application container gets (web, beat, migrations, workers): configuration as
plain values, every credential through secretKeyRef. DATABASE_URL/REDIS_URL come from the
external secrets, or are assembled from the in-cluster server's generated password by Kubernetes'
$(VAR) expansion, so no credential is ever written into a manifest.
*/}}
{{- define "gemma-platform.appEnv" -}}
{{- $authSecret := include "gemma-platform.auth.secretName" . -}}
- name: DJANGO_SETTINGS_MODULE
  value: config.settings
- name: DJANGO_DEBUG
  value: {{ .Values.config.debug | quote }}
- name: LOG_LEVEL
  value: {{ .Values.config.logLevel | quote }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: ALLOWED_HOSTS
  value: {{ include "gemma-platform.allowedHosts" . | quote }}
{{- with .Values.config.csrfTrustedOrigins }}
- name: CSRF_TRUSTED_ORIGINS
  value: {{ join "," . | quote }}
{{- end }}
- name: QUEUE_TIMEOUT_SECONDS
  value: {{ .Values.config.queueTimeoutSeconds | quote }}
- name: SECURE_HSTS_SECONDS
  value: {{ .Values.config.https.hstsSeconds | int64 | quote }}
- name: SECURE_HSTS_INCLUDE_SUBDOMAINS
  value: {{ .Values.config.https.hstsIncludeSubdomains | quote }}
- name: SECURE_HSTS_PRELOAD
  value: {{ .Values.config.https.hstsPreload | quote }}
- name: SECURE_SSL_REDIRECT
  value: {{ .Values.config.https.sslRedirect | quote }}
- name: HTTPS_REDIRECTED_BY_PROXY
  value: {{ .Values.config.https.redirectedByProxy | quote }}
- name: SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $authSecret }}
      key: {{ .Values.auth.secretKeys.secretKey }}
- name: API_KEY_HMAC_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $authSecret }}
      key: {{ .Values.auth.secretKeys.apiKeyHmacKey }}
- name: OPERATOR_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $authSecret }}
      key: {{ .Values.auth.secretKeys.operatorToken }}
- name: METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $authSecret }}
      key: {{ .Values.auth.secretKeys.metricsToken }}
{{- if .Values.postgresql.enabled }}
- name: DATABASE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "gemma-platform.postgresql.secretName" . }}
      key: {{ .Values.postgresql.auth.secretKeys.password }}
- name: DATABASE_URL
  value: {{ printf "postgres://%s:$(DATABASE_PASSWORD)@%s:5432/%s" .Values.postgresql.auth.username (include "gemma-platform.postgresql.fullname" .) .Values.postgresql.auth.database | quote }}
{{- else }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "externalDatabase.existingSecret is required when postgresql.enabled is false" .Values.externalDatabase.existingSecret }}
      key: {{ .Values.externalDatabase.existingSecretUrlKey }}
{{- end }}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "gemma-platform.redis.secretName" . }}
      key: {{ .Values.redis.auth.secretKeys.password }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "gemma-platform.redis.fullname" .) | quote }}
{{- else }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "externalRedis.existingSecret is required when redis.enabled is false" .Values.externalRedis.existingSecret }}
      key: {{ .Values.externalRedis.existingSecretUrlKey }}
{{- end }}
{{- /* Tenants' LoRA adapters: an S3 bucket (the in-cluster MinIO or adapterStore.endpointUrl);
     each process downloads what it uses under /tmp (an emptyDir in every pod). */}}
- name: ADAPTER_STORE_URL
  value: {{ printf "s3://%s/%s" .Values.adapterStore.bucket .Values.adapterStore.prefix | trimSuffix "/" | quote }}
- name: ADAPTER_S3_ENDPOINT_URL
  value: {{ include "gemma-platform.adapterStore.endpointUrl" . | quote }}
- name: ADAPTER_S3_REGION
  value: {{ .Values.adapterStore.region | quote }}
- name: ADAPTER_S3_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ include "gemma-platform.adapterStore.secretName" . }}
      key: {{ .Values.adapterStore.secretKeys.accessKeyId }}
- name: ADAPTER_S3_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "gemma-platform.adapterStore.secretName" . }}
      key: {{ .Values.adapterStore.secretKeys.secretAccessKey }}
{{- with .Values.huggingface.existingSecret }}
{{- /* Workers download weights; web loads each model's tokenizer and chat template. */}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.huggingface.tokenKey }}
{{- end }}
{{- with .Values.config.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
ALLOWED_HOSTS: the configured hosts plus the names the cluster itself uses: probes send
"Host: localhost", the operator calls the web Service by its DNS name, and Prometheus scrapes each
pod by its IP ($(POD_IP), expanded by Kubernetes from the variable defined just before).
*/}}
{{- define "gemma-platform.allowedHosts" -}}
{{- $svc := include "gemma-platform.web.serviceName" . -}}
{{- $hosts := list "localhost" "127.0.0.1" "$(POD_IP)" $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- concat $hosts .Values.config.allowedHosts | uniq | join "," -}}
{{- end -}}

{{/* Pod-level and container-level security contexts (non-root, no privilege escalation). */}}
{{- define "gemma-platform.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{/*
Merged settings of one worker pool: .Values.worker defaults overridden by the pool entry's keys.
Usage: $w := include "gemma-platform.pool" (dict "ctx" $ "pool" $pool) | fromYaml
*/}}
{{- define "gemma-platform.pool" -}}
{{- /* Two levels, by hand: sprig's mergeOverwrite skips false and 0, so a pool could not turn a
     default off. A map value merges key by key into the default map; anything else replaces. */ -}}
{{- $merged := deepCopy .ctx.Values.worker -}}
{{- range $key, $value := .pool -}}
{{- $default := get $merged $key -}}
{{- if and (kindIs "map" $value) (kindIs "map" $default) -}}
{{- $inner := deepCopy $default -}}
{{- range $k, $v := $value -}}
{{- $_ := set $inner $k $v -}}
{{- end -}}
{{- $_ := set $merged $key $inner -}}
{{- else -}}
{{- $_ := set $merged $key $value -}}
{{- end -}}
{{- end -}}
{{- toYaml $merged -}}
{{- end -}}

{{- define "gemma-platform.pool.deploymentName" -}}
{{- include "gemma-platform.componentName" (dict "ctx" .ctx "component" (printf "worker-%s" .pool.name)) -}}
{{- end -}}

{{/* Celery queue of a pool (the gateway dispatches to pool.<name>). */}}
{{- define "gemma-platform.pool.queue" -}}
{{- printf "pool.%s" .name -}}
{{- end -}}

{{/* JSON list of the served models whose pool may scale to zero. */}}
{{- define "gemma-platform.scaleToZeroModels" -}}
{{- $models := list -}}
{{- range $pool := .Values.pools -}}
{{- $w := include "gemma-platform.pool" (dict "ctx" $ "pool" $pool) | fromYaml -}}
{{- if $w.autoscaling.allowScaleToZero -}}
{{- $models = append $models $pool.servedModel -}}
{{- end -}}
{{- end -}}
{{- toJson $models -}}
{{- end -}}
