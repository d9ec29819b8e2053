"""ServiceProxy: the dev cluster's kube-proxy for ClusterIP Services, with a gateway's retries.

Every Service with a ClusterIP gets a listener on that address and each of its ports. A request is
forwarded to one of the Service's *ready endpoints* -- pods that match its selector, run, are Ready
and are not being deleted -- round robin, at the pod's address and target port. So a ShardedModel's
endpoint Service (which selects its leaders) sends traffic only to groups whose every rank has
loaded, and a group stops getting new requests when its pods stop being Ready or are deleted.

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
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import kmock
from aiohttp import web

from .network import ClusterNetwork, container_port

SERVICES, PODS = "v1/services", "v1/pods"
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


def ready_endpoint(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return ready and status.get("phase") == "Running" and bool(status.get("podIP")) \
        and not pod["metadata"].get("deletionTimestamp")


def _selector(service: dict[str, Any]) -> str | None:
    selector = (service.get("spec") or {}).get("selector")
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items())) if selector else None


class ServiceProxy:
    def __init__(self, emu, network: ClusterNetwork, *, attempts: int = 3, wait_for_endpoints: float = 30.0,
                 timeout: float = 600.0):
        self.emu, self.network = emu, network
        self.attempts, self.wait_for_endpoints, self.timeout = attempts, wait_for_endpoints, timeout
        self.stats = ProxyStats()
        self.listeners: dict[tuple[str, int], tuple[asyncio.AbstractServer, tuple[str, str]]] = {}
        self._turn = itertools.count()
        self.on_listen: Callable[[str, str, str], None] | None = None  # (namespace, name, URL)
        self.on_error: Callable[[str], None] | None = None
        self.errors: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=5))
        bus = self.emu._buses[kmock.resource(SERVICES)]
        async with self.emu._lock:  # snapshot + subscribe atomically
            mark = await bus.mark()
        for service in await self.emu.k8s_list(SERVICES):
            await self._listen(service)
        self._task = asyncio.create_task(self._watch(bus, mark))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for server, _ in self.listeners.values():
            server.close()
        self.listeners.clear()
        if self._session:
            await self._session.close()

    async def _watch(self, bus, mark) -> None:
        async for ev in bus.stream(since=mark):
            service = ev["object"]
            if ev["type"] == "DELETED":
                key = (service["metadata"].get("namespace"), service["metadata"]["name"])
                for address, (server, owner) in list(self.listeners.items()):
                    if owner == key:
                        server.close()
                        del self.listeners[address]
            else:
                await self._listen(service)

    async def _listen(self, service: dict[str, Any]) -> None:
        spec, meta = service.get("spec") or {}, service["metadata"]
        ip = spec.get("clusterIP")
        if not ip or ip == "None":
            return  # headless: DNS names only
        key = (meta.get("namespace"), meta["name"])
        for port in spec.get("ports") or []:
            if (ip, int(port["port"])) in self.listeners:
                continue

            async def handle(request: web.BaseRequest, key=key, port=dict(port)) -> web.StreamResponse:
                return await self._forward(request, key, port)
            try:
                server = await asyncio.get_running_loop().create_server(web.Server(handle), ip, int(port["port"]))
            except OSError as err:  # another process listens on that port on every address
                self.errors.append(f"service {key[0]}/{key[1]}: cannot listen on {ip}:{port['port']}: {err}")
                if self.on_error is not None:
                    self.on_error(self.errors[-1])
                continue
            self.listeners[(ip, int(port["port"]))] = (server, key)
            if self.on_listen is not None:
                self.on_listen(*key, f"http://{ip}:{port['port']}")

    # ---------------------------------------------------------------- routing
    async def endpoints(self, namespace: str, name: str, port: dict[str, Any]) -> list[tuple[str, str]]:
        """(pod, base URL) of every ready endpoint of a Service port."""
        service = await self.emu.k8s_get(SERVICES, namespace, name)
        selector = _selector(service) if service else None
        if selector is None:
            return []
        target = port.get("targetPort", port["port"])
        found = []
        for pod in await self.emu.k8s_list(PODS, namespace, selector):
            if not ready_endpoint(pod):
                continue
            containers = (pod.get("spec") or {}).get("containers") or []
            number = next((n for c in containers if (n := container_port(c, target)) is not None), None)
            address = self.network.resolve(pod["status"]["podIP"])
            if number is not None and address is not None:
                found.append((pod["metadata"]["name"], f"http://{address.ip}:{number}"))
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

    async def _forward(self, request: web.BaseRequest, key: tuple[str, str], port: dict[str, Any]) -> web.StreamResponse:
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
