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

{{- /* Fails an install or upgrade at once when a PersistentVolumeClaim of the chart could never
bind: no StorageClass named, and the cluster has no default one (kind and k3s have one, a bare
kubeadm cluster does not); or the named StorageClass does not exist. Without this a plain
`helm install --wait` waits for its timeout on a Pending claim. Called with
(list $ "jobs.persistence" "storageClass" $persistence "data-spur-jobs-0") for the value path,
the key of the class, the persistence values and the claim's name. Skipped when the claim
exists already (an upgrade that keeps it), for the class "-" (storageClassName "", static
volumes only), and where `lookup` answers nothing (`helm template`, client-side dry runs). */ -}}
{{- define "spur.checkStorage" -}}
{{- $root := index . 0 -}}
{{- $path := index . 1 -}}
{{- $key := index . 2 -}}
{{- $p := index . 3 -}}
{{- $claim := index . 4 -}}
{{- $named := index $p $key | default "" -}}
{{- if and $p.enabled (ne $named "-") (not (lookup "v1" "PersistentVolumeClaim" $root.Release.Namespace $claim)) -}}
{{- $classes := lookup "storage.k8s.io/v1" "StorageClass" "" "" -}}
{{- if $classes -}}
{{- if $named -}}
{{- $found := false -}}
{{- range (get $classes "items" | default list) -}}
{{- if eq .metadata.name $named }}{{ $found = true }}{{ end -}}
{{- end -}}
{{- if not $found -}}
{{- fail (printf "%s.%s=%s: no such StorageClass in this cluster (`kubectl get storageclass` lists them); name one that exists, or set %s.enabled=false (an emptyDir, lost with the pod)" $path $key $named $path) -}}
{{- end -}}
{{- else -}}
{{- $default := false -}}
{{- range (get $classes "items" | default list) -}}
{{- $a := .metadata.annotations | default dict -}}
{{- if or (eq (get $a "storageclass.kubernetes.io/is-default-class") "true") (eq (get $a "storageclass.beta.kubernetes.io/is-default-class") "true") }}{{ $default = true }}{{ end -}}
{{- end -}}
{{- if not $default -}}
{{- fail (printf "%s.enabled is true but this cluster has no default StorageClass, so the claim would never bind and the pod would never start: set %s.%s to a StorageClass of `kubectl get storageclass` (\"-\" for volumes you made yourself, without a class), or %s.enabled=false (an emptyDir, lost with the pod)" $path $path $key $path) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* storageClassName from a persistence value: "-" is "" (static volumes without a class),
"" leaves it out (the cluster's default). */ -}}
{{- define "spur.storageClassName" -}}
{{- if eq . "-" }}storageClassName: ""{{ else if . }}storageClassName: {{ . }}{{ end -}}
{{- end -}}

{{/* The injection config (ConfigMap spur-injection, docs/injection.md "Configuration"): one
definition, so the operator's pod template can carry its checksum. */}}
{{- define "spur.injectionConfig" -}}
sidecarImage: {{ include "spur.image" . | quote }}
initImage: {{ include "spur.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy | quote }}
routeserver: "spur-routeserver.{{ .Release.Namespace }}.svc:{{ .Values.routeserver.grpcPort }}"
routeserverTokenAudience: {{ .Values.routeserver.tokenAudience | quote }}
{{- if .Values.traffic.enabled }}
trafficServer: "spur-traffic.{{ .Release.Namespace }}.svc:{{ .Values.traffic.port }}"
{{- end }}
routingKeys:
  customHeaders: {{ .Values.routingKeys.customHeaders | toJson }}
  {{- with .Values.routingKeys.queryParam }}
  queryParam: {{ . | quote }}
  {{- end }}
{{- with .Values.injection }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- /* Where a Deployment's replicas run (issue 47, point 2), under the pod spec: the component's
nodeSelector, tolerations and topologySpreadConstraints when set, and its affinity, by default
replicas preferably on different nodes (a preferred pod anti-affinity, as the gateway's). Not
topologySpreadConstraints by default: a pod's own constraints replace the scheduler's default
spread (over nodes and zones, tolerant of nodes without a zone label), and with them the
scheduler scores every node lacking one of their keys 0. Called with (dict "name"
<app.kubernetes.io/name> "v" <the component's values>). */ -}}
{{- define "spur.placement" -}}
{{- with .v.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
{{- if .v.affinity }}
{{- toYaml .v.affinity | nindent 2 }}
{{- else }}
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector: {matchLabels: {app.kubernetes.io/name: {{ .name }}}}
{{- end }}
{{- with .v.topologySpreadConstraints }}
topologySpreadConstraints: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- /* A PodDisruptionBudget for a Deployment of more than one replica: a node drain takes one
at a time, so the others keep serving (with one replica there is none: it would block drains or
protect nothing). Called with (dict "name" <app.kubernetes.io/name> "replicas" <n> "root" $),
at the end of a template. */ -}}
{{- define "spur.pdb" -}}
{{- if gt (int .replicas) 1 }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels: {{- include "spur.labels" .root | nindent 4 }}
spec:
  maxUnavailable: 1
  selector:
    matchLabels: {app.kubernetes.io/name: {{ .name }}}
{{- end }}
{{- end -}}
