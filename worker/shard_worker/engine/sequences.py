"""The state of one generate's batch: what every stage knows of each KV-cache row, and what the
first stage knows of each sequence.

A row is one sequence's slot in the KV cache. Rows are left-padded: row r's tokens start at
column pads[r], which gives its attention mask and RoPE positions. In continuous batching a
finished sequence's row is taken by a newcomer whose prompt ends at the current decode column;
its new padding masks out what the old sequence left in the row (and the engine zeroes it:
masked values are still multiplied by 0, and a failed sequence's may be NaN).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shard_contract.wire import Completion, GenerateRequest

from ..model.paging import TRASH_BLOCK
from .grammar import Grammars
from .logprobs import Extras
from .sampling import FAILED, HostSampled, Sampler, staging_for

# The padding of a row whose prompt is still being computed in chunks (`chunking.py`): past every
# decode column, so a decode step that computes the row writes TRASH and reads nothing but itself.
PARKED = 1 << 30

# Why a sequence failed when its token came back FAILED from another stage (that rank logged why).
FAILED_ELSEWHERE = "choosing its next token failed on the last pipeline stage (that rank's log says why)"


class SequenceState:
    """One sequence's generated tokens and whether (and why) it has stopped. `index` is its place
    in the generate's order of arrival (the first batch, then each newcomer); `row` its cache row."""

    def __init__(self, request: GenerateRequest, eos_ids: tuple[int, ...], index: int = 0, row: int = 0):
        self.request, self.index, self.row = request, index, row
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.prefilling = False  # its prompt is being computed in chunks: it does not decode yet
        self.admitted = 0  # when it (last) took its row: the newest running sequence is preempted first
        self.stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_ids))
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_logprobs: list[float | None] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def recompute(self) -> GenerateRequest:
        """What a preempted sequence rejoins as: its prompt and the tokens it generated, as one
        prompt, for the new tokens it has left. Its prompt's log-probabilities (echo) came with its
        first token: one preempted before it (mid-prompt) computes them again, from its prompt's
        first token (no prefix-cache hit: `Blocks.reserve`)."""
        return self.request.model_copy(update={"prompt_ids": self.request.prompt_ids + self.tokens,
                                               "max_new_tokens": self.request.max_new_tokens - len(self.tokens),
                                               "prompt_logprobs": self.request.prompt_logprobs and not self.tokens})

    def fail(self, why: str) -> None:
        """This sequence ends with an error; the batch runs on. Every first-stage rank decides it
        alike: from the same token, or the same exception over the same state."""
        self.finish_reason, self.error = "error", why

    def add(self, token: int, extra: Mapping[str, Any] | None = None) -> None:
        """Its next token (and its log-probabilities, `extra`, when asked). Stop strings are no
        concern of the engine's: the leader's text side (`text.py`) finds them and stops the
        sequence like a cancelled one."""
        if self.finish_reason is not None:
            return
        self.tokens.append(token)
        if extra is not None:
            self.prompt_logprobs += extra["prompt"]
            self.prompt_top_logprobs += extra["prompt_top"]
            for lp, top in extra["sampled"]:
                self.logprobs.append(lp)
                self.top_logprobs.append(list(top))
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.request.max_new_tokens:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        """What this sequence answers, in token ids (the leader's text side adds the text)."""
        if self.error is not None:
            return Completion(token_ids=self.tokens, finish_reason="error", error=self.error,
                              cached_tokens=self.cached_tokens)
        asked = self.request.logprobs is not None
        return Completion(token_ids=self.tokens, finish_reason=self.finish_reason or "length",
                          logprobs=self.logprobs if asked else None, top_logprobs=self.top_logprobs if asked else None,
                          prompt_logprobs=self.prompt_logprobs if self.request.prompt_logprobs else None,
                          prompt_top_logprobs=self.prompt_top_logprobs if self.request.prompt_logprobs else None,
                          cached_tokens=self.cached_tokens)


