{{/*
Names and labels (app.kubernetes.io/*). With the release named "gpuguard" in namespace
"gpuguard", every object is named as in manifests/ (tests/test_chart.py compares them).
*/}}

{{- define "gpuguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuguard.fullname" -}}
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

{{- define "gpuguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpuguard.labels" -}}
helm.sh/chart: {{ include "gpuguard.chart" . }}
{{ include "gpuguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuguard
{{- end }}

{{/*
The sharing agent runs in a DaemonSet of its own, under a ServiceAccount of its own
(docs/reliability.md S1): a pod has exactly one ServiceAccount, and the agent's (which alone may
patch Nodes, under the admission fence) must not be the enforcer's. Its DaemonSet and account are
named "<fullname>-agent".
*/}}
{{- define "gpuguard.agentFullname" -}}
{{- printf "%s-agent" (include "gpuguard.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/* The enforcer's ServiceAccount (manifests/rbac.yaml): pods and its Node read, Events. */}}
{{- define "gpuguard.serviceAccountName" -}}
{{- include "gpuguard.fullname" . }}
{{- end }}

{{/* The agent's ServiceAccount: the only one that may patch Nodes. */}}
{{- define "gpuguard.agentServiceAccountName" -}}
{{- include "gpuguard.agentFullname" . }}
{{- end }}

{{/* The username the API server gives the enforcer's tokens (its Event fence matches it). */}}
{{- define "gpuguard.serviceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpuguard.serviceAccountName" . }}
{{- end }}

{{/* The username the API server gives the agent's tokens (the fence matches it). */}}
{{- define "gpuguard.agentServiceAccountUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "gpuguard.agentServiceAccountName" . }}
{{- end }}

{{/*
The agent's pods. Their app.kubernetes.io/name is "<name>-agent", not "<name>": the enforcer
DaemonSet's selector (name + instance, immutable since the first install) must not match them,
or it would adopt an orphaned agent pod as its own and delete its enforcer on that node.
*/}}
{{- define "gpuguard.agentSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-agent" (include "gpuguard.name" . | trunc 57 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpuguard.agentPodLabels" -}}
helm.sh/chart: {{ include "gpuguard.chart" . }}
{{ include "gpuguard.agentSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuguard
app.kubernetes.io/component: agent
{{- end }}

{{/* Both DaemonSets' pods: what the metrics Service selects. */}}
{{- define "gpuguard.podsSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: gpuguard
{{- end }}

{{- define "gpuguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The sharing ConfigMap's fixed name (docs/design.md#sharing-config); the agent reads it in the release's
namespace and RBAC grants only it. */}}
{{- define "gpuguard.sharingName" -}}
gpuguard-sharing
{{- end }}

{{/*
config.toml: the user's `config` map plus the keys the chart owns (the schema rejects those in
`config`): the version, where the host's cgroup tree is mounted, the mode, the node lock file
(in the host directory the DaemonSet mounts), the agent's sharing ConfigMap and eviction switch,
and the two listen addresses the probes and Service use.
*/}}
{{- define "gpuguard.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $_ := set $config "version" 1 }}
{{- $node := dict "proc_root" "/proc" "cgroup_root" "/host/sys/fs/cgroup" }}
{{- /* The kubelet's socket, in the directory daemonset.yaml mounts (volume "pod-resources"). */}}
{{- $_ := set $node "pod_resources_socket" (ternary "/var/lib/kubelet/pod-resources/kubelet.sock" "" (ne .Values.kubelet.podResourcesDir "")) }}
{{- $_ := set $config "node" $node }}
{{- $enforcement := default (dict) (get $config "enforcement") }}
{{- $_ := set $enforcement "mode" .Values.enforcement.mode }}
{{- /* The node lock, in the host directory daemonset.yaml mounts (volume "lock"). */}}
{{- $_ := set $enforcement "lock_file" "/run/gpuguard/enforcer.lock" }}
{{- /* The allocation guard's keys only when on: off, config.toml (and its checksum) is as before. */}}
{{- if .Values.enforcement.allocGuard.enabled }}
{{- $_ := set $enforcement "alloc_guard" true }}
{{- /* libcuda.so.1 in the host directory daemonset.yaml mounts (volume "driver-lib"). */}}
{{- $_ := set $enforcement "alloc_guard_library" (printf "%s/libcuda.so.1" (include "gpuguard.driverLibMount" .)) }}
{{- end }}
{{- $_ := set $config "enforcement" $enforcement }}
{{- $agent := default (dict) (get $config "agent") }}
{{- $_ := set $agent "sharing_namespace" .Release.Namespace }}
{{- $_ := set $agent "sharing_name" (include "gpuguard.sharingName" .) }}
{{- $_ := set $agent "allow_eviction" (and .Values.agent.enabled .Values.agent.allowEviction) }}
{{- $_ := set $agent "metrics_address" "0.0.0.0:9411" }}
{{- $_ := set $config "agent" $agent }}
{{- $_ := set $config "metrics" (dict "address" "0.0.0.0:9410") }}
{{- toToml $config }}
{{- end }}

{{/*
The NVIDIA ConfigMaps the agent may read, as {namespace: [names]}: those sharing names, else
NVIDIA's defaults (manifests/rbac.yaml).
*/}}
{{- define "gpuguard.nvidiaConfigMaps" -}}
{{- $refs := list }}
{{- if .Values.sharing }}
{{- with .Values.sharing.devicePluginConfig }}{{ $refs = append $refs . }}{{ end }}
{{- with .Values.sharing.migConfig }}{{ $refs = append $refs . }}{{ end }}
{{- else }}
{{- $refs = list (dict "namespace" "gpu-operator" "name" "nvidia-time-slicing-config") (dict "namespace" "gpu-operator" "name" "nvidia-mig-config") }}
{{- end }}
{{- $byNamespace := dict }}
{{- range $refs }}
{{- $names := default (list) (get $byNamespace .namespace) }}
{{- if not (has .name $names) }}
{{- $_ := set $byNamespace .namespace (append $names .name) }}
{{- end }}
{{- end }}
{{- toJson $byNamespace }}
{{- end }}

{{/*
Checks against the cluster the release goes into (no half-installed release). Helm's
`lookup` reads the API server during `helm install` / `helm upgrade` (and `--dry-run=server`); under
`helm template`, `helm lint`, ct lint and helm-unittest it has no cluster and returns an empty
map. Namespace kube-system exists in every cluster (the API server creates it), so an empty answer
for it means "no cluster to ask": then nothing is checked and everything renders as if each
prerequisite were there (manifests/ is rendered that way). "true" or "".
*/}}
{{- define "gpuguard.liveCluster" -}}
{{- if lookup "v1" "Namespace" "" "kube-system" }}true{{ end }}
{{- end }}

{{/*
The namespaces of gpuguard.nvidiaConfigMaps that the live cluster does not have (a JSON list,
sorted; always empty without a cluster). The agent's Role there is not rendered: a Role in a
namespace that does not exist fails `helm install` after the DaemonSets were created, and leaves
the release failed. NOTES.txt names them, and the same install command run again once the
namespace exists (the GPU operator installed) grants the Role.
*/}}
{{- define "gpuguard.absentNvidiaNamespaces" -}}
{{- $absent := list }}
{{- if include "gpuguard.liveCluster" . }}
{{- range $namespace, $_ := include "gpuguard.nvidiaConfigMaps" . | fromJson }}
{{- if not (lookup "v1" "Namespace" "" $namespace) }}
{{- $absent = append $absent $namespace }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $absent }}
{{- end }}

{{/*
Fails the render, before anything is created or changed, when runtimeClassName names a
RuntimeClass the live cluster does not have: the enforcer's pods could not be created on any node
(the DaemonSet would sit at 0 of N with one Event). The message says how to fix it.
*/}}
{{- define "gpuguard.checkRuntimeClass" -}}
{{- $name := .Values.runtimeClassName }}
{{- if and $name (include "gpuguard.liveCluster" .) }}
{{- if not (lookup "node.k8s.io/v1" "RuntimeClass" "" $name) }}
{{- fail (printf "RuntimeClass %q (value runtimeClassName) does not exist in this cluster, so the enforcer's pods could not start on any node; nothing was installed or changed. Install NVIDIA's GPU operator, or the NVIDIA container toolkit with a RuntimeClass %q for its runtime (kubectl get runtimeclass lists them); where NVIDIA's runtime is already the nodes' default container runtime, set runtimeClassName to \"\" (--set runtimeClassName=\"\"). Then run the same command again (docs/install.md, Prerequisites)." $name $name) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The sharing ConfigMap as the live cluster has it, when it is not this release's: JSON
{"exists": bool, "foreign": bool}. A ConfigMap `kubectl create configmap` made (README, Sharing
profiles) and the value `sharing` cannot both own it: Helm would refuse to adopt it with "invalid
ownership metadata", which names neither way out. Always {"exists": false} without a cluster.
*/}}
{{- define "gpuguard.sharingConfigMap" -}}
{{- $found := lookup "v1" "ConfigMap" .Release.Namespace (include "gpuguard.sharingName" .) }}
{{- $annotations := dig "metadata" "annotations" dict ($found | default dict) }}
{{- $ours := and (eq (get $annotations "meta.helm.sh/release-name") .Release.Name) (eq (get $annotations "meta.helm.sh/release-namespace") .Release.Namespace) }}
{{- toJson (dict "exists" (not (empty $found)) "foreign" (and (not (empty $found)) (not $ours))) }}
{{- end }}

{{/*
Fails the render, before anything is created or changed, when the value `sharing` is set and the
live cluster already has the sharing ConfigMap from outside this release: naming both ways.
*/}}
{{- define "gpuguard.checkSharingConfigMap" -}}
{{- if .Values.sharing }}
{{- $cm := include "gpuguard.sharingConfigMap" . | fromJson }}
{{- if $cm.foreign }}
{{- $name := printf "%s/%s" .Release.Namespace (include "gpuguard.sharingName" .) }}
{{- fail (printf "ConfigMap %s already exists and is not this release's (made by kubectl create configmap, or another release), so the value sharing cannot own it; nothing was installed or changed. Give the sharing config one way: keep that ConfigMap and leave sharing empty (the agent reads it as it is; edit it with kubectl), or delete it (kubectl -n %s delete configmap %s) and run the same command again, so the chart renders it from the value sharing." $name .Release.Namespace (include "gpuguard.sharingName" .)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Whether the config names "dra" in limits.sources on a cluster that does not serve
resource.k8s.io/v1 (Kubernetes before 1.34): gpuguard would read no claim there, and every DRA
pod would be held as one that declares nothing. "true" or "".
*/}}
{{- define "gpuguard.draWithoutApi" -}}
{{- $sources := dig "limits" "sources" list (.Values.config | default dict) }}
{{- if has "dra" $sources }}
{{- if or (not (.Capabilities.APIVersions.Has "resource.k8s.io/v1")) (semverCompare "<1.34-0" .Capabilities.KubeVersion.Version) }}true{{ end }}
{{- end }}
{{- end }}

{{/*
Where the enforcer sees the host's driver library directory (enforcement.allocGuard.libraryDir)
when the allocation guard is on: config enforcement.alloc_guard_library's default directory.
*/}}
{{- define "gpuguard.driverLibMount" -}}
/host/usr/lib/x86_64-linux-gnu
{{- end }}
