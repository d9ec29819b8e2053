"""Offload: lend a stage's streamed layers their projection weights, one forward pass at a time.

The plan (`RankPlan.offload`) names the layers this rank streams. Their projection matrices (the
rank's slices) never stay in the process: `prefetch` slots, one layer each, cycle through them in
forward order (every forward pass of the stage runs its layers in order), and a prefetch thread
fetches the next layer into the next free slot while the layers before it compute. A forward pass
borrows the slot of each streamed layer (`Streamer.lend`), waiting only if its fetch is not done
(a stall, measured), and gives it back when the layer is done, so the thread can take the next.

Where the weights come from:
- a CPU rank computes on the checkpoint file itself, mapped read-only (`FileMaps`): each slice
  is a view of the mapped tensor (rows; a row-parallel column slice is a strided view, which the
  kernels take at full speed), so nothing is copied when the page cache holds the file. Fetching a
  layer maps its pages into the process (`MADV_POPULATE_READ`: a cold file is read from disk
  then, on the prefetch thread) and unmaps those of the layer the slot held before
  (`MADV_DONTNEED`; the page cache keeps them), so the rank maps `prefetch` layers at most: its
  resident set stays its plan, not the model. A tensor whose checkpoint dtype is not the runtime's,
  or whose data is not aligned to its element size (no standard writer does that), is copied
  instead: read with `preadv` (the loader's `SliceReader`, converting) into the slot's staging
  buffer, the only memory a CPU slot allocates;
- a GPU rank keeps its host-tier layers in pinned host memory (read once, at load) and reads its
  file-tier layers into a pinned buffer per slot; the thread then enqueues the copy into the slot
  on a side CUDA stream, which first waits for the compute stream to be done with the slot, and
  records an event the compute stream waits on before the layer runs. The host never waits for a
  copy, and the copies overlap the kernels of the layers before. Every pinned buffer of the rank
  is a view of one `PinnedArena` (pinned.py): exactly the bytes the plan counts, where torch's
  `pin_memory` would round each up to a power of two. `close` waits for the device before it
  frees them.

Counted per rank (`Accounting`): bytes streamed (a layer's slices, each time it is fetched, mapped
or copied) and seconds spent fetching (CPU: the thread's mapping and reads; GPU: host reads, plus
each copy's bytes and duration on the side stream, timed by CUDA events and counted once it has
run); seconds the forward pass's thread waited for the prefetch thread to deliver a slot
(`stall_seconds`: a CPU rank's whole stall); and on a GPU the seconds the compute stream waited
for a slot's copy (`device_stall_seconds`, events on the compute stream around its wait). Every
event is counted by `Accounting.resolve`, so a generate's figures are complete once its closing
`snapshot` has waited for the device.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from shard_contract.plan import OffloadPlan

from ..telemetry.accounting import Accounting
from .decoder import DecoderLayer
from .loader import TORCH_DTYPES, Checkpoint, Entry, LoadStats, SliceReader
from .model import Stage
from .pinned import PinnedArena, arena_bytes
from .slices import PROJECTIONS, Piece

FREE, LOADING, READY, LENT = "free", "loading", "ready", "lent"
PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python names it from 3.13 on


def _libc_madvise() -> Any:
    """madvise(2) through ctypes, which lets go of the GIL while it runs (the mmap module's method
    holds it: populating a cold layer would stall the forward pass); None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise if hasattr(mmap, "MADV_DONTNEED") else None
    except (OSError, AttributeError):
        return None


_MADVISE = _libc_madvise()
Span = tuple[Path, int, int]  # a file's bytes [start, stop)


