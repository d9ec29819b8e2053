"""GPU accounting from pods and nodes, and the operator's settings."""

from __future__ import annotations

import pytest

from shard_operator.planning.inventory import parse_devices
from shard_operator.reconcile.capacity import (
    extended_requests,
    fingerprint,
    free_gpus,
    gpu_use,
    healthy_nodes,
    slim_node,
    used_per_node,
)
from shard_operator.settings import Settings
from tests.support.cluster import gpu_node


def pod(requests=None, limits=None, node="a", phase="Running", ours=False):
    meta = {"name": "p", "namespace": "ns", "annotations": {"sharding.dev/node": node} if ours else {}}
    spec = {"containers": [{"resources": {"requests": requests or {}, "limits": limits or {}}}]}
    if not ours:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


@pytest.mark.parametrize("p,expected", [
    (pod({"cpu": "2", "nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"}), {"nvidia.com/gpu": 1}),
    (pod(None, {"nvidia.com/gpu": "4"}), {"nvidia.com/gpu": 4}),
    (pod({"cpu": "2"}), {}),
])
def test_extended_requests(p, expected):
    assert extended_requests(p) == expected


def test_gpu_use_counts_placed_live_pods_only():
    assert gpu_use(pod(limits={"nvidia.com/gpu": "2"}), "").node == "a"
    assert gpu_use(pod(limits={"nvidia.com/gpu": "2"}, phase="Succeeded"), "") is None
    assert gpu_use(pod(limits={"nvidia.com/gpu": "2"}, node=""), "") is None
    ours = gpu_use(pod(limits={"nvidia.com/gpu": "1"}, node="b", ours=True), "m")
    assert (ours.node, ours.model) == ("b", "m")  # our pods count where the plan pinned them


def test_free_and_foreign_gpus():
    nodes = [gpu_node("a", gpus=4), gpu_node("b", gpus=2)]
    uses = [gpu_use(pod(limits={"nvidia.com/gpu": "1"}, node="a", ours=True), "m"),
            gpu_use(pod(limits={"nvidia.com/gpu": "2"}, node="a"), ""),
            gpu_use(pod(limits={"amd.com/gpu": "2"}, node="b"), "")]
    assert free_gpus(nodes, uses, "nvidia.com/gpu") == {"a": 1, "b": 2}
    assert used_per_node(uses, "nvidia.com/gpu", exclude=("ns", "m")) == {"a": 2}
    pinned = gpu_use(pod(limits={"nvidia.com/gpu": "2"}, node="b", ours=True), "other-model")
    assert not pinned.scheduled
    assert used_per_node(uses + [pinned], "nvidia.com/gpu", exclude=("ns", "m")) == {"a": 2}  # not bound yet
    assert free_gpus(nodes, uses + [pinned], "nvidia.com/gpu") == {"a": 1, "b": 0}  # but it will take them


def test_healthy_nodes_and_slim_nodes():
    nodes = [gpu_node("a"), gpu_node("b", ready=False), gpu_node("c", unschedulable=True)]
    assert healthy_nodes(nodes) == {"a", "c"}
    slim = slim_node(nodes[2])
    assert slim["spec"] == {"unschedulable": True}
    assert slim["status"]["allocatable"]["nvidia.com/gpu"] == "2"


def test_fingerprint_tracks_the_pool():
    assert fingerprint(parse_devices("a:24GiB*2")) == fingerprint(parse_devices("a:24GiB*2"))
    assert fingerprint(parse_devices("a:24GiB*2")) != fingerprint(parse_devices("a:24GiB*1"))


def test_settings_from_environment():
    s = Settings.from_env({"SHARD_OPERATOR_NAMESPACES": "a, b", "SHARD_OPERATOR_SETTLE_SECONDS": "2.5",
                           "SHARD_OPERATOR_RESTART_BUDGET": "7", "SHARD_OPERATOR_STANDALONE": "false",
                           "SHARD_OPERATOR_HOST_PATH_PREFIX": "/host", "UNRELATED": "x"})
    assert (s.namespaces, s.settle_seconds, s.restart_budget, s.standalone, s.host_path_prefix) == \
        (("a", "b"), 2.5, 7, False, "/host")
    assert Settings.from_env({}) == Settings()
    with pytest.raises(ValueError, match="SHARD_OPERATOR_RESTART_BUDGET='many': expected a int"):
        Settings.from_env({"SHARD_OPERATOR_RESTART_BUDGET": "many"})
