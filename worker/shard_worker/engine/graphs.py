"""A decode step the GPU replays: one captured graph per batch and context bucket.

A decode step (one token for each of a few rows) does microseconds of work per kernel and ~40
kernels a layer: launched one by one from Python, the GPU waits on the host. Here the step is a
function of persistent device buffers only (`decode_forward`: the input ids or hidden states,
the step's cache column, each row's left padding and block table; the KV cache and the weights it closes over),
captured once per (batch bucket, context bucket) and replayed:

- batch buckets 1, 2, 4, ... up to maxBatchSize (`shard_contract.sharding.batch_buckets`): a step
  of rows [r0, r1) replays the bucket that covers rows [0, r1); the rows it computes beyond those
  asked for (free, finished, never used) write their own cache rows at the step's column and are
  otherwise ignored;
- context buckets 256, 512, ... up to maxModelLen: where attention gathers each row's context,
  it gathers that many columns, those past the step's own masked out, and read from the ZERO
  block (a masked value is still multiplied by 0, and 0 x NaN is NaN: what a failed sequence left
  in a block cannot poison the next).

The KV cache is paged (`paging.py`): the rows' block tables are a device buffer too, and the step
reads and writes the pool through them; attention reads each row's blocks in place by default
(`paged.py`: on CUDA, and in compile mode on any device), whatever the context bucket.

`mode` (SHARD_DECODE_GRAPHS): `cuda` captures the eager step with `torch.cuda.CUDAGraph` (one
memory pool shared by every graph; the tensor-parallel all-reduces are captured too: NCCL
collectives can be); `compile` uses `torch.compile(mode="reduce-overhead", fullgraph=True)`
(CUDA graphs by inductor, with its fusions); `eager` runs the same static step without capture
(the CPU proofs, and ranks whose collectives cannot be captured: gloo); `off` keeps the engine's
eager step. `auto` (default) is `cuda` on a GPU where every layer is resident and the tensor
backend is NCCL (or TP = 1), else `off`: a CPU rank keeps the fused C layers (`fused.py`).

Each step's inputs reach the buffers without a host synchronisation: the column by a fill (a
scalar kernel argument), the ids from the device tensor the sampler returned, the padding only
when a row changes hands. The engine then copies the sampled ids to the host once (pinned).

The collectives inside a graph are recorded when it is captured (`Comm.recording`; in compile
mode by one eager run of the bucket's step, since inductor's graph runs them unseen) and counted
at every replay (`Accounting.replayed`): their bytes by construction, their time inside the
replay's compute span (one launch runs kernels and collectives together).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from shard_contract.env import DECODE_GRAPHS_ENV
from shard_contract.sharding import DECODE_MIN_LENGTH, batch_buckets, length_buckets

from ..comm.dist import Comm
from ..model import kernels, paged
from ..model.model import Stage
from ..model.paging import RESERVED_BLOCKS, TRASH_BLOCK
from ..model.step import KVCache, Rotary, Step

ENV = DECODE_GRAPHS_ENV
MODES = ("auto", "off", "eager", "cuda", "compile")
MIN_LENGTH = DECODE_MIN_LENGTH  # the shortest context bucket (the contract's: the planner counts the graphs)
Tape = tuple[tuple[str, int], ...]  # a step's collectives: (op, bytes) in issue order
Masks = dict[int | None, paged.MaskTensors]  # a step's block masks' tensors, per attention window


def smallest(buckets: list[int], at_least: int) -> int:
    return next(b for b in buckets if b >= at_least)


def chosen_mode(stage: Stage, comm: Comm, env: str | None = None) -> str:
    """The mode this rank runs (see the module docstring); ValueError for an unknown one."""
    want = (env if env is not None else os.environ.get(ENV, "auto")).strip().lower() or "auto"
    if want not in MODES:
        raise ValueError(f"{ENV}={want!r}: one of {', '.join(MODES)}")
    if want != "auto":
        return want
    capturable = (stage.device.type == "cuda" and not any(layer.streamed for layer in stage.layers)
                  and (comm.topo.tp == 1 or not comm.small_by_broadcast))
    return "cuda" if capturable else "off"


def decode_masks(stage: Stage, cache: KVCache, column: torch.Tensor, pads: torch.Tensor, tables: torch.Tensor,
                 rows: int) -> Masks:
    """The block masks' tensors (per attention window) of the decode step of rows [0, rows) at
    device column `column` [1]: what a compiled step takes as inputs, built outside it
    (`paged.block_mask` says why). Device tensors only."""
    positions = (column - pads[:rows]).unsqueeze(1)
    pool = cache.num_blocks + RESERVED_BLOCKS
    return {w: paged.mask_tensors(tables[:rows], *paged.bounds(positions, w), pool, cache.block_size)
            for w in stage.windows}


def decode_forward(stage: Stage, cache: KVCache, rotary: Rotary, x: torch.Tensor, column: torch.Tensor,
                   pads: torch.Tensor, tables: torch.Tensor, rows: int, length: int,
                   masks: Masks | None = None) -> torch.Tensor:
    """One decode step of cache rows [0, rows) at device column `column` [1], attending over
    `length` columns through the rows' block tables `tables`: ids [rows, 1] (first stage) or hidden
    states [rows, 1, H] -> hidden states [rows, 1, H], or, on the last stage, float32 logits [rows,
    vocab]. Torch operators on device tensors only: no host value is read, so it can be captured,
    replayed and compiled. `masks` (`decode_masks`): where attention reads the pool in place, its
    block masks' tensors; a compiled step must be given them (else the step builds them)."""
    with kernels.torch_only():
        step = Step.captured(rows, length, column, pads, rotary, stage.windows, stage.dtype, tables, masks)
        hidden = stage.forward(x, step, cache)
        return hidden if stage.lm_head is None else stage.logits(hidden[:, -1])


