{{/*
The operator's permissions, exactly operator/shard_operator/permissions.py (a test compares them).
Split by scope so that watching a few namespaces grants the namespaced ones only there.
*/}}

{{- define "shard-operator.clusterScopedRules" -}}
# The device inventory: the GPU nodes of every pool.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
# kopf discovers the namespaces it serves and the ShardedModel CRD.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end }}

{{- define "shard-operator.namespacedRules" -}}
# The ShardedModels: kopf patches its finalizer and progress annotations; status is separate.
- apiGroups: [sharding.dev]
  resources: [shardedmodels]
  verbs: [get, list, watch, patch]
- apiGroups: [sharding.dev]
  resources: [shardedmodels/status]
  verbs: [get, patch]
# What it builds for every group: rank pods, headless and serving Services, the plan ConfigMaps.
- apiGroups: [""]
  resources: [pods, services, configmaps]
  verbs: [get, list, watch, create, delete, patch]
# Events on ShardedModels (plan decisions, rebalances, failures), through either API.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end }}
