"""How work flows through the pipeline stages.

A *unit* is rows [r0, r1) of the batch over cache columns [c0, c1): one forward pass of one
stage. The first stage decides every unit; it sends a 5-integer header and then the hidden states
to the next stage, which runs the same unit and passes it on. The last stage turns a unit that
reaches the end of the prompt (or any decode unit) into tokens and sends them back to the first
stage. A STOP header ends the generation on every stage. The downstream stages need no other
per-step message: each unit describes itself.

A prefill is cut into micro-batches (rows) and chunks (columns), so the first stage computes the
next unit while the later stages work on the previous ones (sends are asynchronous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Longest prefill forward pass, in tokens: activation memory stays bounded for long prompts
# (shard_operator.sizing sizes activations with the same number).
from shard_operator.sizing import PREFILL_CHUNK

from .dist import FORWARD_TAG, RETURN_TAG, Comm, Pending

RUN, STOP = 1, 2
HEADER_INTS = 5


@dataclass(frozen=True)
class Unit:
    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.c1 - self.c0

    def emits(self, prompt_cols: int) -> bool:
        """Whether the last stage samples after this unit: it ends the prompt, or decodes."""
        return self.c1 >= prompt_cols


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


def prefill_units(batch: int, prompt_cols: int, stages: int, chunk: int = PREFILL_CHUNK) -> list[Unit]:
    """The prefill of `batch` left-padded prompts of `prompt_cols` columns, in processing order.

    Rows go into min(batch, stages) micro-batches; columns into chunks of at most `chunk`, and into
    enough chunks that there are at least `stages` units to keep every stage busy. Chunks come
    first in the order, so each row's cache fills left to right on every stage.
    """
    row_groups = split(batch, stages)
    n_chunks = max(-(-prompt_cols // chunk), -(-stages // len(row_groups)))
    return [Unit(r0, r1, c0, c1) for c0, c1 in split(prompt_cols, n_chunks) for r0, r1 in row_groups]


class Link:
    """One rank's point-to-point traffic: units downstream, tokens back to the first stage."""

    def __init__(self, comm: Comm, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.comm, self.topo = comm, comm.topo
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.pending: list[Pending] = []

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        if len(self.pending) >= 16:  # long since received: release their buffers
            for p in self.pending[:8]:
                p.wait()
            del self.pending[:8]
        self.pending.append(self.comm.isend(t, dst, tag))

    def flush(self) -> None:
        """Wait for every outstanding send (their buffers may then be freed)."""
        for p in self.pending:
            p.wait()
        self.pending.clear()

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------ downstream
    def send_unit(self, unit: Unit, hidden: torch.Tensor) -> None:
        self._isend(self._ints([RUN, unit.r0, unit.r1, unit.c0, unit.c1]), self.topo.next, FORWARD_TAG)
        self._isend(hidden.contiguous(), self.topo.next, FORWARD_TAG)

    def send_stop(self) -> None:
        self._isend(self._ints([STOP, 0, 0, 0, 0]), self.topo.next, FORWARD_TAG)
        self.flush()

    def recv_unit(self) -> tuple[Unit, torch.Tensor] | None:
        """The next unit and its hidden states from the previous stage; None at STOP."""
        header = self.comm.recv(self._ints([0] * HEADER_INTS), self.topo.prev, FORWARD_TAG)
        kind, r0, r1, c0, c1 = (int(v) for v in header.tolist())
        if kind == STOP:
            return None
        unit = Unit(r0, r1, c0, c1)
        hidden = torch.empty(unit.rows, unit.cols, self.hidden_size, dtype=self.dtype, device=self.device)
        return unit, self.comm.recv(hidden, self.topo.prev, FORWARD_TAG)

    # ------------------------------------------------------------ tokens back
    def send_tokens(self, tokens: torch.Tensor, logits: torch.Tensor | None) -> None:
        self._isend(tokens, self.topo.first, RETURN_TAG)
        if logits is not None:
            self._isend(logits, self.topo.first, RETURN_TAG)

    def recv_tokens(self, rows: int, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = self.comm.recv(self._ints([0] * rows), self.topo.last, RETURN_TAG)
        logits = None
        if vocab is not None:
            logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
            self.comm.recv(logits, self.topo.last, RETURN_TAG)
        return tokens, logits
