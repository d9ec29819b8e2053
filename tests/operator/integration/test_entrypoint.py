"""`python -m shard_operator` as a process: KUBECONFIG, settings from the environment, its metrics
and health endpoints on the address it is given, clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shard_devcluster.apiserver import serve, write_kubeconfig
from shard_operator.local.launcher import free_port
from tests.support.cluster import gpu_node, sharded_model, write_model
from tests.support.fakekubelet import FakeKubelet
from tests.support.operator import eventually


@pytest.mark.slow
async def test_the_operator_process_connects_through_kubeconfig_and_stops_on_sigterm(tmp_path):
    model_dir = write_model(tmp_path / "models" / "tiny")
    async with serve() as (emu, url), FakeKubelet(emu):
        await emu.k8s_create("v1/nodes", None, gpu_node("a"))
        metrics_port, health_port = free_port(), free_port()
        # The address the dev cluster's kubelet gives a pod's process (the chart's operator): its own,
        # so the same port stays free on the others (a Service's listener, another pod's).
        env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", url)),
               "SHARD_OPERATOR_METRICS_PORT": str(metrics_port), "SHARD_OPERATOR_BIND_ADDRESS": "127.0.0.2",
               "SHARD_OPERATOR_HOST_PATH_PREFIX": "", "SHARD_OPERATOR_HEALTH_PORT": str(health_port),
               "SHARD_OPERATOR_STATUS_POLL_SECONDS": "0", "SHARD_OPERATOR_DEBOUNCE_SECONDS": "0.01",
               "SHARD_OPERATOR_WORKER_IMAGE": "example.com/from-env:1"}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "shard_operator", env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            await emu.k8s_create("sharding.dev/v1alpha1/shardedmodels", "default", sharded_model("m1", model_dir))

            async def ready():
                obj = await emu.k8s_get("sharding.dev/v1alpha1/shardedmodels", "default", "m1")
                return (obj.get("status") or {}).get("phase") == "Ready"
            await eventually(ready, timeout=60)
            pods = await emu.k8s_list("v1/pods", "default", "sharding.dev/model=m1")
            assert {p["spec"]["containers"][0]["image"] for p in pods} == {"example.com/from-env:1"}
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.2:{metrics_port}/metrics")).text
                assert (await client.get(f"http://127.0.0.2:{health_port}/healthz")).status_code == 200
            for port in (metrics_port, health_port):
                with socket.socket() as other:
                    other.bind(("127.0.0.3", port))  # free there: the operator holds its own address only
            ready = [s for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "shard_operator_models" and s.labels == {"phase": "Ready"}]
            assert [s.value for s in ready] == [1.0]
        finally:
            proc.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
        assert proc.returncode == 0, output.decode()[-2000:]
