"""Bounds on what a client may make a rank hold: the size of a request body and the time it may
take to send a request's head and then its body (SHARD_MAX_BODY_BYTES, SHARD_READ_TIMEOUT).

`BoundedBodies` is plain ASGI middleware: it reads a request's whole body before the app sees it,
refusing with 413 a body over the limit (by its Content-Length before reading any of it, or as
soon as a chunked one passes the limit) and with 408 one that does not arrive in time, so a route
never buffers more than the limit nor waits on a slow client.

uvicorn does not bound the time to a request's head: its keep-alive timer starts only after a
first response, and any byte resets it, so a client that opens connections and sends their heads
a byte at a time would hold them forever. `server_limits` gives the HTTP protocol uvicorn would
choose a timer, armed when a connection opens and after each response; if no new request head has
arrived when it fires, the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class TooLarge(Exception):
    pass


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None when it has none (chunked) or it is not a number."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BoundedBodies:
    """Read every HTTP request's body first, within `max_bytes` and `timeout` seconds."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    def _too_large(self) -> str:
        return f"the request body exceeds this server's limit of {self.max_bytes} bytes (SHARD_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _error(send, 413, self._too_large())
            return
        try:
            async with asyncio.timeout(self.timeout):
                chunks = await self._read(receive)
        except TooLarge:
            await _error(send, 413, self._too_large())
            return
        except TimeoutError:
            await _error(send, 408, f"the request body did not arrive within {self.timeout:g} s "
                                    "(SHARD_READ_TIMEOUT)")
            return
        if chunks is None:  # the client went away before its body was whole
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only a disconnect comes

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> list[bytes] | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks


def _protocol() -> type[asyncio.Protocol]:
    """uvicorn's "auto" choice: httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def bounded_protocol(base: type[Any], head_seconds: float) -> type[asyncio.Protocol]:
    """`base` (one of uvicorn's HTTP protocols) with a bound on the time to a request's head."""

    class HeadBounded(base):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(head_seconds, self._head_due, self.cycle)

        def _head_due(self, cycle: object) -> None:
            # The same cycle as when the timer was armed: no request head has come since.
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return HeadBounded


def server_limits(read_timeout: float) -> dict[str, Any]:
    """uvicorn.Config's settings that bound slow clients."""
    return {"http": bounded_protocol(_protocol(), read_timeout), "timeout_keep_alive": 5}
