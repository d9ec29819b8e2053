"""Moved to `shard_operator.devcluster.kubelet` (the dev cluster ships it); this import path stays."""

from shard_operator.devcluster.kubelet import NODES, PODS, FakeKubelet, required_node  # noqa: F401
