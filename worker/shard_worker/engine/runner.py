"""One rank's share of a step: the step's units through this rank's stage, and the batch's row
changes here and down the pipeline.

The first stage runs the units it composed (`Runner.run`), with the token ids it chose; a later
stage runs each unit as it arrives (`Runner.relay`); the last stage samples the tokens of the
units that emit and sends them back. The row changes (a joiner takes its row, a row lets go of its
blocks or takes one more, the paddings move) are decided on the first stage (`boundary.py`) and
applied by every stage in the order they come, each passing them on before the units that need
them (`pipeline.py`).
"""

from __future__ import annotations

import time

import torch

from ..comm.dist import Comm
from ..log import log
from ..model.model import Stage
from ..model.step import KVCache, Rotary, Step
from ..telemetry.accounting import Accounting, Counters
from . import logprobs
from .graphs import DecodeGraphs, chosen_mode
from .kvblocks import Blocks
from .pipeline import Free, Grow, Join, Link, Pads, Unit
from .sequences import Rows


class Runner:
    def __init__(self, stage: Stage, cache: KVCache, comm: Comm, rotary: Rotary, acct: Accounting, blocks: Blocks):
        self.stage, self.cache, self.rotary, self.acct, self.blocks = stage, cache, rotary, acct, blocks
        self.topo = comm.topo
        self.link = Link(comm, stage.config.hidden_size, stage.dtype, stage.device)
        # decode steps replayed from captured graphs (graphs.py), or None: the eager step
        mode = chosen_mode(stage, comm)
        self.graphs = DecodeGraphs(stage, cache, rotary, comm, mode) if mode != "off" else None
        self.prompt_cols = 0
        self.decode_mark: tuple[float, Counters] | None = None  # when the decode steps began
        # chunks of prompts that end later, waiting to ride with the step's decode unit (`defer`)
        self.pending: list[tuple[Unit, torch.Tensor]] = []

    def begin(self, prompt_cols: int) -> None:
        """A generate starts: its first batch's prompts end at `prompt_cols`; no decode step yet."""
        self.prompt_cols, self.decode_mark = prompt_cols, None

    # ------------------------------------------------------------ row changes, here and down the pipeline
    def take_row(self, rows: Rows, join: Join) -> None:
        """A joiner takes its row on this rank (and is passed on down the pipeline): its padding,
        its block table and first own position. Its prefill writes its own positions; what the
        row's previous sequence left is in blocks it no longer holds (paging.py)."""
        rows.place(join.row, join.request, join.pad, join.blocks, join.start, join.generated)
        self.blocks.hold(join.row, list(join.blocks))
        if not self.topo.is_last:
            self.link.send_join(join)

    def free_row(self, rows: Rows, row: int) -> None:
        """The row's sequence stopped or was preempted: its block table lets go."""
        rows.free(row)
        if not self.topo.is_last:
            self.link.send_free(row)

    def grow(self, rows: Rows, more: Grow) -> None:
        """The row's sequence takes one more KV block."""
        rows.grow(more.row, more.index, more.block)
        if not self.topo.is_last:
            self.link.send_grow(more)

    def set_pads(self, rows: Rows, pads: torch.Tensor) -> None:
        """The batch is reframed: every row's padding, before the units computed with it."""
        rows.set_pads(pads)
        if not self.topo.is_last:
            self.link.send_pads(pads)

    def stop(self) -> None:
        """The generate's last step has gone down the pipeline."""
        if not self.topo.is_last:
            self.link.send_stop()

    # ------------------------------------------------------------ units
    def forward(self, unit: Unit, x: torch.Tensor, rows: Rows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The unit through this stage: its hidden states [rows, cols, H] (None for a replayed
        decode step on the last stage), and on the last stage after an emitting unit the float32
        logits [rows, vocab] of its last column (else None)."""
        if self.decode_mark is None and unit.c0 >= self.prompt_cols and not unit.positions:  # the first decode step
            self.decode_mark = (time.perf_counter(), self.acct.snapshot())
        logits_here = self.topo.is_last and unit.emits
        with self.acct.computing():
            if self.graphs is not None and unit.cols == 1 and not unit.positions:  # a decode step, replayed
                out = self.graphs.run(unit.r0, unit.r1, unit.c0, x, rows.pads, rows.tables)
                return (None, out) if self.topo.is_last else (out, None)
            hidden = self.stage.forward(x, self._step(unit, rows), self.cache)
            return hidden, self.stage.logits(hidden[:, -1]) if logits_here else None

    def _step(self, unit: Unit, rows: Rows) -> Step:
        """The unit's forward pass context; a chunk's tokens each at its own column (`per_token`)."""
        return Step.build(unit.r0, unit.r1, unit.c0, unit.c1, self._pads(unit, rows), self.rotary,
                          self.stage.windows, self.stage.dtype, self.stage.device, tables=rows.tables,
                          starts=rows.starts, per_token=unit.positions)

    # ------------------------------------------------------------ chunks beside the decode unit
    def defer(self, work: list[tuple[Unit, torch.Tensor]]) -> bool:
        """Keep chunks of prompts that do not end in this step (units that do not emit) to run with
        the step's decode unit, in one pass where the fused layers take both (`Stage.forward_parts`:
        each layer's weights read once for all), when this rank is the whole pipeline and runs its
        decode steps eagerly. Returns whether it kept them (else the caller runs them now)."""
        if self.topo.pp != 1 or self.graphs is not None or any(u.emits or not u.positions for u, _ in work):
            return False
        self.pending += work
        return True

    def flush(self, rows: Rows) -> None:
        """Run the kept chunks now (no decode unit comes in this step)."""
        if self.pending:
            self.run([], rows, None)

    def _merged(self, work: list[tuple[Unit, torch.Tensor]], rows: Rows,
                return_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Kept chunks and the decode unit after them (`defer`), as one pass of this stage (the
        last: pp = 1): the chunks' prompt log-probabilities, the decode unit's tokens."""
        decode = work[-1][0]
        if self.decode_mark is None and decode.c0 >= self.prompt_cols:  # the first decode step
            self.decode_mark = (time.perf_counter(), self.acct.snapshot())
        with self.acct.computing():
            parts = [(x.to(self.stage.device, non_blocking=True), self._step(u, rows)) for u, x in work]
            hiddens = self.stage.forward_parts(parts, self.cache)
            logits = self.stage.logits(hiddens[-1][:, -1])
        for (unit, _), hidden in zip(work, hiddens, strict=True):
            self._prompt_logprobs(unit, hidden, rows)
        return self._sample(decode, logits, rows, return_logits)

    @staticmethod
    def _pads(unit: Unit, rows: Rows) -> torch.Tensor:
        """The rows' paddings in `unit`: a parked row's chunk is computed by position (padding 0)."""
        return torch.zeros_like(rows.pads) if unit.positions else rows.pads

    def _sample(self, unit: Unit, logits: torch.Tensor, rows: Rows,
                return_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unit's tokens (on the host: the sampler's one device-to-host copy of the step)."""
        with self.acct.computing():
            tokens, failed, _ = rows.choose(unit.r0, logits)
        for row, why in failed.items():  # that request fails alone (every sampler meets the same)
            log(self.topo.rank, f"the sequence in row {row} failed: {why}")
        return tokens, (logits if return_logits else None)

    def _prompt_logprobs(self, unit: Unit, hidden: torch.Tensor, rows: Rows) -> None:
        """The last stage: the prompt log-probabilities (echo) the unit's rows asked for."""
        requests = rows.requests[unit.r0:unit.r1]
        if any(q is not None and q.prompt_logprobs for q in requests):
            with self.acct.computing():
                rows.extras.prompt(requests, self._pads(unit, rows), unit.r0, unit.c0, hidden, self.stage.logits)

    def _through(self, unit: Unit, x: torch.Tensor, rows: Rows,
                 return_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The unit through this stage, then on to the next; on the last stage, the prompt
        log-probabilities it asked for and, after an emitting unit, its sampled tokens (and logits)."""
        hidden, logits = self.forward(unit, x, rows)
        if not self.topo.is_last:
            assert hidden is not None  # only the last stage's replayed step keeps its hidden states
            self.link.send_unit(unit, hidden)
            return None
        if hidden is not None:
            self._prompt_logprobs(unit, hidden, rows)
        if not unit.emits:
            return None
        assert logits is not None  # the last stage has logits after an emitting unit
        return self._sample(unit, logits, rows, return_logits)

    def run(self, work: list[tuple[Unit, torch.Tensor]], rows: Rows,
            vocab: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first stage: run each unit, with its token ids, through the pipeline. Returns the
        tokens (and with `vocab`, the logits) sampled after the emitting units, in row order."""
        work, self.pending = self.pending + work, []
        emitted: list[tuple[Unit, torch.Tensor, torch.Tensor | None]] = []
        if len(work) > 1 and self.topo.pp == 1 and work[-1][0].emits and not work[-1][0].positions \
                and all(u.positions and not u.emits for u, _ in work[:-1]):  # kept chunks, then the decode unit
            unit = work[-1][0]
            emitted.append((unit, *self._merged(work, rows, vocab is not None)))
            work = []
        for unit, ids in work:
            sampled = self._through(unit, ids.to(self.stage.device, non_blocking=True), rows, vocab is not None)
            if sampled is not None:
                emitted.append((unit, *sampled))
        if not self.topo.is_last:
            emitted = []
            for u, _ in work:
                if u.emits:
                    emitted.append((u, *self.link.recv_tokens(u.rows, vocab)))
                    if logprobs.wants(rows.requests[u.r0:u.r1]):
                        rows.extras.merge(self.link.recv_extras())
        emitted.sort(key=lambda e: e[0].r0)
        if not emitted:  # chunks of prompts that do not end yet
            return torch.zeros(0, dtype=torch.int64), None
        tokens = torch.cat([t for _, t, _ in emitted])
        return tokens, (torch.cat([lg for _, _, lg in emitted if lg is not None]) if vocab is not None else None)

    def relay(self, rows: Rows, return_logits: bool) -> None:
        """A later stage: run each unit as it arrives, apply each row change; the last stage sends
        tokens back."""
        while (got := self.link.recv()) is not None:
            if isinstance(got, Join):
                self.take_row(rows, got)
                continue
            if isinstance(got, Free):
                self.free_row(rows, got.row)
                continue
            if isinstance(got, Pads):
                self.set_pads(rows, got.values)
                continue
            if isinstance(got, Grow):
                self.grow(rows, got)
                continue
            unit, received = got
            sampled = self._through(unit, received, rows, return_logits)
            if sampled is not None:  # the last stage sends the tokens back to the first
                self.link.send_tokens(*sampled)
                if logprobs.wants(rows.requests[unit.r0:unit.r1]):
                    self.link.send_extras(rows.extras.unit(unit.r0, unit.r1))
        self.stop()
