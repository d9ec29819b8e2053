"""The Kubernetes HTTP API as the dev cluster's node components use it: the process kubelet, the
Service proxy and cluster DNS talk to any API server through this, and to nothing else.

`KubeApi` speaks JSON over aiohttp to the server a kubeconfig names (its CA, client certificate or
token: the `kubernetes` client's loader reads the file); `Informer` keeps a resource's objects as
client-go's informers do: list, then watch from the list's resourceVersion, watch again where the
stream ended, list again when the server answers 410 Gone or the connection fails.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

log = logging.getLogger("shard_devcluster")

MERGE = "application/merge-patch+json"
SMP = "application/strategic-merge-patch+json"


def path(resource: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    """The URL path of "v1/pods" or "coordination.k8s.io/v1/leases" (with a namespace, name, subresource)."""
    *group, version, plural = resource.split("/")
    root = f"/apis/{group[0]}/{version}" if group else f"/api/{version}"
    parts = [root] + ([f"namespaces/{namespace}"] if namespace else []) + [plural] + [p for p in (name, sub) if p]
    return "/".join(parts)


def microtime() -> str:
    """A MicroTime, as Leases and Events carry them."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiStatusError(Exception):
    def __init__(self, status: int, body: Any, what: str):
        message = body.get("message") if isinstance(body, dict) else str(body)[:300]
        super().__init__(f"{what}: {status} {message}")
        self.status, self.body = status, body


class KubeApi:
    def __init__(self, server: str, *, ssl_context: ssl.SSLContext | bool = True, token: str | None = None):
        self.server = server.rstrip("/")
        self.ssl = ssl_context
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str | Path, context: str | None = None) -> KubeApi:
        import kubernetes

        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(kubeconfig), context=context, client_configuration=config)
        context_ssl: ssl.SSLContext | bool = True
        if config.host.startswith("https"):
            context_ssl = ssl.create_default_context(cafile=config.ssl_ca_cert)
            if not config.verify_ssl:
                context_ssl.check_hostname, context_ssl.verify_mode = False, ssl.CERT_NONE
            if config.cert_file:
                context_ssl.load_cert_chain(config.cert_file, config.key_file)
        token = (config.api_key or {}).get("authorization", "").removeprefix("Bearer ").strip() or None
        return cls(config.host, ssl_context=context_ssl, token=token)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, url: str, *, body: Any = None, params: dict | None = None,
                      content_type: str = "application/json", ok: tuple[int, ...] = ()) -> Any:
        """The JSON answer; None for a status in `ok` that is not 2xx (a 404 or 409 some callers expect)."""
        data = json.dumps(body).encode() if body is not None else None
        async with self.session.request(method, self.server + url, data=data, params=params, ssl=self.ssl,
                                        headers={"Content-Type": content_type, "Accept": "application/json"},
                                        timeout=aiohttp.ClientTimeout(total=30)) as response:
            text = await response.text()
            answer = json.loads(text) if text and response.content_type == "application/json" else text
            if response.status in ok:
                return None
            if response.status >= 300:
                raise ApiStatusError(response.status, answer, f"{method} {url}")
            return answer

    async def get(self, url: str) -> dict | None:
        return await self.request("GET", url, ok=(404,))

    async def create(self, url: str, body: dict) -> dict | None:
        """The created object; None when it exists already."""
        return await self.request("POST", url, body=body, ok=(409,))

    async def patch(self, url: str, body: dict, content_type: str = MERGE) -> dict | None:
        """The patched object; None when it is gone."""
        return await self.request("PATCH", url, body=body, content_type=content_type, ok=(404,))

    async def delete(self, url: str, body: dict | None = None) -> dict | None:
        return await self.request("DELETE", url, body=body, ok=(404, 409))

    async def watch(self, url: str, params: dict[str, str]) -> AsyncIterator[dict]:
        query = urlencode({**params, "watch": "true", "allowWatchBookmarks": "true"})
        async with self.session.get(f"{self.server}{url}?{query}", ssl=self.ssl,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as response:
            if response.status >= 300:
                raise ApiStatusError(response.status, await response.text(), f"watch {url}")
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)


Handler = Callable[[str, dict, "dict | None"], Awaitable[None]]


class Informer:
    """A resource's objects, kept current from list + watch; `handler(type, object, old)` is awaited
    for every change, in order (type ADDED, MODIFIED or DELETED)."""

    def __init__(self, api: KubeApi, resource: str, handler: Handler | None = None, *, namespace: str | None = None,
                 label_selector: str = ""):
        self.api, self.url, self.handler = api, path(resource, namespace), handler
        self.params = {"labelSelector": label_selector} if label_selector else {}
        self.objects: dict[tuple[str | None, str], dict] = {}
        self.synced = asyncio.Event()  # the first list is in

    async def run(self) -> None:
        version = ""
        while True:
            try:
                if not version:
                    version = await self._list()
                async for event in self.api.watch(self.url, {**self.params, "resourceVersion": version}):
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        version = "" if obj.get("code") == 410 else version
                        break
                    version = obj["metadata"].get("resourceVersion") or version
                    if kind != "BOOKMARK":
                        await self._apply(kind, obj)
            except (TimeoutError, aiohttp.ClientError, ApiStatusError, ValueError) as err:
                log.debug("watch %s: %s; listing again", self.url, err)
                version = ""
                await asyncio.sleep(0.5)

    async def _list(self) -> str:
        listing = await self.api.request("GET", self.url, params=self.params)
        seen = set()
        for obj in listing["items"]:
            key = (obj["metadata"].get("namespace"), obj["metadata"]["name"])
            seen.add(key)
            old = self.objects.get(key)
            if old is None or old["metadata"].get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                await self._apply("MODIFIED" if old else "ADDED", obj)
        for key in set(self.objects) - seen:  # deleted while we were not watching
            await self._apply("DELETED", self.objects[key])
        self.synced.set()
        return listing["metadata"]["resourceVersion"]

    async def _apply(self, kind: str, obj: dict) -> None:
        key = (obj["metadata"].get("namespace"), obj["metadata"]["name"])
        old = self.objects.get(key)
        if kind == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        if self.handler is not None:
            try:
                await self.handler(kind, obj, old)
            except Exception:  # one object's trouble must not end the watch of all
                log.exception("%s: handling %s %s failed", self.url, kind, obj["metadata"].get("name"))
