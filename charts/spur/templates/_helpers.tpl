{{- define "spur.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "spur.labels" -}}
app.kubernetes.io/part-of: spur
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "spur.securityContext" -}}
runAsNonRoot: true
runAsUser: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: ["ALL"]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- /* SPUR_LOG from .Values.logLevel, as env list items (nothing when unset). */ -}}
{{- define "spur.logEnv" -}}
{{- with .Values.logLevel }}
- {name: SPUR_LOG, value: {{ . | quote }}}
{{- end }}
{{- end -}}

{{- /* The namespaces of the L4 gateway (gateway.namespaces, else the release namespace), as a
JSON list: `include "spur.gatewayNamespaces" . | fromJsonArray`. */ -}}
{{- define "spur.gatewayNamespaces" -}}
{{- .Values.gateway.namespaces | default (list .Release.Namespace) | uniq | toJson -}}
{{- end -}}
