{{/*
The operator's permissions, exactly operator/shard_operator/permissions.py (a test compares them
and prints these rules when the table changes); NETWORK_POLICY_PERMISSIONS with networkPolicy.enabled. Split by scope so that watching a few namespaces
grants the namespaced ones only there.
*/}}

{{- define "shard-operator.clusterScopedRules" -}}
# The device inventory (the GPU nodes of every pool), and the namespaces kopf serves.
- apiGroups: [""]
  resources: [nodes, namespaces]
  verbs: [list, watch]
# kopf's resource discovery.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}

{{- define "shard-operator.namespacedRules" -}}
# The ShardedModels: kopf keeps its finalizer on them; the operator writes their status.
- apiGroups: [sharding.dev]
  resources: [shardedmodels]
  verbs: [list, watch, patch]
- apiGroups: [sharding.dev]
  resources: [shardedmodels/status]
  verbs: [patch]
# Rank pods and profiling pods; every pod is watched for GPU accounting.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
# The profiling pod prints the model's profile to its log.
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# Per group a headless Service and the plan ConfigMap; per model the endpoint and metrics
# Services and the plan record.
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [list, create, patch, delete]
# Per group the Secret with the key that authenticates its ranks' heartbeats: written and
# deleted, never read (no get, list or watch).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, delete]
# Events on ShardedModels: plan decisions, rebalances, failures.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.networkPolicy.enabled }}
# Per model, the NetworkPolicy that opens its ranks' ports to its own ranks only.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, create, patch]
{{- end }}
{{- end }}
