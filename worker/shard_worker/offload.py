"""Offload: lend a stage's streamed layers their projection weights, one forward pass at a time.

The plan (`RankPlan.offload`) names the layers this rank streams. Their projection matrices (the
rank's slices) never stay in the process: `prefetch` staging slots, one layer each, cycle through
them in forward order (every forward pass of the stage runs its layers in order), and a prefetch
thread fills the next free slot while the layers before it compute. A forward pass borrows the
slot of each streamed layer (`Streamer.lend`), waiting only if its load is not done (a stall,
measured), and gives it back when the layer is done, so the thread can fill it with the next one.

Where the weights come from:
- a CPU rank reads them from the checkpoint with `preadv` (the loader's `SliceReader`: exact byte
  ranges, converted to the runtime dtype when the checkpoint's differs) straight into the slot, so
  the page cache, not the process, holds the streamed layers;
- a GPU rank keeps its host-tier layers in pinned host memory (read once, at load) and reads its
  file-tier layers into a pinned buffer per slot; the thread then enqueues the copy into the slot
  on a side CUDA stream, which first waits for the compute stream to be done with the slot, and
  records an event the compute stream waits on before the layer runs. The host never waits for a
  copy, and the copies overlap the kernels of the layers before. Every pinned buffer of the rank
  is a view of one `PinnedArena` (pinned.py): exactly the bytes the plan counts, where torch's
  `pin_memory` would round each up to a power of two. `close` waits for the device before it
  frees them.

Counted per rank (`Accounting`): bytes streamed into slots and seconds spent streaming (CPU: the
thread's reads; GPU: host reads, plus each copy's bytes and duration on the side stream, timed by
CUDA events and counted once it has run); seconds the forward pass's thread waited for the
prefetch thread to deliver a slot (`stall_seconds`: a CPU rank's whole stall); and on a GPU the
seconds the compute stream waited for a slot's copy (`device_stall_seconds`, events on the compute
stream around its wait). Every event is counted by `Accounting.resolve`, so a generate's figures
are complete once its closing `snapshot` has waited for the device.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from shard_contract.plan import OffloadPlan

from .accounting import Accounting
from .loader import Checkpoint, Entry, LoadStats, SliceReader
from .model import PROJECTIONS, DecoderLayer, Stage
from .pinned import PinnedArena, arena_bytes

FREE, LOADING, READY, LENT = "free", "loading", "ready", "lent"


@dataclass
class Slot:
    """One layer's projections on the device, and (GPU) the pinned buffer files are read into."""

    weights: dict[str, torch.Tensor]
    pinned: dict[str, torch.Tensor] | None = None
    layer: int = -1
    state: str = FREE
    ready: Any = None  # CUDA: the latest copy into `weights` is done (an event per copy, timed later)
    free: Any = None  # CUDA: the compute stream is done with `weights`


