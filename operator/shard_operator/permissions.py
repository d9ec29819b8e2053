"""Every Kubernetes API permission the operator uses, in one table.

The Helm chart's ClusterRole is checked against this table by a test, and the operator's code is
checked to use nothing outside it: least privilege, written down once.
"""

from __future__ import annotations

# (apiGroup, resource) -> verbs
PERMISSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("sharding.dev", "shardedmodels"): ("get", "list", "watch", "patch"),
    ("sharding.dev", "shardedmodels/status"): ("get", "patch"),
    ("", "pods"): ("get", "list", "watch", "create", "delete", "patch"),
    ("", "services"): ("get", "list", "watch", "create", "delete", "patch"),
    ("", "configmaps"): ("get", "list", "watch", "create", "delete", "patch"),
    ("", "nodes"): ("get", "list", "watch"),
    ("", "events"): ("create",),
    ("events.k8s.io", "events"): ("create",),
    ("apiextensions.k8s.io", "customresourcedefinitions"): ("get", "list", "watch"),
    ("", "namespaces"): ("get", "list", "watch"),
}
