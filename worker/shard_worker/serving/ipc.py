"""The pipe between the leader's engine process and its HTTP process: frames of JSON, no pickle.

A frame is a 4-byte big-endian length and that many bytes of one JSON object (plain values only:
what crosses is token ids, numbers, strings and the contract's pydantic models as JSON). A frame
longer than `MAX_FRAME` is refused before it is read (the pipe is then closed: each side only
ever writes what the other can read, so it is a bug, not an input). Both ends are ours; the
bound keeps a bug from making either side hold unbounded memory.

HTTP -> engine (`op`): `submit` (an `ack` number and its `items`: id, name, stream, request),
`cancel` and `stop` (an `id`), `outcome` (a request refused by the HTTP side, for the metrics),
`query` (an `ack` number and `what`: "shards" or "metrics").
Engine -> HTTP: `status` (the rank's state and verdict, sent at least every `STATUS_SECONDS`),
`ack` (a submit's `status`: 0 queued, else the HTTP status it was refused with, and `reason`),
`answer` (a query's `body`), `events` (`items`, see `event_items`).

A request's Steps cross as deltas: the tokens (and log-probabilities) after those already sent,
with the offset they start at; the receiving `Streams` puts them back together into the Steps the
routes read (all the tokens so far), so a step costs the pipe what it added, not the whole
sequence again.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

from shard_contract.env import ENGINE_FD_ENV
from shard_contract.wire import Completion

from .events import Done, Event, Failed, Step

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 2**20  # a Completion with top log-probabilities of a long answer is the largest
STATUS_SECONDS = 0.5  # the engine process reports its state at least this often
STALE_SECONDS = 15.0  # ... and is taken for hung when it has not for this long (its peers' is 5 s)
FD_ENV = ENGINE_FD_ENV  # the HTTP process's end of the pipe, inherited


class FrameError(Exception):
    """The other side broke the framing: too long, or not a JSON object."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise FrameError(f"a frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    message = json.loads(body)
    if not isinstance(message, dict):
        raise FrameError("a frame is not a JSON object")
    return message


def _length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise FrameError(f"a frame of {n} bytes exceeds {MAX_FRAME}")
    return n


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next message from a blocking socket; None at the end of the stream."""
    header = _read_exactly(sock, HEADER.size)
    if header is None:
        return None
    body = _read_exactly(sock, _length(header))
    if body is None:
        return None
    return decode(body)


async def read_frame_async(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message from an asyncio stream; None at the end of the stream."""
    try:
        header = await reader.readexactly(HEADER.size)
        body = await reader.readexactly(_length(header))
    except asyncio.IncompleteReadError:
        return None
    return decode(body)


# ---------------------------------------------------------------- a request's events
def event_items(events: list[tuple[int, Event]], sent: dict[int, tuple[int, int]]) -> list[list[Any]]:
    """A batch of (request id, event) as the `events` message's items, each request's Steps
    coalesced into one delta after what `sent` says went before (its tokens and log-probabilities;
    updated): ["s", id, start, tokens, logprobs_start, logprobs | None, top_logprobs | None],
    ["d", id, completion], ["f", id, status, reason]. A request's items keep its events' order."""
    latest: dict[int, Step] = {}
    finals: list[list[Any]] = []
    for rid, event in events:
        if isinstance(event, Step):
            latest[rid] = event
        elif isinstance(event, Done):
            finals.append(["d", rid, event.completion.model_dump(mode="json")])
        else:
            finals.append(["f", rid, event.status, event.reason])
    items: list[list[Any]] = []
    for rid, step in latest.items():
        tokens, lps = sent.get(rid, (0, 0))
        start = min(tokens, len(step.tokens))
        lstart = min(lps, len(step.logprobs or ()), len(step.top_logprobs or ()))
        logprobs = tops = None
        if step.logprobs is not None and step.top_logprobs is not None:
            logprobs = step.logprobs[lstart:]
            tops = [[list(pair) for pair in row] for row in step.top_logprobs[lstart:]]
            sent[rid] = (len(step.tokens), lstart + len(logprobs))
        else:
            sent[rid] = (len(step.tokens), 0)
        items.append(["s", rid, start, step.tokens[start:], lstart, logprobs, tops])
    for item in finals:
        sent.pop(item[1], None)
    return items + finals  # a request's Done follows its last Step: both arrived in this order


class Streams:
    """The receiving end of `event_items`: each request's tokens so far, as Steps again."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.tops: dict[int, list[list[tuple[int, float]]]] = {}

    def event(self, item: list[Any]) -> tuple[int, Event]:
        kind, rid = item[0], int(item[1])
        if kind == "s":
            start, tokens, lstart, logprobs, tops = int(item[2]), item[3], int(item[4]), item[5], item[6]
            have = self.tokens.setdefault(rid, [])
            del have[start:]
            have.extend(int(t) for t in tokens)
            if logprobs is None or tops is None:
                return rid, Step(list(have))
            lps, top = self.logprobs.setdefault(rid, []), self.tops.setdefault(rid, [])
            del lps[lstart:], top[lstart:]
            lps.extend(float(x) for x in logprobs)
            top.extend([(int(t), float(p)) for t, p in row] for row in tops)
            return rid, Step(list(have), list(lps), list(top))
        self.forget(rid)
        if kind == "d":
            return rid, Done(Completion.model_validate(item[2]))
        if kind == "f":
            return rid, Failed(int(item[2]), str(item[3]))
        raise FrameError(f"an event of unknown kind {kind!r}")

    def forget(self, rid: int) -> None:
        self.tokens.pop(rid, None)
        self.logprobs.pop(rid, None)
        self.tops.pop(rid, None)