class Rows:
    """What every stage keeps per cache row: its left padding and, on the last stage (`sampler`),
    the request and seeded generator it samples with, and why its sampling failed if it did.
    Rows [0, used) have held a sequence. A decode step computes the rows from the first to the
    last running sequence (a finished row between them is computed, its results ignored until it
    is reused)."""

    def __init__(self, capacity: int, sampler: bool, grammars: Callable[[], Grammars | None] = lambda: None,
                 blocks_per_row: int = 1):
        self.pads = torch.zeros(capacity, dtype=torch.int64)
        # each row's block table (paging.py: all TRASH while no sequence holds the row) and the
        # first position it computes (those before came from the prefix cache)
        self.tables = torch.full((capacity, blocks_per_row), TRASH_BLOCK, dtype=torch.int64)
        self.starts = torch.zeros(capacity, dtype=torch.int64)
        self.generated = [0] * capacity  # per row: the tokens a recomputed sequence's prompt ends with
        self.requests: list[GenerateRequest | None] = [None] * capacity
        self.sampling = Sampler(capacity, grammars) if sampler else None
        self.extras = Extras()  # log-probabilities asked for: computed on the last stage, taken on the first
        self.failures: dict[int, str] = {}
        self.sampler, self.used = sampler, 0

    def place(self, row: int, request: GenerateRequest, pad: int, blocks: Sequence[int] = (), start: int = 0,
              generated: int = 0) -> None:
        """A sequence takes `row`: its prompt starts at column `pad`, its KV lives in `blocks` (its
        block table), of which the first `start` positions came from the prefix cache; the last
        `generated` tokens of its prompt it generated itself before it was preempted. A PARKED row
        samples nothing until its padding is set (`set_pads`): its sampler state is placed then."""
        self.pads[row] = pad
        self.tables[row] = TRASH_BLOCK
        self.tables[row, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.int64)
        self.starts[row] = start
        self.requests[row] = request
        self.failures.pop(row, None)
        self.extras.clear(row)
        self.generated[row] = generated
        if self.sampling is not None and pad < PARKED:
            self.sampling.place(row, request, generated)
        self.used = max(self.used, row + 1)

    def set_pads(self, pads: torch.Tensor) -> None:
        """Every row's padding at once (a reframe, `chunking.py`). A parked row whose padding is
        set now starts sampling: what the decode steps sampled for it while parked is forgotten."""
        for row in ((self.pads >= PARKED) & (pads < PARKED)).nonzero().flatten().tolist():
            request = self.requests[row]
            self.failures.pop(row, None)
            self.extras.forget_sampled(row)
            if self.sampling is not None and request is not None:
                self.sampling.place(row, request, self.generated[row])
        self.pads.copy_(pads)

    def grow(self, row: int, index: int, block: int) -> None:
        """The row's sequence took one more block, the `index`-th of its table."""
        self.tables[row, index] = block

    def free(self, row: int) -> None:
        """The row's sequence has let go of its blocks: whatever computes the row writes TRASH."""
        self.tables[row] = TRASH_BLOCK

    def choose(self, r0: int, logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, str], HostSampled]:
        """The next tokens (a host tensor) of rows [r0, r0 + len(logits)), the rows whose sampling
        failed now (FAILED), with why, and all the step sampled (log-probabilities when asked), in
        one copy from the device. A failed row is greedy from then on: its sequence has ended,
        and what it gets until the row is reused goes unused."""
        assert self.sampling is not None
        host = self.sampling.sample(logits, r0).to_host()
        self.sampling.accept(r0, host.tokens)
        parked = (self.pads[r0:r0 + len(logits)] >= PARKED).tolist()
        requests = [None if p else q for q, p in zip(self.requests[r0:r0 + len(logits)], parked, strict=True)]
        self.extras.sampled(requests, r0, host)
        failed = self.sampling.failures(host.tokens, r0)
        for row, why in failed.items():
            self.failures[row] = why
            self.sampling.greedy(row)
        return torch.tensor(host.tokens, dtype=torch.int64), failed, host


