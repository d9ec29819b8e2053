"""The operator's API edge against the emulated API server: what each call returns, and that every
response is read, so each request hands its connection back to the pool."""

from __future__ import annotations

import asyncio

import kubernetes
import pytest

from shard_devcluster.apiserver import SM, serve
from shard_devcluster.kubeletserver import LogBuffer
from shard_operator.kube import Kube, NameTaken, client_for
from tests.support.cluster import gpu_node
from tests.support.fakekubelet import FakeKubelet
from tests.support.operator import eventually


def configmap(name: str, owner: dict, kind: str = "ConfigMap") -> dict:
    """An object owned by the ShardedModel `owner` (which exists: the garbage collector deletes
    what only absent owners hold)."""
    return {"apiVersion": "v1", "kind": kind, "data": {"k": "dg=="}, "metadata": {
        "name": name, "namespace": "default", "ownerReferences": [
            {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"]}]}}


async def model(emu, name: str) -> dict:
    return await emu.k8s_create(SM, "default", {"metadata": {"name": name}, "spec": {"model": {"path": "x"}}})


def writes_and_reads(kube: Kube, owner: dict, rounds: int) -> int:
    """Every kind of call the operator makes, answered 2xx, 404 and 409; returns how many."""
    for i in range(rounds):
        created = kube.create(configmap(f"c{i}", owner))
        assert created["metadata"]["uid"] and created["metadata"]["resourceVersion"]
        assert kube.create(configmap(f"c{i}", owner)) is None  # 409: it exists, ours (found with a list)
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
    return rounds * 10


async def test_every_response_is_read_so_each_request_hands_its_connection_back():
    async with serve() as (emu, url), FakeKubelet(emu) as kubelet:
        owner = await model(emu, "m")
        await emu.k8s_create("v1/nodes", None, gpu_node("a"))
        await emu.k8s_create("v1/pods", "default", {"metadata": {"name": "p"}, "spec": {
            "nodeName": "a", "containers": [{"name": "c", "image": "x"}]}})
        kubelet.logs[("default", "p")] = LogBuffer(bytearray(b"hello\n"))
        await eventually(lambda: _log_served(emu))  # (the kubelet has named its endpoint in the Node)
        kube = Kube(client_for(kubernetes.client.Configuration(host=url)), timeout=10)
        try:
            requests = await asyncio.to_thread(writes_and_reads, kube, owner, 5)
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


async def test_a_409_is_done_only_for_an_object_of_the_same_owner():
    """Model b's Service named like model a's must never be taken for a's: NameTaken, which fails
    the reconcile with a condition that says so. A Secret cannot be read back: its 409 is an error."""
    async with serve() as (emu, url):
        a, b = await model(emu, "a"), await model(emu, "b")
        kube = Kube(client_for(kubernetes.client.Configuration(host=url)), timeout=10)
        try:
            await asyncio.to_thread(kube.create, configmap("a-metrics", a))
            with pytest.raises(NameTaken, match="ConfigMap default/a-metrics exists and is not this model's"):
                await asyncio.to_thread(kube.create, configmap("a-metrics", b))
            assert await asyncio.to_thread(kube.create, configmap("a-metrics", a)) is None
            await asyncio.to_thread(kube.create, configmap("k", a, kind="Secret"))
            with pytest.raises(NameTaken, match="Secret default/k exists"):
                await asyncio.to_thread(kube.create, configmap("k", a, kind="Secret"))
        finally:
            kube.core.api_client.close()
