"""Moved to `shard_operator.devcluster.apiserver` (the dev cluster ships it); this import path stays."""

from shard_operator.devcluster.apiserver import SM, serve, write_kubeconfig  # noqa: F401