class Streamer:
    def __init__(self, stage: Stage, plan: OffloadPlan, model_dir: str | Path, acct: Accounting):
        self.stage, self.plan, self.acct = stage, plan, acct
        self.device = stage.device
        self.cuda = self.device.type == "cuda"
        self.arena: PinnedArena | None = None  # GPU: every pinned buffer of the rank (`_pinned`)
        self.order = list(plan.layers)
        self.layers = {layer.index: layer for layer in stage.layers if layer.streamed}
        if sorted(self.layers) != sorted(self.order):
            raise ValueError(f"the plan streams layers {self.order}; this stage streams {sorted(self.layers)}")
        self.pieces = stage.streamed_pieces()
        checkpoint = Checkpoint(model_dir, stage.config)
        # Every entry up front: a checkpoint that lacks a streamed tensor fails the load, not a step.
        self.entries: dict[str, Entry] = {p.tensor: checkpoint.entry(p.tensor)
                                          for table in self.pieces.values() for ps in table.values() for p in ps}
        self.stats = LoadStats()
        self.reader = SliceReader(self.stats)
        shapes = {name: projection.shape for name, projection in next(iter(self.layers.values())).projections().items()}
        self.slots = [self._slot(shapes) for _ in range(plan.prefetch)]
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # GPU: host-tier layers, pinned
        if self.cuda:
            self.side = torch.cuda.Stream(self.device)
            for j in self.order:
                if j not in plan.file_layers:
                    self.host[j] = self._pinned(shapes)
                    self.read(j, self.host[j])
        self.nbytes = sum(t.numel() * t.element_size() for t in self.slots[0].weights.values()) * len(self.slots)
        self._cond = threading.Condition()
        self._next = 0  # position in `order` of the next layer to load
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def _slot(self, shapes: dict[str, tuple[int, int]]) -> Slot:
        # zeros: resident from the start, so what the rank measures after load is what it holds
        weights = {n: torch.zeros(s, dtype=self.stage.dtype, device=self.device) for n, s in shapes.items()}
        if not self.cuda:
            return Slot(weights)
        pinned = self._pinned(shapes) if self.plan.file_layers else None
        slot = Slot(weights, pinned, ready=torch.cuda.Event(enable_timing=True), free=torch.cuda.Event())
        slot.ready.record(torch.cuda.current_stream(self.device))  # nothing to wait for yet
        slot.free.record(torch.cuda.current_stream(self.device))
        return slot

    def _pinned(self, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """A layer's projections in pinned host memory (GPU): views of the rank's one arena, made
        on first use for all of them (`pinned_layers`)."""
        if self.arena is None:
            self.arena = PinnedArena(pinned_layers(self.plan) * arena_bytes(shapes.values(), self.stage.dtype))
        return {n: self.arena.take(s, self.stage.dtype) for n, s in shapes.items()}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Streamer":
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._drain()
        self.reader.__exit__()

    # ------------------------------------------------------------ the forward pass's side
    @contextmanager
    def lend(self, layer: DecoderLayer) -> Iterator[None]:
        """`layer` computes with its weights in a slot, for the duration of the block."""
        slot = self._acquire(layer.index)
        layer.borrow(slot.weights)
        if self.cuda:
            with self.acct.device_stall():  # events on the compute stream, around its wait for the copy
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
        try:
            yield
        finally:
            layer.borrow(None)
            if self.cuda:
                slot.free.record(torch.cuda.current_stream(self.device))
            with self._cond:
                slot.state = FREE
                self._cond.notify_all()

    def _acquire(self, j: int) -> Slot:
        start = time.perf_counter()
        waited = False
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"streaming layer weights failed: {self._error}") from self._error
                ready = [s for s in self.slots if s.layer == j and s.state == READY]
                if ready:
                    slot = ready[0]
                    break
                if not any(s.layer == j and s.state in (LOADING, READY) for s in self.slots):
                    # Out of the cycle's order (a forward pass ended early): drop what was loaded
                    # ahead and load from `j` on.
                    for s in self.slots:
                        if s.state == READY:
                            s.state = FREE
                    self._next = self.order.index(j)
                    self._cond.notify_all()
                self._cond.wait()
                waited = True
            slot.state = LENT
        if waited:
            self.acct.stalled(time.perf_counter() - start)
        return slot

    # ------------------------------------------------------------ the prefetch thread
    def _run(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # CUDA's current device is per thread
            while True:
                with self._cond:
                    while not self._stopped and not any(s.state == FREE for s in self.slots):
                        self._cond.wait()
                    if self._stopped:
                        return
                    slot = next(s for s in self.slots if s.state == FREE)
                    j = self.order[self._next]
                    self._next = (self._next + 1) % len(self.order)
                    slot.layer, slot.state = j, LOADING
                self._load(j, slot)
                with self._cond:
                    slot.state = READY
                    self._cond.notify_all()
        except BaseException as err:  # the forward pass that needs it raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _load(self, j: int, slot: Slot) -> None:
        if not self.cuda:
            start = time.perf_counter()
            self.read(j, slot.weights)
            self.acct.streamed(self._bytes(slot.weights), time.perf_counter() - start)
            return
        source = self.host.get(j)
        if source is None:  # files: into this slot's pinned buffer, once its last copy is done
            slot.ready.synchronize()
            start = time.perf_counter()
            self.read(j, slot.pinned)
            self.acct.streamed(0, time.perf_counter() - start)
            source = slot.pinned
        started, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side):
            self.side.wait_event(slot.free)
            started.record(self.side)
            for name, dst in slot.weights.items():
                dst.copy_(source[name], non_blocking=True)
            ready.record(self.side)
        slot.ready = ready  # read by the forward pass once the slot is READY (under the lock)
        self.acct.copied(self._bytes(slot.weights), started, ready)

    def read(self, j: int, into: dict[str, torch.Tensor]) -> None:
        """Layer `j`'s projections from the checkpoint into `into` (host tensors): what the prefetch
        thread does for a CPU rank or a file-tier layer (a benchmark times it alone)."""
        for name in PROJECTIONS:
            for piece in self.pieces[j][name]:
                self.reader.read(self.entries[piece.tensor], piece, into[name])

    def _drain(self) -> None:
        """GPU, on close: wait for every copy still in flight on the side stream (into the slots, out
        of the pinned buffers) and every kernel that reads a slot, then unpin and free the pinned
        buffers. A prefetch thread still running (stuck reading a file) could yet write into them:
        they are left to the process's exit then."""
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        if self.arena is not None and not self._thread.is_alive():
            self.host.clear()
            for slot in self.slots:
                slot.pinned = None
            self.arena.close()

    @staticmethod
    def _bytes(tensors: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())


def pinned_layers(plan: OffloadPlan) -> int:
    """How many layers' projections a GPU rank pins in host memory: each host-tier layer, and when
    it reads files, a buffer per slot (the planner's `host_bytes` less the page cache it counts)."""
    return len(plan.layers) - len(plan.file_layers) + (plan.prefetch if plan.file_layers else 0)

