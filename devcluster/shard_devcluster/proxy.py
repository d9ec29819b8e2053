"""ServiceProxy: the dev cluster's kube-proxy for ClusterIP Services, with a gateway's retries.

Like kube-proxy it reads only Services and EndpointSlices, through the Kubernetes API, so it works
against any API server. Every Service with a selector and a ClusterIP (not the `kubernetes`
Service, whose endpoints are the API server itself) gets a listener on that address's loopback
mapping (network.py) and each of its ports. A request is forwarded to one of the Service's *ready
endpoints* -- the EndpointSlices' endpoints whose `ready` condition is true: pods that run, are
Ready and are not being deleted -- round robin, at the pod's address and the slice's port of the
same name. So a ShardedModel's endpoint Service (which selects its leaders) sends traffic only to
groups whose every rank has loaded, and a group stops getting new requests when its pods stop
being Ready or are deleted.

kube-proxy forwards connections and never replays one: it picks another endpoint only while a
connection to one cannot be made. This proxy forwards HTTP requests over a fresh connection each
(so a request never meets a stale pooled connection) and tries another ready endpoint (at most
`attempts` tries) when:
- the connection cannot be made: nothing was sent, whatever the method;
- for an idempotent method only (GET, HEAD, OPTIONS, PUT, DELETE, TRACE: RFC 9110), when the
  endpoint drops the connection before answering in full, or answers 502, 503 or 504, as a gateway
  with a retry policy would (Envoy's `retry_on: connect-failure,reset,gateway-error`).
A POST (a completion) that reached an endpoint is never replayed onto another: the endpoint may
have acted on it, and a request that fails its group would fail the next one too. Its answer,
whatever it is, goes to the client; a dropped connection becomes a 502. Retrying it is the
client's choice (OpenAI's SDKs do, on 5xx). A streamed answer (server-sent events) is passed on as
it comes. `stats` counts requests, retries and failures, so the tests and the benchmark report
them instead of hiding them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .kubeapi import Informer, KubeApi
from .network import ClusterNetwork

SERVICES, SLICES = "v1/services", "discovery.k8s.io/v1/endpointslices"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
RETRY_STATUSES = (502, 503, 504)
IDEMPOTENT = {"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"}
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass
class ProxyStats:
    requests: int = 0
    retried: int = 0   # requests that took more than one try (and then succeeded or not)
    failed: int = 0    # requests no endpoint answered: the proxy answered 502/503 itself
    upstream_errors: Counter = field(default_factory=Counter)  # what the failed tries met
    served_by: Counter = field(default_factory=Counter)        # pod -> requests answered


class ServiceProxy:
    def __init__(self, api: KubeApi, network: ClusterNetwork, *, attempts: int = 3, wait_for_endpoints: float = 30.0,
                 timeout: float = 600.0):
        self.network = network
        self.attempts, self.wait_for_endpoints, self.timeout = attempts, wait_for_endpoints, timeout
        self.stats = ProxyStats()
        self.listeners: dict[tuple[str, int], tuple[asyncio.AbstractServer, tuple[str, str]]] = {}
        self._turn = itertools.count()
        self.on_listen: Callable[[str, str, str], None] | None = None  # (namespace, name, URL)
        self.on_error: Callable[[str], None] | None = None
        self.errors: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self.services = Informer(api, SERVICES, self._service)
        self.slices = Informer(api, SLICES)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=5))
        self._tasks = [asyncio.create_task(self.slices.run()), asyncio.create_task(self.services.run())]
        await self.services.synced.wait()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for server, _ in self.listeners.values():
            server.close()
        self.listeners.clear()
        if self._session:
            await self._session.close()

    async def _service(self, kind: str, service: dict[str, Any], old: dict[str, Any] | None) -> None:
        spec, meta = service.get("spec") or {}, service["metadata"]
        key = (meta["namespace"], meta["name"])
        ip = spec.get("clusterIP") or "None"
        served = kind != "DELETED" and spec.get("selector") and ip != "None"  # (headless: DNS names only)
        wanted = {(self.network.local(ip), int(p["port"])): dict(p) for p in spec.get("ports") or []} if served else {}
        for address, (server, owner) in list(self.listeners.items()):
            if owner == key and address not in wanted:
                server.close()
                del self.listeners[address]
        for (local, number), port in wanted.items():
            if (local, number) not in self.listeners:
                await self._listen(key, local, port)

    async def _listen(self, key: tuple[str, str], local: str, port: dict[str, Any]) -> None:
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            return await self._forward(request, key, port)
        try:
            server = await asyncio.get_running_loop().create_server(web.Server(handle), local, int(port["port"]))
        except OSError as err:  # another process listens on that port on every address
            self.errors.append(f"service {key[0]}/{key[1]}: cannot listen on {local}:{port['port']}: {err}")
            if self.on_error is not None:
                self.on_error(self.errors[-1])
            return
        self.listeners[(local, int(port["port"]))] = (server, key)
        if self.on_listen is not None:
            self.on_listen(*key, f"http://{local}:{port['port']}")

    # ---------------------------------------------------------------- routing
    async def endpoints(self, namespace: str, name: str, port: dict[str, Any]) -> list[tuple[str, str]]:
        """(pod, base URL) of every ready endpoint of a Service port."""
        found = []
        for (ns, _), endpoint_slice in list(self.slices.objects.items()):
            if ns != namespace or (endpoint_slice["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) != name:
                continue
            number = next((p.get("port") for p in endpoint_slice.get("ports") or []
                           if (p.get("name") or "") == (port.get("name") or "")), None)
            for endpoint in endpoint_slice.get("endpoints") or []:
                ready = (endpoint.get("conditions") or {}).get("ready")
                if number is None or not ready or not endpoint.get("addresses"):
                    continue
                pod = (endpoint.get("targetRef") or {}).get("name") or endpoint["addresses"][0]
                found.append((pod, f"http://{self.network.local(endpoint['addresses'][0])}:{number}"))
        return sorted(found)

    async def _pick(self, key: tuple[str, str], port: dict[str, Any], tried: set[str],
                    deadline: float) -> tuple[str, str] | None:
        """A ready endpoint, one not tried yet when there is one; waits for one until `deadline`."""
        loop = asyncio.get_running_loop()
        while True:
            ready = await self.endpoints(*key, port)
            fresh = [e for e in ready if e[0] not in tried]
            if fresh or (ready and loop.time() > deadline):
                choices = fresh or ready
                return choices[next(self._turn) % len(choices)]
            if loop.time() > deadline:
                return None
            await asyncio.sleep(0.1)

    async def _forward(self, request: web.BaseRequest, key: tuple[str, str],
                       port: dict[str, Any]) -> web.StreamResponse:
        assert self._session is not None
        self.stats.requests += 1
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_endpoints
        tried: set[str] = set()
        last, status = "no ready endpoints", 503
        replay = request.method in IDEMPOTENT
        for attempt in range(self.attempts):
            if attempt == 1:
                self.stats.retried += 1
            picked = await self._pick(key, port, tried, deadline if attempt == 0 else loop.time() + 2.0)
            if picked is None:
                break
            pod, base = picked
            tried.add(pod)
            try:
                async with self._session.request(request.method, base + request.path_qs, data=body,
                                                 headers=headers) as upstream:
                    if replay and upstream.status in RETRY_STATUSES and attempt + 1 < self.attempts:
                        last = f"{pod} answered {upstream.status}"
                        self.stats.upstream_errors[f"HTTP {upstream.status}"] += 1
                        await upstream.read()
                        continue
                    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
                    out_headers["x-upstream-pod"] = pod
                    if upstream.content_type == "text/event-stream":
                        return await self._stream(request, upstream, out_headers, pod)
                    data = await upstream.read()
                    self.stats.served_by[pod] += 1
                    return web.Response(status=upstream.status, body=data, headers=out_headers)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as err:  # nothing was sent
                last = f"{pod}: {type(err).__name__}: {err}"
                self.stats.upstream_errors[type(err).__name__] += 1
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:  # sent, then dropped
                last = f"{pod}: {type(err).__name__}: {err}"
                self.stats.upstream_errors[type(err).__name__] += 1
                if not replay:
                    last, status = f"{last} (a {request.method} is not replayed)", 502
                    break
        self.stats.failed += 1
        return web.json_response({"error": {"message": f"service {key[0]}/{key[1]}: {last}",
                                            "type": "service_unavailable", "code": status}}, status=status)

    async def _stream(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse, headers: dict[str, str],
                      pod: str) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            self.stats.upstream_errors[type(err).__name__] += 1
            self.stats.failed += 1  # too late to retry: the client has part of the answer
            return response
        await response.write_eof()
        self.stats.served_by[pod] += 1
        return response