class Sequences:
    """The first stage's sequences of one generate: all of them in order of arrival, the one each
    row holds, and each row's next input token."""

    def __init__(self, capacity: int, eos_ids: tuple[int, ...], device: torch.device | str = "cpu"):
        self.eos_ids = eos_ids
        self.all: list[SequenceState] = []
        self.by_row: list[SequenceState | None] = [None] * capacity
        # sequences preempted for lack of KV blocks, in the order they rejoin (a row each, later)
        self.preempted: deque[SequenceState] = deque()
        self._admissions = 0
        # on the model's device: a step's sampled ids become the next step's inputs there
        self.next_tokens = torch.zeros(capacity, dtype=torch.int64, device=device)

    def start(self, row: int, request: GenerateRequest) -> SequenceState:
        seq = SequenceState(request, self.eos_ids, index=len(self.all), row=row)
        self.all.append(seq)
        self.by_row[row] = seq
        seq.admitted = self._admissions = self._admissions + 1
        return seq

    def preempt(self, row: int) -> SequenceState:
        """The row's sequence leaves its row (its blocks are released), to be computed again from
        its prompt and the tokens it generated: it goes to the front of those that rejoin."""
        seq = self.by_row[row]
        assert seq is not None and not seq.finished
        self.by_row[row] = None
        self.preempted.appendleft(seq)
        return seq

    def waiting(self) -> SequenceState | None:
        """The preempted sequence to rejoin first (those whose clients left or that stopped are dropped)."""
        while self.preempted and self.preempted[0].finished:
            self.preempted.popleft()
        return self.preempted[0] if self.preempted else None

    def resume(self, row: int) -> SequenceState:
        """The first preempted sequence takes `row` again."""
        self.waiting()
        seq = self.preempted.popleft()
        seq.row, self.by_row[row] = row, seq
        seq.admitted = self._admissions = self._admissions + 1
        return seq

    def by_age(self) -> list[int]:
        """The rows of the running sequences, the longest running first."""
        rows = self._running_rows()
        return sorted(rows, key=lambda row: self.by_row[row].admitted)  # type: ignore[union-attr]

    def free_rows(self) -> list[int]:
        """Rows a newcomer may take (their sequence has finished, or they never had one), ascending."""
        return [row for row, seq in enumerate(self.by_row) if seq is None or seq.finished]

    def cancel(self, indices: list[int]) -> None:
        """Stop these sequences (by index) now: their clients have gone."""
        for i in indices:
            if not self.all[i].finished:
                self.all[i].finish_reason = "cancelled"

    def stop(self, indices: list[int]) -> list[SequenceState]:
        """Stop these sequences (by index) now: their text met a stop string. Returns those that
        were still running (each is answered)."""
        stopped = [self.all[i] for i in indices if not self.all[i].finished]
        for seq in stopped:
            seq.finish_reason = "stop"
        return stopped

    def decoding(self) -> list[int]:
        """The rows of the running sequences that decode (not those whose prompt is being computed)."""
        return [row for row, seq in enumerate(self.by_row) if seq is not None and not seq.finished
                and not seq.prefilling]

    def live_span(self) -> tuple[int, int] | None:
        """The rows [lo, hi) from the first to the last that holds a decoding sequence (None: none)."""
        running = self.decoding()
        return (running[0], running[-1] + 1) if running else None

    def _running_rows(self) -> list[int]:
        """The rows of the running sequences, those whose prompt is being computed included."""
        return [row for row, seq in enumerate(self.by_row) if seq is not None and not seq.finished]

    def running(self) -> bool:
        return bool(self._running_rows())

    def live(self) -> bool:
        """Some sequence runs, or waits to be computed again."""
        return self.running() or self.waiting() is not None

    def feed(self, rows: list[int] | slice, tokens: torch.Tensor) -> None:
        """The rows' next inputs (a device-to-device copy when `tokens` are on the model's device;
        from the host, on a CUDA rank, through the pinned memory of the process's `HostStaging`).
        A FAILED token's row may still be computed (between running rows) until it is reused: it
        is fed token 0."""
        device = self.next_tokens.device
        if tokens.device != device:
            staging = staging_for(device, tokens.numel())
            tokens = staging.upload(tokens, device) if staging is not None else tokens.to(device)
        self.next_tokens[rows] = tokens.clamp(min=0)

    def add(self, rows: list[int], tokens: list[int], failures: Mapping[int, str],
            extras: Extras | None = None) -> list[SequenceState]:
        """Give each row's sequence its token (and the log-probabilities it asked for, from
        `extras`); the sequences that were still running took one (a FAILED token fails its
        sequence, with why from `failures` when this rank sampled it). A row whose prompt is still
        being computed takes nothing (a decode step computed it parked)."""
        took = []
        for row, token in zip(rows, tokens, strict=False):
            seq = self.by_row[row]
            if seq is not None and seq.prefilling:
                continue
            extra = extras.take(row) if extras is not None else None
            if seq is not None and not seq.finished:
                if token == FAILED:
                    seq.fail(failures.get(row, FAILED_ELSEWHERE))
                else:
                    seq.add(token, extra)
                took.append(seq)
        return took
