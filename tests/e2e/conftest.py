"""One dev cluster per module: the emulated API server, the process kubelet, the Service proxy and
the real operator process, with the demo model on the nodes' filesystem."""

from __future__ import annotations

import os

import pytest

from shard_devcluster.cluster import BackgroundCluster, DevCluster

from .harness import Harness, Report

MODELS = "var/lib/shard-operator/models"  # the example's hostPath, under the nodes' filesystem

# Quicker than the dev cluster's defaults: node changes settle in 1 s, memory is polled every 1 s.
OPERATOR_ENV = {"SETTLE_SECONDS": "1", "STATUS_POLL_SECONDS": "1", "RESYNC_SECONDS": "3"}


@pytest.fixture(scope="session")
def report():
    record = Report(os.environ.get("SHARD_E2E_REPORT"))
    yield record
    record.write()


def start_cluster(workdir, nodes) -> BackgroundCluster:
    from shard_operator.local.demo_model import write_demo_model

    write_demo_model(workdir / "host" / MODELS / "demo-llama")
    cluster = DevCluster(workdir, nodes=nodes, operator_env=OPERATOR_ENV, probe_period=0.5, grace=3)
    return BackgroundCluster(cluster)


@pytest.fixture(scope="module")
def harness_for(tmp_path_factory):
    """harness_for(nodes) -> a Harness of a cluster of those nodes, stopped at the module's end."""
    started = []

    def start(nodes) -> Harness:
        background = start_cluster(tmp_path_factory.mktemp("cluster"), nodes)
        background.start()
        started.append(background)
        return Harness(background)
    yield start
    for background in started:
        background.stop()
