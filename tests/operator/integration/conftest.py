"""The emulated cluster the integration tier runs the real operator against: the dev cluster's API
server emulator, its kubelet, fake leaders serving /v1/shards over HTTP, and a check after every
test that the operator used no permission outside permissions.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from aiohttp import web

from shard_devcluster.apiserver import SM, serve
from shard_operator.kube import Kube
from shard_operator.objects.permissions import permissions
from tests.operator.conftest import leader_report
from tests.support.fakekubelet import FakeKubelet
from tests.support.operator import ManualClock, eventually, fast_settings, running_operator


@contextlib.asynccontextmanager
async def fake_leaders():
    """A real HTTP server playing every group leader's GET /v1/shards; yields its base URL. The
    operator asks for URL/NAMESPACE/POD/v1/shards (`leader_url`); through the pod proxy, with the
    pods' IPs mapped to it, it is every pod's own /v1/shards at the URL's port."""
    report = leader_report()

    async def shards(request: web.Request) -> web.Response:
        return web.Response(text=report.model_dump_json(), content_type="application/json")
    app = web.Application()
    app.router.add_get("/{namespace}/{pod}/v1/shards", shards)
    app.router.add_get("/v1/shards", shards)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def permission_of(request) -> tuple[tuple[str, str], str] | None:
    """((apiGroup, resource[/subresource]), verb) of an API request; None for discovery."""
    res = request.resource
    if res is None or not res.plural:
        return None
    method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
    named = request.name is not None
    verb = {"GET": "get" if named else ("watch" if request.params.get("watch") in ("true", "1") else "list"),
            "POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if named else "deletecollection"}[method]
    resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
    return (res.group or "", resource), verb


def undeclared(requests) -> set:
    """Requests whose permission the operator's RBAC table does not grant (at its widest)."""
    granted, out = permissions(network_policies=True), set()
    for request in requests:
        perm = permission_of(request)
        if perm is not None and perm[1] not in granted.get(perm[0], ()):
            out.add(perm)
    return out


class World:
    """An emulated cluster: API server, kubelet, fake leaders, and helpers to arrange and read it."""

    def __init__(self, emu, url: str, kubelet: FakeKubelet, leaders: str, tmp: Path):
        self.emu, self.url, self.kubelet, self.leaders, self.tmp = emu, url, kubelet, leaders, tmp
        self.clock = ManualClock()

    def settings(self, **overrides):
        return fast_settings(leader_url=self.leaders + "/{namespace}/{pod}", **overrides)

    def operator(self, kube_type=Kube, **overrides):
        return running_operator(self.url, self.settings(**overrides), clock=self.clock, kube_type=kube_type)

    async def add_node(self, node: dict) -> None:
        await self.emu.k8s_create("v1/nodes", None, node)

    async def create(self, body: dict) -> dict:
        return await self.emu.k8s_create(SM, body["metadata"].get("namespace", "default"), body)

    async def model(self, name: str, namespace: str = "default") -> dict | None:
        return await self.emu.k8s_get(SM, namespace, name)

    async def status(self, name: str, namespace: str = "default") -> dict:
        return ((await self.model(name, namespace)) or {}).get("status") or {}

    async def pods(self, name: str, namespace: str = "default", **labels: str) -> list[dict]:
        selector = ",".join([f"sharding.dev/model={name}", "sharding.dev/component=rank"] +
                            [f"sharding.dev/{k}={v}" for k, v in labels.items()])
        return sorted(await self.emu.k8s_list("v1/pods", namespace, selector),
                      key=lambda p: (p["metadata"]["labels"]["sharding.dev/group"],
                                     int(p["metadata"]["labels"]["sharding.dev/rank"]), p["metadata"]["name"]))

    async def objects(self, kind: str, name: str, namespace: str = "default") -> list[dict]:
        return await self.emu.k8s_list(kind, namespace, f"sharding.dev/model={name}")

    async def events(self, name: str, namespace: str = "default") -> list[tuple[str, str, str]]:
        items = await self.emu.k8s_list("v1/events", namespace)
        return [(e.get("type"), e.get("reason"), e.get("message")) for e in items
                if (e.get("involvedObject") or {}).get("name") == name]

    async def wait_phase(self, name: str, phase: str, timeout: float = 30.0) -> dict:
        async def check():  # a status that describes the current spec
            model = await self.model(name) or {}
            status = model.get("status") or {}
            current = status.get("observedGeneration") == model.get("metadata", {}).get("generation")
            return status if status.get("phase") == phase and current else None
        try:
            return await eventually(check, timeout=timeout)
        except AssertionError:
            raise AssertionError(f"{name} not {phase}: {await self.status(name)}") from None


@pytest.fixture
async def world(tmp_path):
    async with serve() as (emu, url), fake_leaders() as leaders:
        kubelet = FakeKubelet(emu, run_processes=lambda pod: (pod["metadata"].get("labels") or {}).get(
            "sharding.dev/component") == "profiler", mounts={"/models": str(tmp_path / "pvc")})
        async with kubelet:
            yield World(emu, url, kubelet, leaders, tmp_path)
        assert not undeclared(emu.api_requests()), "the operator used permissions outside permissions.py"
