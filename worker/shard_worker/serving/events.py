"""What passes between a request's HTTP handler and the engine loop (torch-free: the leader's HTTP
process imports it without the engine).

Each queued request is a `Pending`: its `GenerateRequest`, its `Sink` and its name for the log. The
engine side reports through the sink (`step`, then one `done` or `fail`); the sink turns that into
the request's events, `Step`, then one `Done` or `Failed`, and hands them on without waiting: to the
request's asyncio queue through its loop's `Mailbox` (the HTTP side in this process), or, in a
subclass, to the pipe to the HTTP process (`rank/bridge.py`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Protocol

from shard_contract.wire import Completion, GenerateRequest


class Unavailable(Exception):
    """The group cannot take the request: it is lost, shutting down, or too busy."""

    def __init__(self, reason: str, status: int = 503):
        super().__init__(reason)
        self.reason, self.status = reason, status



@dataclass(frozen=True)
class Step:
    """A streaming request's tokens so far (all of them), and their log-probabilities when asked."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class Done:
    """The request is answered."""

    completion: Completion


@dataclass(frozen=True)
class Failed:
    """The request ends without an answer: refused (400), failed alone (500), or the group cannot
    run it (503)."""

    status: int
    reason: str


Event = Step | Done | Failed


class Mailbox:
    """Events for one asyncio loop, handed over with one wake-up however many sinks post before
    the loop runs: the engine thread posts a Step to every streaming request each step, and one
    `call_soon_threadsafe` (a write to the loop's self-pipe) a step costs it less than one a
    request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue, Event]] = []

    def post(self, queue: asyncio.Queue, event: Event) -> None:
        with self.lock:
            self.items.append((queue, event))
            if len(self.items) > 1:  # a delivery is already on its way
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the server has gone
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, event in items:
            queue.put_nowait(event)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The one mailbox of `loop`."""
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = Mailbox(loop)
        return box


class Sink:
    """Where one request's events go. Called from the engine thread (or the health monitor),
    delivered on the request's asyncio loop; after the first final event (Done, Failed), silent.
    `stream`: its Step events are delivered too (a streamed answer, or one with stop strings,
    which the text side watches for)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, stream: bool):
        """`loop`: the asyncio loop whose `queue` receives the events (None in a subclass that
        delivers them elsewhere, by its own `_post`)."""
        self.stream = stream
        self.mailbox = mailbox(loop) if loop is not None else None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.generated = 0  # tokens its sequence has taken so far
        self._closed = False
        self._lock = threading.Lock()

    def _post(self, event: Event) -> None:
        assert self.mailbox is not None
        self.mailbox.post(self.queue, event)

    def step(self, tokens: list[int], logprobs: list[float] | None = None,
             top_logprobs: list[list[tuple[int, float]]] | None = None) -> int:
        """Its sequence's tokens so far (all of them, with their log-probabilities when asked);
        returns how many are new."""
        with self._lock:
            new, self.generated = len(tokens) - self.generated, len(tokens)
            self.last_token_at = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
            if self.stream and not self._closed:
                asked = logprobs is not None and top_logprobs is not None
                self._post(Step(list(tokens), list(logprobs) if asked else None,  # type: ignore[arg-type]
                                list(top_logprobs) if asked else None))  # type: ignore[arg-type]
        return new

    @property
    def closed(self) -> bool:
        return self._closed

    def _close(self) -> bool:
        """Mark the request ended; False when it had ended already (only the first end counts)."""
        with self._lock:
            closed, self._closed = self._closed, True
        return not closed

    def done(self, completion: Completion) -> bool:
        if not self._close():
            return False
        self._post(Done(completion))
        return True

    def abandon(self) -> bool:
        """The client has gone: deliver nothing more. False when it was answered already."""
        return self._close()

    def fail(self, reason: str, status: int = 503) -> bool:
        if not self._close():
            return False
        self._post(Failed(status, reason))
        return True


@dataclass(eq=False)  # each is one client's request: compared by identity
class Pending:
    request: GenerateRequest
    sink: Sink
    id: str  # as its answer names it (cmpl-..., chatcmpl-...), for the log


class Link(Protocol):
    """The engine loop as a request's HTTP handler sees it: in this process (`batcher.LocalLink`),
    or in the engine process across a pipe (`remote.EngineClient`)."""

    async def submit(self, pendings: list[Pending]) -> None:
        """Queue them all, or none: Unavailable (503, or 429 when too many wait). One the group
        can never run gets Failed(400) on its sink."""

    def cancel(self, pending: Pending) -> None:
        """Its client has gone: it leaves the queue, or stops at the engine's next step boundary."""

    def stop(self, pending: Pending) -> None:
        """Its text met a stop string: it stops at the next step boundary and is answered then."""


class Outcomes(Protocol):
    """Where the HTTP side counts a request it refused itself (`RankMetrics`, or forwarded to it)."""

    def outcome(self, outcome: str) -> None: ...
