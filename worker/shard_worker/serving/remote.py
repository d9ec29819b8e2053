"""The engine process as the leader's HTTP process sees it, across the pipe (`ipc.py`).

`EngineClient` is the app's `Probes` (the verdict and state the engine process last reported;
its shards and metrics asked for when a client asks), the routes' `Link` (requests queued, cancelled
and stopped there; their events put on their sinks' queues here) and their `Outcomes` (a request
the HTTP side refused is counted by the engine process's metrics). It runs on the HTTP process's
event loop and never blocks it: what it sends is written to the pipe's buffer, what it reads comes
from a task of its own.

The engine process is trusted to be alive only while it says so: when its pipe ends (it exited or
was killed) every open request fails with 503 and the probes say why, and when it has not
reported for `STALE_SECONDS` (stopped, or hung with its GIL held) the probes say that.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Callable
from typing import Any

from shard_contract.wire import ShardsResponse

from ..log import log
from ..telemetry.health import Verdict
from . import ipc
from .events import Failed, Pending, Step, Unavailable

QUERY_SECONDS = 10.0  # a query of shards or metrics the engine process has not answered fails then


class EngineClient:
    def __init__(self, rank: int, stale_seconds: float = ipc.STALE_SECONDS):
        self.rank, self.stale_seconds = rank, stale_seconds
        self.status: dict[str, Any] | None = None
        self.status_at = time.monotonic()
        self.gone = ""  # why the engine process is gone; set once
        self.on_gone: Callable[[], None] = lambda: None
        self.ids = itertools.count(1)
        self.pending: dict[int, Pending] = {}  # request id -> its pending, until its final event
        self.rid: dict[Pending, int] = {}
        self.acks: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.streams = ipc.Streams()
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def connect(self, sock: socket.socket) -> None:
        reader, self.writer = await asyncio.open_connection(sock=sock, limit=2**20)
        self.task = asyncio.ensure_future(self._read(reader))

    # ------------------------------------------------------------ reading
    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "the engine process closed its pipe (it exited)"
        try:
            while (message := await ipc.read_frame_async(reader)) is not None:
                self._handle(message)
        except (ipc.FrameError, ValueError, KeyError, TypeError, IndexError, ConnectionError) as err:
            reason = f"the pipe to the engine process broke: {err}"
        self._lost(reason)

    def _handle(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "events":
            for item in message["items"]:
                rid, event = self.streams.event(item)
                pending = self.pending.get(rid)
                if pending is None:  # cancelled here meanwhile
                    self.streams.forget(rid)
                    continue
                if not isinstance(event, Step):
                    self._drop(pending)
                pending.sink.queue.put_nowait(event)
        elif op == "status":
            self.status, self.status_at = message, time.monotonic()
        elif op in ("ack", "answer"):
            future = self.acks.pop(int(message["ack"]), None)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            raise ipc.FrameError(f"unknown message {op!r}")

    def _lost(self, reason: str) -> None:
        if self.gone:
            return
        self.gone = reason
        log(self.rank, f"the HTTP process lost its engine: {reason}")
        for pending in list(self.pending.values()):
            pending.sink.queue.put_nowait(Failed(503, f"the group failed: {reason}"))
        self.pending.clear()
        self.rid.clear()
        for future in self.acks.values():
            if not future.done():
                future.set_exception(Unavailable(reason))
        self.acks.clear()
        if self.writer is not None:
            self.writer.close()
        self.on_gone()

    # ------------------------------------------------------------ sending
    def _send(self, message: dict[str, Any]) -> None:
        if self.gone or self.writer is None:
            raise Unavailable(self.gone or "the engine process is not connected")
        self.writer.write(ipc.encode(message))

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        ack = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.acks[ack] = future
        try:
            self._send(message | {"ack": ack})
            return await asyncio.wait_for(future, QUERY_SECONDS)
        except TimeoutError:
            raise Unavailable(f"the engine process did not answer within {QUERY_SECONDS:.0f} s") from None
        finally:
            self.acks.pop(ack, None)

    def _drop(self, pending: Pending) -> int | None:
        rid = self.rid.pop(pending, None)
        if rid is not None:
            self.pending.pop(rid, None)
            self.streams.forget(rid)
        return rid

    # ------------------------------------------------------------ app.Probes
    @property
    def state(self) -> str:
        if self.gone:
            return "failed"
        return str(self.status["state"]) if self.status is not None else "loading"

    def verdict(self) -> Verdict:
        if self.gone:
            return Verdict(False, False, f"rank {self.rank}'s engine process is gone: {self.gone}", {})
        silent = time.monotonic() - self.status_at
        if silent > self.stale_seconds:
            return Verdict(False, False, f"rank {self.rank}'s engine process has not reported for "
                                         f"{silent:.0f} s", {})
        if self.status is None:
            return Verdict(True, False, "the leader's engine process is starting", {})
        s = self.status
        return Verdict(bool(s["alive"]), bool(s["ready"]), str(s["reason"]),
                       {int(rank): bool(alive) for rank, alive in s["ranks_alive"]})

    async def shards(self) -> ShardsResponse:
        answer = await self._ask({"op": "query", "what": "shards"})
        return ShardsResponse.model_validate(answer["body"])

    async def exposition(self, ready: bool) -> bytes:
        answer = await self._ask({"op": "query", "what": "metrics"})
        return str(answer["body"]).encode()

    # ------------------------------------------------------------ events.Link
    def ready_link(self) -> EngineClient:
        verdict = self.verdict()
        if not verdict.ready:
            raise Unavailable(verdict.reason or "the group is not ready")
        return self

    async def submit(self, pendings: list[Pending]) -> None:
        items = []
        for pending in pendings:
            rid = next(self.ids)
            self.pending[rid], self.rid[pending] = pending, rid
            items.append({"id": rid, "name": pending.id, "stream": pending.sink.stream,
                          "request": pending.request.model_dump(mode="json")})
        try:
            answer = await self._ask({"op": "submit", "items": items})
        except Unavailable:  # gone, or no answer in time: what it may still queue runs for nobody
            for pending in pendings:
                self.cancel(pending)
            raise
        if answer["status"]:
            for pending in pendings:
                self._drop(pending)
            raise Unavailable(str(answer["reason"]), int(answer["status"]))

    def cancel(self, pending: Pending) -> None:
        rid = self._drop(pending)
        if rid is not None and not self.gone:
            self._send({"op": "cancel", "id": rid})

    def stop(self, pending: Pending) -> None:
        rid = self.rid.get(pending)
        if rid is not None and not self.gone:
            self._send({"op": "stop", "id": rid})

    # ------------------------------------------------------------ events.Outcomes
    def outcome(self, outcome: str) -> None:
        if not self.gone:
            self._send({"op": "outcome", "outcome": outcome})