class FileMaps:
    """The checkpoint files a CPU rank streams from, each mapped read-only once (a write through a
    view would fault): views of their tensors, and their pages mapped into the process or out."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._bytes: dict[Path, torch.Tensor] = {}
        self._populate = _MADVISE is not None  # until the kernel says it has no POPULATE_READ

    def tensor(self, entry: Entry) -> torch.Tensor:
        """The whole tensor `entry`, a view of its file (its data aligned to its element size)."""
        if entry.path not in self._maps:
            with open(entry.path, "rb") as fh:
                self._maps[entry.path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():  # "not writable": meant, nothing writes weights
                warnings.simplefilter("ignore", UserWarning)
                self._bytes[entry.path] = torch.frombuffer(self._maps[entry.path], dtype=torch.uint8)
        nbytes = math.prod(entry.shape) * TORCH_DTYPES[entry.dtype].itemsize
        return self._bytes[entry.path][entry.offset:entry.offset + nbytes].view(TORCH_DTYPES[entry.dtype]) \
            .view(entry.shape)

    def populate(self, spans: list[Span]) -> None:
        """Map the spans' pages into the process, reading what the page cache lacks."""
        for path, a, b in self._pages(spans):
            if self._populate:
                error = self._advise(path, a, b, MADV_POPULATE_READ)
                if error == 0:
                    continue
                if error != errno.EINVAL:  # the file could not be read (EFAULT, EIO)
                    raise OSError(error, f"{path}: reading bytes [{a}, {b}) into memory: {os.strerror(error)}")
                self._populate = False  # a kernel before 5.14: read ahead, then touch a byte of every page
            if _MADVISE is not None:
                self._advise(path, a, b, mmap.MADV_WILLNEED)
            int(self._bytes[path][a:b:PAGE].sum())

    def drop(self, spans: list[Span]) -> None:
        """Unmap the spans' pages from the process (the page cache keeps them)."""
        if _MADVISE is not None:
            for path, a, b in self._pages(spans):
                self._advise(path, a, b, mmap.MADV_DONTNEED)

    def _pages(self, spans: list[Span]) -> list[Span]:
        """The spans widened to whole pages (within the file), those that touch merged."""
        merged: list[Span] = []
        for path, a, b in sorted(spans):
            a, b = a // PAGE * PAGE, min(-(-b // PAGE) * PAGE, len(self._maps[path]))
            if merged and merged[-1][0] == path and a <= merged[-1][2]:
                merged[-1] = (path, merged[-1][1], max(b, merged[-1][2]))
            else:
                merged.append((path, a, b))
        return merged

    def _advise(self, path: Path, a: int, b: int, advice: int) -> int:
        """madvise of the file's bytes [a, b) (whole pages): 0, or the error number."""
        return 0 if _MADVISE(self._bytes[path].data_ptr() + a, b - a, advice) == 0 else ctypes.get_errno()

    def close(self) -> None:
        self._bytes.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a view lives on (in an error's traceback): unmapped when it goes
                pass
        self._maps.clear()



@dataclass(frozen=True)
class Part:
    """One checkpoint slice of a streamed projection (a row block of it): a view of the mapped
    file (`view`, its bytes `span`), or else copied into the slot's staging buffer."""

    entry: Entry
    piece: Piece
    shape: tuple[int, int]  # rows x columns
    nbytes: int  # in the runtime dtype
    view: torch.Tensor | None = None
    span: Span | None = None


def in_place(entry: Entry, dtype: torch.dtype) -> bool:
    """Whether a CPU rank computes on `entry` where the file holds it: stored in the runtime dtype,
    its data aligned to its element size (the planner's rule too: sizing.layer_copied_bytes)."""
    return TORCH_DTYPES[entry.dtype] == dtype and entry.aligned


@dataclass
class Slot:
    """One layer's projections: on a GPU, device buffers and (file tier) the pinned buffers files
    are read into; on a CPU, what the layer borrows (views of the mapped file, and the parts
    copied into `staging`)."""

    weights: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]
    pinned: dict[str, torch.Tensor] | None = None
    staging: torch.Tensor | None = None  # CPU: bytes for the parts that are copied
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
        self.maps = FileMaps()
        shapes = {name: projection.shape for name, projection in next(iter(self.layers.values())).projections().items()}
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # GPU: host-tier layers, pinned
        try:
            if self.cuda:
                self.slots = [self._cuda_slot(shapes) for _ in range(plan.prefetch)]
                self.side = torch.cuda.Stream(self.device)
                for j in self.order:
                    if j not in plan.file_layers:
                        self.host[j] = self._pinned(shapes)
                        self.read(j, self.host[j])
                self.nbytes = self._bytes(self.slots[0].weights) * len(self.slots)
            else:
                self.parts = {j: {name: [self._part(p) for p in self.pieces[j][name]] for name in PROJECTIONS}
                              for j in self.order}
                copied = max(sum(p.nbytes for ps in self.parts[j].values() for p in ps if p.view is None)
                             for j in self.order)
                # zeros: resident from the start, so what the rank measures after load is what it holds
                self.slots = [Slot({}, staging=torch.zeros(copied, dtype=torch.uint8) if copied else None)
                              for _ in range(plan.prefetch)]
                self.nbytes = copied * len(self.slots)
        except BaseException:
            self.maps.close()
            raise
        self._cond = threading.Condition()
        self._next = 0  # position in `order` of the next layer to load
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def _part(self, piece: Piece) -> Part:
        """A CPU rank's slice `piece`: in place when it can be (see `in_place`)."""
        entry = self.entries[piece.tensor]
        rows, cols = entry.shape[0], entry.shape[1] if len(entry.shape) == 2 else 1
        shape = (piece.stop - piece.start, cols) if piece.dim == 0 else (rows, piece.stop - piece.start)
        nbytes = shape[0] * shape[1] * self.stage.dtype.itemsize
        if not in_place(entry, self.stage.dtype):
            return Part(entry, piece, shape, nbytes)
        whole = self.maps.tensor(entry).view(rows, cols)
        item = whole.element_size()
        if piece.dim == 0:
            view = whole[piece.start:piece.stop]
            span = (entry.path, entry.offset + piece.start * cols * item, entry.offset + piece.stop * cols * item)
        else:  # a column slice: every row's part of the span is this rank's
            view = whole[:, piece.start:piece.stop]
            span = (entry.path, entry.offset + piece.start * item,
                    entry.offset + ((rows - 1) * cols + piece.stop) * item)
        return Part(entry, piece, shape, nbytes, view, span)

    def _cuda_slot(self, shapes: dict[str, tuple[int, int]]) -> Slot:
        # zeros: resident from the start, so what the rank measures after load is what it holds
        weights: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {
            n: torch.zeros(s, dtype=self.stage.dtype, device=self.device) for n, s in shapes.items()}
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
    def start(self) -> Streamer:
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
        self.parts = {}
        for slot in self.slots:
            slot.weights = {}
        self.maps.close()

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
                    # the layer it held goes out of the process, unless another slot holds it too
                    stale = slot.layer if not any(s is not slot and s.layer == slot.layer and s.state != FREE
                                                  for s in self.slots) else None
                    slot.layer, slot.state = j, LOADING
                self._load(j, slot, stale)
                with self._cond:
                    slot.state = READY
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 -- the forward pass that needs it raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _load(self, j: int, slot: Slot, stale: int | None) -> None:
        if not self.cuda:
            self.fetch(j, slot, stale)
            return
        source = self.host.get(j)
        if source is None:  # files: into this slot's pinned buffer, once its last copy is done
            assert slot.pinned is not None, "a GPU slot of a rank that reads files has its pinned buffer"
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
                assert isinstance(dst, torch.Tensor)  # a GPU slot holds whole tensors
                dst.copy_(source[name], non_blocking=True)
            ready.record(self.side)
        slot.ready = ready  # read by the forward pass once the slot is READY (under the lock)
        self.acct.copied(self._bytes(slot.weights), started, ready)

    def fetch(self, j: int, slot: Slot, stale: int | None = None) -> None:
        """What the prefetch thread does for a CPU rank (a benchmark times it alone): layer `j`'s
        weights into `slot`, its mapped pages into the process and those of layer `stale` (what
        the slot held) out, and the parts that are not read in place copied into the staging."""
        start = time.perf_counter()
        if stale is not None and stale >= 0 and stale != j:
            self.maps.drop([p.span for ps in self.parts[stale].values() for p in ps if p.span])
        self.maps.populate([p.span for ps in self.parts[j].values() for p in ps if p.span])
        weights: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        at = 0
        for name, parts in self.parts[j].items():
            blocks = []
            for part in parts:
                block = part.view
                if block is None:
                    assert slot.staging is not None, "a CPU slot has staging for the parts it copies"
                    block = slot.staging[at:at + part.nbytes].view(self.stage.dtype).view(part.shape)
                    self.reader.read(part.entry, replace(part.piece, offset=0), block)
                    at += part.nbytes
                blocks.append(block)
            weights[name] = blocks[0] if len(blocks) == 1 else tuple(blocks)
        slot.weights = weights
        self.acct.streamed(sum(p.nbytes for ps in self.parts[j].values() for p in ps), time.perf_counter() - start)

    def read(self, j: int, into: dict[str, torch.Tensor]) -> None:
        """Layer `j`'s projections from the checkpoint into `into` (pinned host tensors of a GPU
        rank: its host tier, or a file-tier layer's bounce buffers)."""
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
    def _bytes(tensors: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> int:
        return sum(p.numel() * p.element_size()
                   for t in tensors.values() for p in (t if isinstance(t, tuple) else (t,)))


def pinned_layers(plan: OffloadPlan) -> int:
    """How many layers' projections a GPU rank pins in host memory: each host-tier layer, and when
    it reads files, a buffer per slot (the planner's `host_bytes` less the page cache it counts)."""
    return len(plan.layers) - len(plan.file_layers) + (plan.prefetch if plan.file_layers else 0)

