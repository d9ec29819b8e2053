"""The chart grants exactly the permissions the operator uses (operator/shard_operator/objects/permissions.py)."""

from __future__ import annotations

from collections import defaultdict

from shard_operator.objects.permissions import NETWORK_POLICY_PERMISSIONS, PERMISSIONS, permissions

from .chart import CUSTOM_VALUES, NAMESPACE, find, one, render

# Resources of PERMISSIONS that are not namespaced: they can only be granted by a ClusterRole.
CLUSTER_SCOPED = {("", "nodes"), ("", "namespaces"), ("apiextensions.k8s.io", "customresourcedefinitions")}


def granted(roles) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs, over every rule of the given roles."""
    grants: dict[tuple[str, str], set[str]] = defaultdict(set)
    for role in roles:
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants[(group, resource)].update(rule["verbs"])
    return dict(grants)


# The chart's default (networkPolicy.enabled): the operator also manages each model's NetworkPolicy.
ALL = permissions(network_policies=True)


def expected(scope: set[tuple[str, str]]) -> dict[tuple[str, str], set[str]]:
    return {key: set(verbs) for key, verbs in ALL.items() if key in scope}


def rules_yaml(scope: set[tuple[str, str]]) -> str:
    """The rules a template should hold for `scope`, grouped as _rbac.tpl writes them (for the failure message)."""
    grouped: dict[tuple[str, tuple[str, ...]], list[str]] = defaultdict(list)
    for (group, resource), verbs in ALL.items():
        if (group, resource) in scope:
            grouped[(group, verbs)].append(resource)
    return "\n".join(f'- apiGroups: ["{group}"]\n  resources: [{", ".join(resources)}]\n  verbs: [{", ".join(verbs)}]'
                     for (group, verbs), resources in grouped.items())


def assert_grants(roles, scope: set[tuple[str, str]]) -> None:
    assert granted(roles) == expected(scope), (
        "the chart's RBAC differs from operator/shard_operator/objects/permissions.py; in "
        "helm/shard-operator/templates/_rbac.tpl make\nclusterScopedRules:\n"
        f"{rules_yaml(set(ALL) & CLUSTER_SCOPED)}\nnamespacedRules:\n{rules_yaml(set(ALL) - CLUSTER_SCOPED)}")


def operator_env(objects) -> dict[str, str]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_no_wildcards_anywhere(rendered):
    _, objects = rendered
    for role in find(objects, "ClusterRole") + find(objects, "Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], role["metadata"]["name"]


def test_cluster_wide_grants_exactly_the_permission_table(default_objects):
    role = one(default_objects, "ClusterRole")
    assert_grants([role], set(ALL))
    assert not find(default_objects, "Role")
    assert operator_env(default_objects)["SHARD_OPERATOR_NETWORK_POLICIES"] == "true"


def test_without_network_policies_the_operator_neither_makes_them_nor_may():
    objects = render(sets=["networkPolicy.enabled=false"])
    assert not find(objects, "NetworkPolicy")
    assert_grants([one(objects, "ClusterRole")], set(PERMISSIONS))
    assert not set(NETWORK_POLICY_PERMISSIONS) & set(granted([one(objects, "ClusterRole")]))
    assert operator_env(objects)["SHARD_OPERATOR_NETWORK_POLICIES"] == "false"


def test_watched_namespaces_get_the_namespaced_permissions_only_there(custom_objects):
    namespaced = set(ALL) - CLUSTER_SCOPED
    assert_grants(find(custom_objects, "ClusterRole"), set(ALL) & CLUSTER_SCOPED)
    roles = find(custom_objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(CUSTOM_VALUES["watchNamespaces"])
    for role in roles:
        assert_grants([role], namespaced)


def test_bindings_tie_the_roles_to_the_operator_account(rendered):
    _, objects = rendered
    account = one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert one(objects, "ServiceAccount")["metadata"]["name"] == account
    roles = {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"])
             for r in find(objects, "ClusterRole") + find(objects, "Role")}
    bindings = find(objects, "ClusterRoleBinding") + find(objects, "RoleBinding")
    assert len(bindings) == len(roles)
    for binding in bindings:
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], namespace, ref["name"]) in roles
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


def test_only_the_operator_pod_mounts_a_token(rendered):
    _, objects = rendered
    assert one(objects, "ServiceAccount")["automountServiceAccountToken"] is False
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
