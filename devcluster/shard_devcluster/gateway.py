"""The way into the cluster network for processes outside the pods: an HTTP proxy on 127.0.0.1.

On a cluster, the operator reaches each leader at its pod IP and people on a node reach a Service
at its ClusterIP or DNS name. Here those addresses are mapped onto loopback (network.py), so a
process that is not a pod gets there through this proxy: `http_proxy=http://127.0.0.1:PORT` (the
dev cluster sets it for the operator; `curl -x`, or the variable, for people). A request for
`http://<pod IP, ClusterIP or cluster DNS name>:<port>/...` goes to the mapped address; anything
else (the API server, say) is passed through unchanged, as is `CONNECT host:port` (HTTPS).

One request per connection: the request line is rewritten to its path and `Connection: close`,
then the bytes flow both ways until either side closes, so streamed answers stream.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from .network import ClusterNetwork

HEAD_LIMIT = 64 * 1024


class Gateway:
    def __init__(self, network: ClusterNetwork):
        self.network = network
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    def _address(self, host: str) -> str:
        """Where a host of the cluster network is on this machine (other hosts: themselves)."""
        address = self.network.resolve(host)
        if address is None:
            return host  # not a cluster name: as the system resolves it
        try:
            return self.network.local(address)
        except ValueError:
            return address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *headers = head.decode("latin-1").split("\r\n")
            method, target, version = request_line.split(" ", 2)
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                upstream_reader, upstream_writer = await asyncio.open_connection(self._address(host), int(port))
                writer.write(f"{version} 200 Connection established\r\n\r\n".encode())
                first = b""
            else:
                url = urlsplit(target)
                upstream_reader, upstream_writer = await asyncio.open_connection(
                    self._address(url.hostname or ""), url.port or 80)
                kept = [h for h in headers if h and h.split(":", 1)[0].strip().lower()
                        not in ("connection", "proxy-connection", "keep-alive", "proxy-authorization")]
                line = f"{method} {url.path or '/'}{'?' + url.query if url.query else ''} {version}"
                first = ("\r\n".join([line, *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError) as err:
            writer.write(f"HTTP/1.1 502 Bad Gateway\r\nContent-Length: {len(str(err))}\r\nConnection: close\r\n\r\n"
                         f"{err}".encode())
            await _close(writer)
            return
        upstream_writer.write(first)
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        await _close(writer)


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
