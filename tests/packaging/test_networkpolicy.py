"""The NetworkPolicies, judged by what they let through (Kubernetes' ingress semantics, evaluated here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from shard_operator.objects.manifests import Owner, rank_network_policy

from .chart import NAMESPACE, find, operator_objects, selects

RENDEZVOUS, NCCL_EPHEMERAL, SERVING = 29500, 43117, 8000


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # its containers' named ports

    def port_matches(self, rule_port: int | str, port: int) -> bool:
        """A rule's port is a number, or the name of a port this pod declares."""
        return rule_port == port or self.ports.get(str(rule_port)) == port

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
            port_ok = not ports or any(dst.port_matches(p["port"], port) for p in ports)
            peers = rule.get("from")
            peer_ok = not peers or any(peer_matches(p, policy["metadata"]["namespace"], src) for p in peers)
            if port_ok and peer_ok:
                return True
    return False


def policies(objects, models: tuple[tuple[str, str], ...] = ()) -> list[dict]:
    """The chart's NetworkPolicies, plus the ones the operator makes for (model, namespace) pairs."""
    return find(objects, "NetworkPolicy") + [rank_network_policy(Owner(name, namespace)) for name, namespace in models]


def test_ranks_of_a_model_reach_each_other_and_everyone_else_only_serving(default_objects):
    pols = policies(default_objects, (("alpha", NAMESPACE), ("beta", NAMESPACE)))
    a0, a1, b0 = rank("alpha", NAMESPACE), rank("alpha", NAMESPACE), rank("beta", NAMESPACE)
    stranger = Pod(NAMESPACE, {"app": "curl"})
    outside = Pod("default", {"app": "gateway"})
    for port in (RENDEZVOUS, NCCL_EPHEMERAL, SERVING):
        assert allowed(pols, a1, a0, port)
    for src in (stranger, outside, b0):
        assert allowed(pols, src, a0, SERVING)
        assert not allowed(pols, src, a0, RENDEZVOUS)
        assert not allowed(pols, src, a0, NCCL_EPHEMERAL)


def test_without_the_operator_policy_ranks_get_only_serving_traffic(default_objects):
    """The chart alone opens no rank port between ranks: each model's own policy does."""
    pols = policies(default_objects)
    assert not allowed(pols, rank("alpha", NAMESPACE), rank("alpha", NAMESPACE), RENDEZVOUS)
    assert allowed(pols, rank("alpha", NAMESPACE), rank("alpha", NAMESPACE), SERVING)


def test_the_same_model_name_in_another_namespace_is_another_model(custom_objects):
    pols = policies(custom_objects, (("llama-70b", "inference"), ("llama-70b", "research")))
    big0, big1 = rank("llama-70b", "inference"), rank("llama-70b", "inference")
    assert allowed(pols, big1, big0, RENDEZVOUS) and allowed(pols, big1, big0, NCCL_EPHEMERAL)
    assert not allowed(pols, rank("llama-70b", "research"), big0, RENDEZVOUS)
    assert not allowed(pols, rank("llama-8b", "inference"), big0, NCCL_EPHEMERAL)


@pytest.mark.parametrize("port", [SERVING, 8080])
def test_serving_ports_only_from_the_configured_peers_and_the_operator(custom_objects, port):
    pols = policies(custom_objects, (("llama-70b", "inference"),))
    dst = rank("llama-70b")
    gateway = Pod("gateway", {"app": "envoy"})
    operator = Pod(NAMESPACE, {"app.kubernetes.io/name": "shard-operator", "app.kubernetes.io/instance": "so"})
    stranger = Pod("default", {"app": "curl"})
    assert allowed(pols, gateway, dst, port)
    assert allowed(pols, operator, dst, port)
    assert not allowed(pols, stranger, dst, port)
    assert not allowed(pols, gateway, dst, RENDEZVOUS)


def test_rank_pods_the_operator_builds_get_exactly_the_intended_access(default_objects):
    built = operator_objects()
    pols = policies(default_objects) + find(built, "NetworkPolicy")
    rank_pods = find(built, "Pod")
    assert len(rank_pods) >= 2
    stranger = Pod(NAMESPACE, {"app": "curl"})
    other_model = rank("another-model", NAMESPACE)
    for dst in rank_pods:
        ports = {p["name"]: p["containerPort"] for p in dst["spec"]["containers"][0]["ports"]}
        target = Pod(dst["metadata"]["namespace"], dst["metadata"]["labels"], ports=ports)
        serving = [n for n in ports if n != "rendezvous"]
        assert serving == ["http",
                           *(f"http-{i}" for i in range(1, int(dst["metadata"]["labels"]["sharding.dev/ranks"])))]
        for src in rank_pods:
            source = Pod(src["metadata"]["namespace"], src["metadata"]["labels"])
            assert all(allowed(pols, source, target, port) for port in [*ports.values(), NCCL_EPHEMERAL])
        for src in (stranger, other_model):  # every rank of a pod per tensor-parallel group serves
            assert all(allowed(pols, src, target, ports[name]) for name in serving)
            assert not allowed(pols, src, target, ports["rendezvous"])
            assert not allowed(pols, src, target, NCCL_EPHEMERAL)


def test_the_other_ranks_serving_ports_are_opened_by_name_only(default_objects):
    """A pod of one rank that happens to listen on 8001 gets nothing there: only pods that name a
    port http-1 do (and no rendezvous port can be opened by accident)."""
    pols = policies(default_objects)
    alone = Pod(NAMESPACE, rank("m", NAMESPACE).labels, ports={"http": SERVING, "rendezvous": SERVING + 1})
    block = Pod(NAMESPACE, rank("m", NAMESPACE).labels, ports={"http": SERVING, "http-1": SERVING + 1})
    stranger = Pod(NAMESPACE, {"app": "curl"})
    assert not allowed(pols, stranger, alone, SERVING + 1)
    assert allowed(pols, stranger, block, SERVING + 1)


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