def _refresh(host: torch.Tensor, device: torch.Tensor, new: torch.Tensor) -> None:
    """`new`'s rows into the device buffer through its (pinned) host twin, only when they changed:
    the comparison is of host tensors, so no step waits on the device for it."""
    n = new.shape[0]
    if not torch.equal(host[:n], new):
        host[:n].copy_(new)
        device[:n].copy_(host[:n], non_blocking=True)


class DecodeGraphs:
    """This rank's replayed decode steps. `run` takes one decode unit; graphs are captured on
    first use of their buckets (every TP rank meets them at the same step: they run the same
    units), or all at once by `capture_all`."""

    def __init__(self, stage: Stage, cache: KVCache, rotary: Rotary, comm: Comm, mode: str,
                 min_length: int = MIN_LENGTH):
        if mode not in ("eager", "cuda", "compile"):
            raise ValueError(f"DecodeGraphs runs eager, cuda or compile, not {mode!r}")
        if mode == "cuda" and stage.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.stage, self.cache, self.rotary, self.comm, self.mode = stage, cache, rotary, comm, mode
        self.batches, self.lengths = batch_buckets(cache.batch), length_buckets(cache.max_len, min_length)
        device, top = stage.device, cache.batch
        hidden = stage.config.hidden_size
        self.x = (torch.zeros(top, 1, dtype=torch.int64, device=device) if stage.embed is not None
                  else torch.zeros(top, 1, hidden, dtype=stage.dtype, device=device))
        self.column = torch.zeros(1, dtype=torch.int64, device=device)
        self.pads = torch.zeros(top, dtype=torch.int64, device=device)
        self._pads_host = torch.zeros(top, dtype=torch.int64, pin_memory=device.type == "cuda")
        # the rows' block tables (paging.py), on the device; a free row's is all TRASH
        trash = torch.full_like(cache.contiguous, TRASH_BLOCK)
        self.tables = trash.to(device)
        self._tables_host = trash.pin_memory() if device.type == "cuda" else trash
        self._graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor, Tape]] = {}
        self._tapes: dict[tuple[int, int], Tape] = {}  # compile mode: each bucket's collectives
        self._seen: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self._compiled: Callable[..., torch.Tensor] | None = None
        if mode == "compile":
            pools = [*cache.layer_k, *cache.layer_v]  # what the step takes: each layer's, at its own address
            for t in [*stage.tensors().values(), *pools, self.x, self.column, self.pads, self.tables]:
                torch._dynamo.mark_static_address(t)
            self._compiled = torch.compile(decode_forward, mode="reduce-overhead" if device.type == "cuda" else None,
                                           fullgraph=True, dynamic=False)

    @property
    def captured(self) -> int:
        """Buckets captured (cuda) or run (eager, compile) so far."""
        return len(self._graphs) + len(self._seen)

    def run(self, r0: int, r1: int, col: int, x: torch.Tensor, pads: torch.Tensor,
            tables: torch.Tensor) -> torch.Tensor:
        """The decode step of rows [r0, r1) at column `col`: x [r1 - r0, 1] ids or [r1 - r0, 1, H]
        hidden states (on the device, or a host tensor copied in), `pads` and `tables` every row's
        padding and block table on the host. Returns hidden states [r1 - r0, 1, H] (a copy: a later
        replay overwrites the graph's output) or the last stage's logits [r1 - r0, vocab] (a view,
        valid until the next step)."""
        rows, length = smallest(self.batches, r1), smallest(self.lengths, col + 1)
        self._inputs(r0, r1, col, x, pads, tables)
        if self.mode == "cuda":
            replay, out, tape = self._graph(rows, length)
            replay()
            self.comm.acct.replayed(tape)
        else:  # eager, or compiled (inductor's CUDA graphs replay inside the call)
            if self.mode == "compile" and (rows, length) not in self._tapes:
                self._tapes[rows, length] = self._record(rows, length)
            self._seen.add((rows, length))
            out = self._forward(rows, length)
            self.comm.acct.replayed(self._tapes.get((rows, length), ()))  # eager: counted as they ran
        return out[r0:r1] if self.stage.lm_head is not None else out[r0:r1].clone()

    def capture_all(self, col: int = 0) -> None:
        """Capture (or compile) every bucket now, a warm-up before serving: runs each once at
        column `col`, which writes every cache row there (harmless before a batch: prefill writes
        what it reads)."""
        self.column.fill_(col)
        for rows in self.batches:
            for length in self.lengths:
                if self.mode == "cuda":
                    self._graph(rows, length)[0]()
                else:
                    self._seen.add((rows, length))
                    self._forward(rows, length)

    def _inputs(self, r0: int, r1: int, col: int, x: torch.Tensor, pads: torch.Tensor, tables: torch.Tensor) -> None:
        self.column.fill_(col)  # a scalar argument of a fill kernel: no copy, no host wait
        self.x[r0:r1].copy_(x, non_blocking=True)
        _refresh(self._pads_host, self.pads, pads)  # rows changed hands
        _refresh(self._tables_host, self.tables, tables)  # a row took or let go of blocks

    def _graph(self, rows: int, length: int) -> tuple[Callable[[], None], torch.Tensor, Tape]:
        key = (rows, length)
        if key not in self._graphs:
            self._graphs[key] = self._make(rows, length)
        return self._graphs[key]

    def _forward(self, rows: int, length: int) -> torch.Tensor:
        if self._compiled is None:
            with self.comm.captured(self.mode != "eager"):
                return decode_forward(self.stage, self.cache, self.rotary, self.x[:rows], self.column, self.pads,
                                      self.tables, rows, length)
        # the block masks' tensors are built outside the compiled step, a few small kernels (on
        # CUDA outside its graph too), and passed in
        masks = decode_masks(self.stage, self.cache, self.column, self.pads, self.tables, rows)
        with self.comm.captured():
            return self._compiled(self.stage, self.cache, self.rotary, self.x[:rows], self.column, self.pads,
                                  self.tables, rows, length, masks)

    def _record(self, rows: int, length: int) -> Tape:
        """The collectives of the bucket's step, by one eager run of it (it writes the cache
        column that the compiled run then writes again, the same values)."""
        with self.comm.recording() as tape, self.comm.captured():
            decode_forward(self.stage, self.cache, self.rotary, self.x[:rows], self.column, self.pads, self.tables,
                           rows, length)
        return tuple(tape)

    def _make(self, rows: int, length: int) -> tuple[Callable[[], None], torch.Tensor, Tape]:
        side = torch.cuda.Stream(device=self.stage.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisations stay out of the graph
            self._forward(rows, length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with self.comm.recording() as tape, torch.cuda.graph(graph, pool=self._pool,
                                                             capture_error_mode="thread_local"):
            out = self._forward(rows, length)
        return graph.replay, out, tuple(tape)
