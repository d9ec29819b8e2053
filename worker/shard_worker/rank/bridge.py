"""The engine process's end of the pipe to the leader's HTTP process (`serving/ipc.py`).

Two threads, neither of them the engine's: the reader takes the HTTP process's messages (a submit
is checked and queued on the engine loop, a cancel or stop passed on, a query answered from the
rank) and the writer sends what the engine loop's sinks posted, with the acks, the answers and,
every `STATUS_SECONDS`, the rank's state and verdict. The engine thread only appends an event to a
list under a lock (`ForwardSink`): it never encodes, never writes and never waits for the HTTP
process. When that process falls behind, its requests' Steps pile up as one delta each (the writer
coalesces them), so what waits is bounded by the running requests' tokens.

When the pipe ends (the HTTP process exited, or either side broke it), every request it had open
is cancelled, as when a client hangs up, and `gone` is set for the rank's main thread, which then
stops the rank.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Protocol

from shard_contract.wire import GenerateRequest, ShardsResponse

from ..log import first_line, log
from ..serving import ipc
from ..serving.batcher import EngineLoop
from ..serving.events import Done, Event, Failed, Pending, Sink, Unavailable
from ..telemetry.health import Verdict
from ..telemetry.rankmetrics import OUTCOMES, RankMetrics


class Served(Protocol):
    """What the bridge asks of its rank (`lifecycle.Rank`)."""

    rank: int
    state: str
    metrics: RankMetrics
    loop: EngineLoop | None

    def verdict(self) -> Verdict: ...
    def ready_loop(self) -> EngineLoop: ...
    def shards(self) -> ShardsResponse: ...
    def exposition(self, ready: bool) -> bytes: ...


class ForwardSink(Sink):
    """A request's sink in the engine process: its events go to the pipe."""

    def __init__(self, bridge: Bridge, rid: int, stream: bool):
        super().__init__(None, stream)
        self.bridge, self.rid = bridge, rid

    def _post(self, event: Event) -> None:
        self.bridge.post(self.rid, event)


class Bridge:
    def __init__(self, sock: socket.socket, rank: Served):
        self.sock, self.rank = sock, rank
        self.cond = threading.Condition()
        self.events: list[tuple[int, Event]] = []
        self.outbox: list[dict[str, Any]] = []
        self.sent: dict[int, tuple[int, int]] = {}  # the writer's: what each stream has been sent
        self.live: dict[int, Pending] = {}  # the HTTP process's open requests, by its ids
        self.closing = False
        self.gone = threading.Event()
        self.threads = [threading.Thread(target=self._reader, name="http-reader", daemon=True),
                        threading.Thread(target=self._writer, name="http-writer", daemon=True)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        """Send what is left, then stop writing."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.threads[1].join(5)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------ the engine thread (any thread)
    def post(self, rid: int, event: Event) -> None:
        with self.cond:
            self.events.append((rid, event))
            if isinstance(event, (Done, Failed)):
                self.live.pop(rid, None)
            self.cond.notify()

    def _send(self, message: dict[str, Any]) -> None:
        with self.cond:
            self.outbox.append(message)
            self.cond.notify()

    # ------------------------------------------------------------ the reader
    def _reader(self) -> None:
        why = "it closed the pipe"
        try:
            while (message := ipc.read_frame(self.sock)) is not None:
                self._handle(message)
        except Exception as err:  # noqa: BLE001 -- a broken pipe or frame, or a bug: the rank stops either way
            why = f"the pipe broke: {type(err).__name__}: {first_line(err)}"
        if not self.closing:
            log(self.rank.rank, f"the HTTP process is gone ({why}): its open requests are cancelled")
        with self.cond:
            orphans, self.live = list(self.live.values()), {}
        loop = self.rank.loop
        for pending in orphans:
            if loop is not None:
                loop.cancel(pending)
        self.gone.set()

    def _handle(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "submit":
            self._submit(int(message["ack"]), message["items"])
        elif op in ("cancel", "stop"):
            with self.cond:
                pending = self.live.pop(int(message["id"]), None) if op == "cancel" else \
                    self.live.get(int(message["id"]))
            loop = self.rank.loop
            if pending is not None and loop is not None:
                (loop.cancel if op == "cancel" else loop.stop)(pending)
        elif op == "outcome":
            if message["outcome"] in OUTCOMES:
                self.rank.metrics.outcome(message["outcome"])
        elif op == "query":
            self._send({"op": "answer", "ack": message["ack"], "body": self._answer(message["what"])})
        else:
            raise ValueError(f"unknown message {op!r}")

    def _answer(self, what: str) -> Any:
        if what == "shards":
            return self.rank.shards().model_dump(mode="json")
        if what == "metrics":
            return self.rank.exposition(self.rank.verdict().ready).decode()
        raise ValueError(f"unknown query {what!r}")

    def _ack(self, ack: int, status: int = 0, reason: str = "") -> None:
        """Answer a submit: status 0 when queued, else the HTTP status it fails with and why."""
        self._send({"op": "ack", "ack": ack, "status": status, "reason": reason})

    def _submit(self, ack: int, items: list[dict[str, Any]]) -> None:
        try:
            loop = self.rank.ready_loop()
        except Unavailable as err:
            self._ack(ack, err.status, err.reason)
            return
        pendings = []
        try:
            for item in items:
                rid = int(item["id"])
                pending = Pending(GenerateRequest.model_validate(item["request"]),
                                  ForwardSink(self, rid, bool(item["stream"])), str(item["name"]))
                pendings.append((rid, pending))
        except ValueError as err:  # the HTTP side checked it: a request that does not cross intact is a bug
            self._ack(ack, 500, f"this request failed: {first_line(err)}")
            return
        with self.cond:
            self.live.update(pendings)
        try:
            for _, pending in pendings:
                loop.submit(pending)
        except Unavailable as err:
            for rid, pending in pendings:
                with self.cond:
                    self.live.pop(rid, None)
                loop.cancel(pending)
            self._ack(ack, err.status, err.reason)
            return
        self._ack(ack)

    # ------------------------------------------------------------ the writer
    def _status(self) -> dict[str, Any]:
        verdict = self.rank.verdict()
        return {"op": "status", "state": self.rank.state, "alive": verdict.alive, "ready": verdict.ready,
                "reason": verdict.reason, "ranks_alive": sorted(verdict.ranks_alive.items())}

    def _writer(self) -> None:
        reported = 0.0
        try:
            while True:
                with self.cond:
                    left = reported + ipc.STATUS_SECONDS - time.monotonic()
                    if not (self.events or self.outbox or self.closing) and left > 0:
                        self.cond.wait(left)
                    events, self.events = self.events, []
                    outbox, self.outbox = self.outbox, []
                    closing = self.closing
                frames = [ipc.encode({"op": "events", "items": ipc.event_items(events, self.sent)})] if events else []
                frames += [ipc.encode(message) for message in outbox]
                if time.monotonic() - reported >= ipc.STATUS_SECONDS:
                    frames.append(ipc.encode(self._status()))
                    reported = time.monotonic()
                if frames:
                    self.sock.sendall(b"".join(frames))
                if closing:
                    return
        except Exception as err:  # noqa: BLE001 -- gone, or a frame that cannot be sent: end the pipe
            if not self.closing:
                log(self.rank.rank, f"cannot write to the HTTP process: {type(err).__name__}: {first_line(err)}")
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # both processes see the pipe end, and stop
            except OSError:
                pass
