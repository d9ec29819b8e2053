"""The operator's API edge against the emulated API server: what each call returns, and that every
response is read, so each request hands its connection back to the pool."""

from __future__ import annotations

import asyncio

import kubernetes

from shard_devcluster.apiserver import SM, serve
from shard_devcluster.kubeletserver import LogBuffer
from shard_operator.kube import Kube, client_for
from tests.support.cluster import gpu_node
from tests.support.fakekubelet import FakeKubelet
from tests.support.operator import eventually


def configmap(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"},
            "data": {"k": "v"}}


def writes_and_reads(kube: Kube, rounds: int) -> int:
    """Every kind of call the operator makes, answered 2xx, 404 and 409; returns how many."""
    for i in range(rounds):
        created = kube.create(configmap(f"c{i}"))
        assert created["metadata"]["uid"] and created["metadata"]["resourceVersion"]
        assert kube.create(configmap(f"c{i}")) is None  # 409: it exists
        patched = kube.patch("ConfigMap", "default", f"c{i}", {"data": {"k": "w"}})
        assert patched["data"] == {"k": "w"}
        assert patched["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
        assert [c["metadata"]["name"] for c in kube.list("ConfigMap", "default", "")] == [f"c{i}"]
        assert kube.pod_log("default", "p") == "hello\n"
        model = kube.patch_status("default", "m", {"reason": f"round {i}"})
        assert model["status"]["reason"] == f"round {i}"  # (with the defaults of the status schema)
        assert kube.patch_status("default", "gone", {"reason": "x"}) is None  # 404: deleted meanwhile
        assert kube.delete("ConfigMap", "default", f"c{i}")["metadata"]["name"] == f"c{i}"
        assert kube.delete("ConfigMap", "default", f"c{i}") is None  # 404: gone
    return rounds * 9


async def test_every_response_is_read_so_each_request_hands_its_connection_back():
    async with serve() as (emu, url), FakeKubelet(emu) as kubelet:
        await emu.k8s_create(SM, "default", {"metadata": {"name": "m"}, "spec": {"model": {"path": "x"}}})
        await emu.k8s_create("v1/nodes", None, gpu_node("a"))
        await emu.k8s_create("v1/pods", "default", {"metadata": {"name": "p"}, "spec": {
            "nodeName": "a", "containers": [{"name": "c", "image": "x"}]}})
        kubelet.logs[("default", "p")] = LogBuffer(bytearray(b"hello\n"))
        await eventually(lambda: _log_served(emu))  # (the kubelet has named its endpoint in the Node)
        kube = Kube(client_for(kubernetes.client.Configuration(host=url)), timeout=10)
        try:
            requests = await asyncio.to_thread(writes_and_reads, kube, 5)
            pool = kube.core.api_client.rest_client.pool_manager.connection_from_url(url)
            # One keep-alive connection served every request, one after another: each response was
            # read to its end and its connection returned before the next request needed one (an
            # unread response keeps its connection, and the next request opens a new one).
            assert (pool.num_requests, pool.num_connections) == (requests, 1)
        finally:
            kube.core.api_client.close()


async def _log_served(emu) -> bool:
    node = await emu.k8s_get("v1/nodes", None, "a")
    return bool(((node.get("status") or {}).get("daemonEndpoints") or {}).get("kubeletEndpoint"))
