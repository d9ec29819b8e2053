"""How work flows through the pipeline stages.

A *unit* is rows [r0, r1) of the batch over cache columns [c0, c1): one forward pass of one
stage. The first stage decides every unit; it sends a 6-integer header (the unit, and whether it
*emits*: the last stage samples after it because it ends a prompt or decodes) and then the hidden
states to the next stage, which runs the same unit and passes it on. The last stage turns an
emitting unit into tokens and sends them back to the first stage. A JOIN header, followed by the
request as JSON, says that a request takes a row of a running batch (continuous batching): every
stage sets the row's left padding, the last stage its sampling parameters and seeded generator.
The JOIN also carries the row's block table and its first own position (paged KV cache: the
leader decides where each sequence's KV lives; every rank writes its share there), and a FREE
header says that a row's sequence let go of its blocks (the row writes TRASH until it is taken
again: it finished, or was preempted to be computed again later), and a GROW header that a running
sequence took one more block (a continuous batch gives blocks as sequences grow). A joiner's prompt
is computed in chunks over several steps (`chunking.py`) by units that say so (`positions`: their
columns are the row's positions, its padding taken as 0) while its row is PARKED; a PADS header,
followed by every row's padding, reframes the batch when a joiner's prompt is done. A STOP header
ends the generation on every stage. The downstream stages need no other message: each unit
describes itself.

A prefill is cut into micro-batches (rows) and chunks (columns), so the first stage computes the
next unit while the later stages work on the previous ones (sends are asynchronous).

Why tokens go back over the control group (gloo), not the tensor backend: NCCL's send may not
complete before the matching receive is posted, NCCL ignores tags, and a rank's point-to-point
operations run in order on one stream. With both directions on that stream, the first stage queues
the sends of every unit of a pass before the receive of the first unit's tokens, while the last
stage queues that unit's tokens before the receive of the next unit: each waits for the other, a
circular wait (up to the watchdog's timeout). With tokens on gloo (buffered, tagged, on the CPU,
its own threads), the tensor backend carries traffic downstream only: every send waits for a stage
further down, every receive for one further up, the last stage sends nothing and the first
receives nothing on it, so no wait can close a circle. Tokens are a few bytes, needed on the CPU by
the first stage anyway. Posting receives first cannot help on one in-order stream (a receive at its
head blocks the sends behind it), and batched isend/irecv would make the first stage compute a
whole pass before sending any of it. tests/worker/test_rendezvous.py runs this schedule over a
communicator with exactly NCCL's rendezvous semantics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

# Longest prefill forward pass, in tokens: activation memory stays bounded for long prompts
# (shard_operator.sizing sizes activations with the same number).
from shard_contract.sharding import PREFILL_CHUNK
from shard_contract.wire import GenerateRequest

from ..comm.dist import FORWARD_TAG, Comm, Pending

RUN, STOP, JOIN, FREE, PADS, GROW = 1, 2, 3, 4, 5, 6
HEADER_INTS = 6


@dataclass(frozen=True)
class Unit:
    r0: int
    r1: int
    c0: int
    c1: int
    emits: bool = False  # the last stage samples after it (it ends a prompt, or decodes)
    positions: bool = False  # a chunk of a parked row's prompt: its columns are the row's positions

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.c1 - self.c0


@dataclass(frozen=True)
class Join:
    """`request` takes `row` of the running batch, its prompt starting at column `pad`, its KV in
    `blocks` (its block table), the first `start` positions from the prefix cache; the last
    `generated` tokens of its prompt are those it generated before it was preempted."""

    row: int
    pad: int
    request: GenerateRequest
    blocks: tuple[int, ...] = ()
    start: int = 0
    generated: int = 0


@dataclass(frozen=True)
class Pads:
    """Every row's padding from now on (a reframe: `chunking.py`)."""

    values: torch.Tensor


@dataclass(frozen=True)
class Free:
    """The sequence in `row` let go of its KV blocks."""

    row: int


@dataclass(frozen=True)
class Grow:
    """The sequence in `row` took block `block`, the `index`-th of its block table."""

    row: int
    index: int
    block: int


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous near-equal ranges (the first ones one longer)."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_units(row: int, start: int, end: int, last: bool, stages: int) -> list[Unit]:
    """A chunk of a parked row's prompt, positions [start, end) (`chunking.Chunk`), as units
    by position; the one that ends the prompt emits."""
    return [Unit(u.r0, u.r1, u.c0, u.c1, emits=u.emits and last, positions=True)
            for u in prefill_units((row, row + 1), (start, end), stages)]


