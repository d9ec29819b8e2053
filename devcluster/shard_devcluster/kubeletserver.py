"""The kubelet's own HTTPS endpoint, as far as an API server uses it: container logs.

kube-apiserver serves `pods/log` (`kubectl logs`) by asking the kubelet of the pod's node, at the
address and port the Node's status names (`daemonEndpoints.kubeletEndpoint.Port`), for
`GET /containerLogs/<namespace>/<pod>/<container>` (`tailLines`, `limitBytes`, `follow`). It speaks
HTTPS, and checks the kubelet's certificate only when started with --kubelet-certificate-authority:
this endpoint has a self-signed one (made with `openssl` once per state directory) and asks no
client certificate.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


@dataclass
class LogBuffer:
    """A container's output as the runtime keeps it: what it printed, and whether it has ended."""

    data: bytearray = field(default_factory=bytearray)
    ended: bool = False


def certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert, key), made once."""
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    if not (cert.is_file() and key.is_file()):
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "3650", "-subj", "/CN=shard-devcluster-kubelet",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        key.chmod(0o600)
    return cert, key


class KubeletServer:
    """Serves the logs `find(namespace, pod, container)` returns (None: no such container)."""

    def __init__(self, find: Callable[[str, str, str], LogBuffer | None], directory: Path):
        self.find, self.directory = find, directory
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        cert, key = await asyncio.to_thread(certificate, self.directory)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        app = web.Application()
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        buffer = self.find(info["namespace"], info["pod"], info["container"])
        if buffer is None:
            raise web.HTTPNotFound(text=f"container {info['container']} of pod {info['namespace']}/{info['pod']} "
                                        "is not known to this kubelet")
        query = request.query
        data = bytes(buffer.data)
        if query.get("tailLines"):
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) else b""
        if query.get("limitBytes"):
            data = data[:int(query["limitBytes"])]
        if query.get("follow") != "true":
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        sent = len(buffer.data)
        while not buffer.ended or sent < len(buffer.data):
            if sent < len(buffer.data):
                chunk = bytes(buffer.data[sent:])
                sent += len(chunk)
                await response.write(chunk)
            else:
                await asyncio.sleep(0.1)
        await response.write_eof()
        return response
