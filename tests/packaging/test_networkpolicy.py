"""The NetworkPolicies, judged by what they let through (Kubernetes' ingress semantics, evaluated here)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from .chart import NAMESPACE, find, operator_objects, render, selects

RENDEZVOUS, NCCL_EPHEMERAL, SERVING = 29500, 43117, 8000


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def rank(model: str, namespace: str = "inference") -> Pod:
    return Pod(namespace, {"sharding.dev/model": model, "sharding.dev/group": "0", "sharding.dev/rank": "1"})


def peer_matches(peer: dict, policy_namespace: str, src: Pod) -> bool:
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], src.ns_labels()):
            return False
    elif src.namespace != policy_namespace:  # a bare podSelector means the policy's namespace
        return False
    return selects(peer.get("podSelector", {}), src.labels)


def allowed(policies: list[dict], src: Pod, dst: Pod, port: int) -> bool:
    """Ingress: allowed if no policy selects dst, else if any rule of a selecting policy admits it."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == dst.namespace
                 and "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], dst.labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            port_ok = not ports or any(p["port"] == port for p in ports)
            peers = rule.get("from")
            peer_ok = not peers or any(peer_matches(p, policy["metadata"]["namespace"], src) for p in peers)
            if port_ok and peer_ok:
                return True
    return False


def policies(objects) -> list[dict]:
    return find(objects, "NetworkPolicy")


def test_default_ranks_reach_each_other_and_others_reach_only_serving(default_objects):
    pols = policies(default_objects)
    a0, a1, b0 = rank("alpha", NAMESPACE), rank("alpha", NAMESPACE), rank("beta", NAMESPACE)
    stranger = Pod(NAMESPACE, {"app": "curl"})
    outside = Pod("default", {"app": "gateway"})
    for port in (RENDEZVOUS, NCCL_EPHEMERAL, SERVING):
        assert allowed(pols, a1, a0, port)
    for src in (stranger, outside):
        assert allowed(pols, src, a0, SERVING)
        assert not allowed(pols, src, a0, RENDEZVOUS)
        assert not allowed(pols, src, a0, NCCL_EPHEMERAL)
    # Without a list of models to isolate, ranks of another model in the namespace are peers too.
    assert allowed(pols, b0, a0, RENDEZVOUS)


def test_isolated_model_accepts_rendezvous_only_from_its_own_ranks(custom_objects):
    pols = policies(custom_objects)
    for ns in ("inference", "research"):
        big0, big1, small = rank("llama-70b", ns), rank("llama-70b", ns), rank("llama-8b", ns)
        assert allowed(pols, big1, big0, RENDEZVOUS) and allowed(pols, big1, big0, NCCL_EPHEMERAL)
        assert not allowed(pols, small, big0, RENDEZVOUS)
        assert not allowed(pols, small, big0, NCCL_EPHEMERAL)
        # Ranks of models not listed accept each other, as in the default.
        assert allowed(pols, rank("llama-8b", ns), small, RENDEZVOUS)
    # The same model name in another namespace is another model.
    assert not allowed(pols, rank("llama-70b", "research"), rank("llama-70b", "inference"), RENDEZVOUS)


@pytest.mark.parametrize("port", [SERVING, 8080])
def test_serving_ports_only_from_the_configured_peers_and_the_operator(custom_objects, port):
    pols = policies(custom_objects)
    dst = rank("llama-70b")
    gateway = Pod("gateway", {"app": "envoy"})
    operator = Pod(NAMESPACE, {"app.kubernetes.io/name": "shard-operator", "app.kubernetes.io/instance": "so"})
    stranger = Pod("default", {"app": "curl"})
    assert allowed(pols, gateway, dst, port)
    assert allowed(pols, operator, dst, port)
    assert not allowed(pols, stranger, dst, port)
    assert not allowed(pols, gateway, dst, RENDEZVOUS)


def test_rank_pods_the_operator_builds_get_exactly_the_intended_access(default_objects):
    pols = policies(default_objects)
    rank_pods = find(operator_objects(), "Pod")
    assert len(rank_pods) >= 2
    stranger = Pod(NAMESPACE, {"app": "curl"})
    for dst in rank_pods:
        target = Pod(dst["metadata"]["namespace"], dst["metadata"]["labels"])
        ports = {p["name"]: p["containerPort"] for p in dst["spec"]["containers"][0]["ports"]}
        for src in rank_pods:
            source = Pod(src["metadata"]["namespace"], src["metadata"]["labels"])
            assert all(allowed(pols, source, target, port) for port in [*ports.values(), NCCL_EPHEMERAL])
        assert allowed(pols, stranger, target, ports["http"])
        assert not allowed(pols, stranger, target, ports["rendezvous"])


def test_isolated_models_with_long_names_get_distinct_valid_policies():
    long_a, long_b = "a" * 60 + "x", "a" * 60 + "y"
    objects = render(sets=[f"networkPolicy.isolateModels={{{long_a},{long_b},llama-3.1-8b}}"])
    names = [p["metadata"]["name"] for p in policies(objects)]
    assert len(set(names)) == len(names) == 5  # workers, operator, three models
    assert all(len(n) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", n) for n in names), names
    pols = policies(objects)
    assert not allowed(pols, rank(long_b, NAMESPACE), rank(long_a, NAMESPACE), RENDEZVOUS)
    assert allowed(pols, rank(long_a, NAMESPACE), rank(long_a, NAMESPACE), RENDEZVOUS)


def test_policies_cover_the_namespaces_where_models_run(default_objects, custom_objects):
    def worker_namespaces(objects):
        return sorted({p["metadata"]["namespace"] for p in policies(objects)
                       if p["metadata"]["name"].endswith("-workers")})
    assert worker_namespaces(default_objects) == [NAMESPACE]
    assert worker_namespaces(custom_objects) == ["inference", "research"]


def test_operator_accepts_only_health_and_metrics(rendered):
    _, objects = rendered
    pols = policies(objects)
    operator = Pod(NAMESPACE, {"app.kubernetes.io/name": "shard-operator", "app.kubernetes.io/instance": "so"})
    prometheus = Pod("monitoring", {"app": "prometheus"})
    container = find(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    for port in container["ports"]:
        assert allowed(pols, prometheus, operator, port["containerPort"])
    assert not allowed(pols, prometheus, operator, 22)