def prefill_units(rows: tuple[int, int], cols: tuple[int, int], stages: int,
                  chunk: int = PREFILL_CHUNK, max_rows: int | None = None) -> list[Unit]:
    """The prefill of rows [r0, r1), left-padded prompts ending at column c1, over columns
    [c0, c1), in processing order; the units that reach c1 emit.

    Rows go into min(rows, stages) micro-batches, or more so that none has over `max_rows` rows
    (the rows of the largest pass the plan sized activations for: `sharding.prefill_rows`);
    columns into chunks of at most `chunk`, and into enough chunks that there are at least
    `stages` units to keep every stage busy. Chunks come first in the order, so each row's cache
    fills left to right on every stage.
    """
    (r0, r1), (c0, c1) = rows, cols
    row_groups = split(r1 - r0, max(stages, -(-(r1 - r0) // max_rows) if max_rows else 1))
    n_chunks = max(-(-(c1 - c0) // chunk), -(-stages // len(row_groups)))
    return [Unit(r0 + a, r0 + b, c0 + left, c0 + right, emits=c0 + right == c1)
            for left, right in split(c1 - c0, n_chunks) for a, b in row_groups]


class Link:
    """One rank's point-to-point traffic: units downstream, tokens back to the first stage."""

    def __init__(self, comm: Comm, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.comm, self.topo = comm, comm.topo
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.pending: list[Pending] = []

    def _track(self, send: Pending) -> None:
        if len(self.pending) >= 16:  # long since received: release their buffers
            for p in self.pending[:8]:
                p.wait()
            del self.pending[:8]
        self.pending.append(send)

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._track(self.comm.isend(t, dst, tag))

    def flush(self) -> None:
        """Wait for every outstanding send (their buffers may then be freed)."""
        for p in self.pending:
            p.wait()
        self.pending.clear()

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @property
    def _next(self) -> int:
        """The next stage's partner rank: where units go (the last stage sends none)."""
        if self.topo.next is None:
            raise RuntimeError("the last stage sends nothing downstream")
        return self.topo.next

    @property
    def _prev(self) -> int:
        """The previous stage's partner rank: where units come from (the first stage receives none)."""
        if self.topo.prev is None:
            raise RuntimeError("the first stage receives nothing from upstream")
        return self.topo.prev

    # ------------------------------------------------------------ downstream
    def _send_header(self, *values: int) -> None:
        self._isend(self._ints([*values] + [0] * (HEADER_INTS - len(values))), self._next, FORWARD_TAG)

    def send_unit(self, unit: Unit, hidden: torch.Tensor) -> None:
        self._send_header(RUN, unit.r0, unit.r1, unit.c0, unit.c1, int(unit.emits) | int(unit.positions) << 1)
        self._isend(hidden.contiguous(), self._next, FORWARD_TAG)

    def send_join(self, join: Join) -> None:
        body = json.dumps({"request": join.request.model_dump(mode="json"), "blocks": list(join.blocks),
                           "generated": join.generated})
        payload = torch.frombuffer(bytearray(body.encode()), dtype=torch.uint8)
        self._send_header(JOIN, join.row, join.pad, payload.numel(), join.start)
        self._isend(payload.to(self.device), self._next, FORWARD_TAG)

    def send_free(self, row: int) -> None:
        self._send_header(FREE, row)

    def send_pads(self, pads: torch.Tensor) -> None:
        self._send_header(PADS, pads.numel())
        self._isend(pads.to(self.device, dtype=torch.int64), self._next, FORWARD_TAG)

    def send_grow(self, grow: Grow) -> None:
        self._send_header(GROW, grow.row, grow.index, grow.block)

    def send_stop(self) -> None:
        self._send_header(STOP)
        self.flush()

    def recv(self) -> tuple[Unit, torch.Tensor] | Join | Free | Pads | Grow | None:
        """The next unit and its hidden states from the previous stage, a join, a free, a grow or
        the rows' paddings; None at STOP."""
        header = self.comm.recv(self._ints([0] * HEADER_INTS), self._prev, FORWARD_TAG)
        kind, *args = (int(v) for v in header.tolist())
        if kind == STOP:
            return None
        if kind == JOIN:
            return self._recv_join(*args[:4])
        if kind == FREE:
            return Free(args[0])
        if kind == PADS:
            pads = self.comm.recv(torch.empty(args[0], dtype=torch.int64, device=self.device), self._prev,
                                  FORWARD_TAG)
            return Pads(pads.cpu())
        if kind == GROW:
            return Grow(*args[:3])
        r0, r1, c0, c1, flags = args[:5]
        unit = Unit(r0, r1, c0, c1, emits=bool(flags & 1), positions=bool(flags & 2))
        hidden = torch.empty(unit.rows, unit.cols, self.hidden_size, dtype=self.dtype, device=self.device)
        return unit, self.comm.recv(hidden, self._prev, FORWARD_TAG)

    def _recv_join(self, row: int, pad: int, size: int, start: int) -> Join:
        payload = self.comm.recv(torch.empty(size, dtype=torch.uint8, device=self.device), self._prev,
                                 FORWARD_TAG)
        body = json.loads(bytes(payload.cpu().numpy()))
        return Join(row, pad, GenerateRequest.model_validate(body["request"]), tuple(body["blocks"]), start,
                    body["generated"])

    # ------------------------------------------------------------ tokens back (control group)
    def send_tokens(self, tokens: torch.Tensor, logits: torch.Tensor | None) -> None:
        for t in (tokens, logits) if logits is not None else (tokens,):
            self._track(self.comm.isend_control(t, self.topo.first))

    def send_extras(self, extras: dict[int, Any]) -> None:
        """The log-probabilities the rows of an emitting unit asked for (`logprobs.py`), after its tokens."""
        payload = torch.frombuffer(bytearray(json.dumps(extras).encode()), dtype=torch.uint8)
        self._track(self.comm.isend_control(torch.tensor([payload.numel()], dtype=torch.int64), self.topo.first))
        self._track(self.comm.isend_control(payload, self.topo.first))

    def recv_extras(self) -> dict[str, Any]:
        size = self.comm.recv_control(torch.zeros(1, dtype=torch.int64), self.topo.last)
        payload = self.comm.recv_control(torch.empty(int(size[0]), dtype=torch.uint8), self.topo.last)
        got: dict[str, Any] = json.loads(bytes(payload.numpy()))
        return got

    def recv_tokens(self, rows: int, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens (and logits) of an emitting unit, on the CPU."""
        tokens = self.comm.recv_control(torch.zeros(rows, dtype=torch.int64), self.topo.last)
        logits = None
        if vocab is not None:
            logits = self.comm.recv_control(torch.empty(rows, vocab, dtype=torch.float32), self.topo.last)
        return tokens, logits
