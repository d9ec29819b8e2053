"""Every Kubernetes API permission the operator uses, in one table.

The Helm chart's ClusterRole is checked against this table by a test, and every operator test
against the emulated API server checks that the operator made no request outside it: least
privilege, written down once. Discovery (/api, /apis) needs no grant.
"""

from __future__ import annotations

# (apiGroup, resource) -> verbs
PERMISSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    # kopf watches the models and keeps its finalizer on them (patch); we write the status.
    ("sharding.dev", "shardedmodels"): ("list", "watch", "patch"),
    ("sharding.dev", "shardedmodels/status"): ("patch",),
    # Rank pods and profiling pods; all pods are watched for GPU accounting.
    ("", "pods"): ("list", "watch", "create", "delete"),
    ("", "pods/log"): ("get",),  # the profiling pod's output
    ("", "services"): ("list", "create", "patch", "delete"),
    ("", "configmaps"): ("list", "create", "patch", "delete"),
    # Each group's key (manifests.group_secret): written and deleted, never read.
    ("", "secrets"): ("create", "delete"),
    ("", "nodes"): ("list", "watch"),
    ("", "events"): ("create",),
    # kopf: resource discovery, and namespace patterns (SHARD_OPERATOR_NAMESPACES=team-*).
    ("apiextensions.k8s.io", "customresourcedefinitions"): ("list", "watch"),
    ("", "namespaces"): ("list", "watch"),
}

# Only with Settings.network_policies: each model's NetworkPolicy (see manifests.rank_network_policy).
NETWORK_POLICY_PERMISSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("networking.k8s.io", "networkpolicies"): ("list", "create", "patch"),
}


def permissions(network_policies: bool) -> dict[tuple[str, str], tuple[str, ...]]:
    """What an operator with these settings may ask for."""
    return {**PERMISSIONS, **(NETWORK_POLICY_PERMISSIONS if network_policies else {})}
