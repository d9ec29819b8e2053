"""Read this rank's slices of a safetensors checkpoint straight into its tensors.

For each destination tensor the model's name-mapping table (`Stage.pieces()`) lists checkpoint
slices; the file that holds each tensor comes from `model.safetensors.index.json` (or the single
`model.safetensors`), so how the checkpoint is split into files does not matter.

Bytes are read with `os.preadv` at exact offsets into the destination tensor's memory, after
`posix_fadvise(RANDOM)` so the kernel reads no more than asked. The loader maps no file: slicing a
mapped file faults whole readahead windows in and inflates resident memory while loading. (Offload
does map the files, for the layers a CPU rank streams, a few layers at a time: `offload.py`.) Row
slices are one contiguous range. A column slice (row-parallel weights) is one range per row; many
rows go into one `preadv` (other ranks' columns land in a small scratch buffer), because one
syscall per row is several times slower.

Conversions leave nothing behind. When the checkpoint dtype differs from the runtime dtype, or
the weights are quantized to int8, or the tensor lives on a GPU, a bounded chunk of rows is read
into a staging area and converted (or quantized) on the CPU straight into the destination; a GPU
only ever receives same-dtype copies, so its caching allocator holds no conversion temporaries.
The staging area is one anonymous memory map for the whole load, unmapped at its end: heap
buffers of that size would stay in the process's heap after being freed. A GPU's copies go
through two pinned buffers in turn (`PinnedStaging`), so reading and converting one chunk overlaps
copying the previous one; a chunk already in the runtime dtype is read straight into one.

Only safetensors: pickle checkpoints (`.bin`, `.pt`) are refused, because unpickling runs code.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shard_contract.checkpoint import DTYPE_BYTES, CheckpointError, read_weights

from .config import ModelConfig
from .model import Stage
from .pinned import PinnedArena, aligned
from .quant import quantize_rows_
from .slices import Piece

TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
STAGING_BYTES = 4 * 2**20  # rows converted at once: two such buffers, and on a GPU two pinned ones
DIRECT_CHUNK_BYTES = 256 * 2**20  # Linux returns at most ~2 GiB per read call; stay well below
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True)
class Entry:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in its file

    @property
    def aligned(self) -> bool:
        """As `TensorInfo.aligned`: its data start at a multiple of its element size."""
        return self.offset % DTYPE_BYTES[self.dtype] == 0


@dataclass
class LoadStats:
    seconds: float = 0.0
    bytes_read: int = 0  # landed in this rank's tensors
    scratch_bytes: int = 0  # other ranks' columns read past in column slices
    files: int = 0


class Checkpoint:
    """Where every tensor lives: the contract's checked view of the index and the safetensors
    headers (files inside the model directory, byte ranges inside their files; no tensor data)."""

    def __init__(self, model_dir: str | Path, config: ModelConfig):
        self.dir, self.config = Path(model_dir), config
        weights = read_weights(self.dir)
        if weights is None:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self.weights = weights

    def entry(self, name: str) -> Entry:
        """The location of tensor `name`: present, with the shape config.json implies and a
        floating-point dtype."""
        info = self.weights.tensors.get(name)
        if info is None:
            files = ", ".join(sorted(self.weights.files))
            raise CheckpointError(f"{self.dir}: tensor {name} is missing from the checkpoint ({files})")
        path = self.weights.files[info.file]
        expected = self.config.tensor_shapes.get(name)
        if expected is not None and info.shape != list(expected):
            raise CheckpointError(f"{path}: tensor {name} has shape {info.shape}, config.json implies {expected}")
        if info.dtype not in TORCH_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info.dtype}; "
                                  f"expected a float dtype ({', '.join(TORCH_DTYPES)})")
        return Entry(name, path, info.dtype, tuple(info.shape), info.offset)


def load_stage(stage: Stage, model_dir: str | Path,
               progress: Callable[[int, int], None] | None = None) -> LoadStats:
    """Fill every tensor of `stage` from the checkpoint in `model_dir`; int8 projections are
    quantized as they are read, with the scales of whole checkpoint rows. `progress(loaded,
    total)` after each tensor (bytes of this rank's tensors filled so far, and in all)."""
    start = time.perf_counter()
    checkpoint = Checkpoint(model_dir, stage.config)
    table, tensors = stage.pieces(), stage.tensors()
    scales = {name: tensors[name.removesuffix("weight") + "scale"] for name in table
              if name.endswith(".weight") and name.removesuffix("weight") + "scale" in tensors}
    assert table.keys() | {n.removesuffix("weight") + "scale" for n in scales} == tensors.keys(), \
        "the name-mapping table must cover every tensor exactly"
    entries = {p.tensor: checkpoint.entry(p.tensor) for pieces in table.values() for p in pieces}
    stats = LoadStats()
    pinned = PinnedStaging(STAGING_BYTES) if stage.device.type == "cuda" else None
    total, loaded = sum(t.numel() * t.element_size() for t in tensors.values()), 0
    with SliceReader(stats, pinned) as reader:
        for name, pieces in table.items():
            dst = tensors[name]
            covered = 0
            for piece in pieces:
                covered = max(covered, reader.read(entries[piece.tensor], piece, dst, scales.get(name)))
            if covered < dst.shape[0]:
                dst[covered:].zero_()  # vocabulary padding of the last rank
            # its scales too
            loaded += sum(t.numel() * t.element_size() for t in (dst, scales.get(name)) if t is not None)
            if progress is not None:
                progress(loaded, total)
    stats.seconds = time.perf_counter() - start
    return stats


def _memory(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (works for bf16, unlike .numpy())."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class Staging:
    """Two buffers of STAGING_BYTES in one anonymous memory map, made on first use and unmapped by
    `close`: `raw` (bytes as read) and `work` (float32 rows being quantized)."""

    KINDS = ("raw", "work")

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, kind: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, width] tensor of `dtype` over the `kind` buffer (rows * width must fit)."""
        if self._map is None:
            self._map = mmap.mmap(-1, len(self.KINDS) * STAGING_BYTES)
            whole = torch.frombuffer(self._map, dtype=torch.uint8)
            self._buffers = {k: whole[i * STAGING_BYTES:(i + 1) * STAGING_BYTES] for i, k in enumerate(self.KINDS)}
        nbytes = rows * width * dtype.itemsize
        assert nbytes <= STAGING_BYTES, (kind, rows, width, dtype)
        return self._buffers[kind][:nbytes].view(dtype).view(rows, width)

    def close(self) -> None:
        self._buffers.clear()
        if self._map is not None:
            try:
                self._map.close()  # every view is gone: the pages go back to the kernel
            except BufferError:  # a view lives on in an error's traceback: unmapped when it goes
                pass
            self._map = None


class PinnedStaging:
    """Two pinned host buffers used in turn to copy rows to a GPU, already in the destination's
    dtype: the next chunk is read (and converted) into one while the other's copy runs
    (`non_blocking`), and a buffer is reused only once its last copy is done (a CUDA event).
    Instead of a pageable source, which CUDA would stage through pinned memory of its own and
    wait for."""

    def __init__(self, nbytes: int, pinned: bool = True, event: Callable[[], Any] | None = None):
        self.nbytes = nbytes
        # Not pin_memory: torch would keep the pinned blocks in its cache after the load.
        self.arena = PinnedArena(2 * aligned(nbytes), pin=pinned)
        self.buffers = [self.arena.take((nbytes,), torch.uint8) for _ in range(2)]
        self.copies: list[Any] = [None, None]  # the event after each buffer's latest copy
        self.turn = 0
        self.event = event or torch.cuda.Event

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This turn's buffer as a `shape` tensor of `dtype`, once its previous copy has finished."""
        if self.copies[self.turn] is not None:
            self.copies[self.turn].synchronize()
            self.copies[self.turn] = None
        nbytes = math.prod(shape) * dtype.itemsize
        assert nbytes <= self.nbytes, (shape, dtype)
        return self.buffers[self.turn][:nbytes].view(dtype).view(shape)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy this turn's buffer `src` into `dst` asynchronously; the next turn uses the other."""
        dst.copy_(src, non_blocking=True)
        self.copies[self.turn] = self.event()
        self.copies[self.turn].record()
        self.turn ^= 1

    def finish(self) -> None:
        for i, copy in enumerate(self.copies):
            if copy is not None:
                copy.synchronize()
                self.copies[i] = None

    def close(self) -> None:
        """Every copy done, the buffers unpinned and given back."""
        self.finish()
        self.buffers = []
        self.arena.close()


class SliceReader:
    def __init__(self, stats: LoadStats, pinned: PinnedStaging | None = None):
        """`pinned`: the destinations are on a GPU, and every delivery goes through these buffers
        (the reader closes them at its end)."""
        self.stats, self.pinned = stats, pinned
        self._fds: dict[Path, int] = {}
        self._scratch: bytearray = bytearray()
        self._staging = Staging()
        # a chunk of rows fits each staging buffer, the mapped ones and the pinned ones
        self._chunk_bytes = min(STAGING_BYTES, pinned.nbytes) if pinned else STAGING_BYTES

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *_: object) -> None:
        if self.pinned is not None:
            self.pinned.close()  # every copy has landed before the weights are used; unpinned
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._staging.close()

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            fd = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead beyond our ranges
            self._fds[path] = fd
            self.stats.files += 1
        return self._fds[path]

    def read(self, entry: Entry, piece: Piece, dst: torch.Tensor, scale: torch.Tensor | None = None) -> int:
        """Copy `piece` of `entry` into `dst` from row `piece.offset` (int8 `dst`: quantized, its
        rows' scales into `scale`); returns the row after it."""
        rows_total = entry.shape[0]
        cols = entry.shape[1] if len(entry.shape) == 2 else 1
        if piece.dim == 1 and (piece.start, piece.stop) == (0, cols):  # every column: one contiguous range
            piece = Piece(piece.tensor, 0, 0, rows_total, piece.offset)
        if piece.dim == 0:
            out_rows, width = piece.stop - piece.start, cols
        else:
            out_rows, width = rows_total, piece.stop - piece.start
        region = dst[piece.offset:piece.offset + out_rows]
        if region.numel() != out_rows * width or (dst.dim() == 2 and dst.shape[1] != width):
            raise CheckpointError(f"{entry.path}: tensor {entry.name}: slice {piece} does not fit the "
                                  f"destination of shape {list(dst.shape)}")
        region = region.view(out_rows, width)
        if scale is not None:
            self._quantize(entry, piece, region, scale[piece.offset:piece.offset + out_rows], cols)
            return piece.offset + out_rows
        src_dtype = TORCH_DTYPES[entry.dtype]
        item = DTYPE_BYTES[entry.dtype]
        # Rows land in the destination itself (CPU, same dtype), in a pinned buffer (GPU, same
        # dtype), or in the staging area to be converted.
        direct = (self.pinned is None and region.device.type == "cpu" and region.dtype == src_dtype
                  and region.is_contiguous())
        pinned = self.pinned if region.dtype == src_dtype else None
        limit = DIRECT_CHUNK_BYTES if direct else self._chunk_bytes // max(item, region.element_size())
        chunk = max(1, limit // max(1, width * (item if direct else 1)))
        if piece.dim == 1:
            chunk = min(chunk, (IOV_MAX + 1) // 2)
        fd = self._fd(entry.path)
        for a in range(0, out_rows, chunk):
            b = min(out_rows, a + chunk)
            if direct:
                target = region[a:b]
            elif pinned is not None:
                target = pinned.buffer((b - a, width), src_dtype)
            else:
                target = self._staging.get("raw", b - a, width, src_dtype)
            self._read_rows(fd, entry, piece, a, b, cols, item, target)
            if pinned is not None:
                pinned.copy(target, region[a:b])
            elif not direct:
                self._deliver(region[a:b], target)
        return piece.offset + out_rows

    def _quantize(self, entry: Entry, piece: Piece, region: torch.Tensor, scale: torch.Tensor, cols: int) -> None:
        """int8 rows of the piece with the scales of whole checkpoint rows: a column slice
        (row-parallel weights) reads its rows whole, so every TP degree quantizes alike."""
        src_dtype, item = TORCH_DTYPES[entry.dtype], DTYPE_BYTES[entry.dtype]
        first = piece.start if piece.dim == 0 else 0
        c0, c1 = (0, cols) if piece.dim == 0 else (piece.start, piece.stop)
        whole_rows = Piece(piece.tensor, 0, first, first + region.shape[0])
        chunk = max(1, self._chunk_bytes // (cols * 4))
        fd = self._fd(entry.path)
        for a in range(0, region.shape[0], chunk):
            b = min(region.shape[0], a + chunk)
            raw = self._staging.get("raw", b - a, cols, src_dtype)
            self._read_rows(fd, entry, whole_rows, a, b, cols, item, raw)
            work = raw if src_dtype == torch.float32 else self._staging.get("work", b - a, cols,
                                                                            torch.float32).copy_(raw)
            self._deliver(scale[a:b], quantize_rows_(work))
            self._deliver(region[a:b], work[:, c0:c1])
        self.stats.scratch_bytes += region.shape[0] * (cols - (c1 - c0)) * item

    def _deliver(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src (CPU), converting on the CPU: a GPU destination gets a same-dtype copy from a
        pinned buffer."""
        if self.pinned is None:
            dst.copy_(src)
        else:
            self.pinned.copy(self.pinned.buffer(tuple(src.shape), dst.dtype).copy_(src), dst)

    def _read_rows(self, fd: int, entry: Entry, piece: Piece, a: int, b: int, cols: int, item: int,
                   target: torch.Tensor) -> None:
        """Output rows [a, b) of the piece into `target` ([b - a, width], checkpoint dtype)."""
        mem = _memory(target)
        if piece.dim == 0:
            offset = entry.offset + (piece.start + a) * cols * item
            buffers = [mem]
        else:
            width = (piece.stop - piece.start) * item
            gap = cols * item - width
            if len(self._scratch) < gap:
                self._scratch = bytearray(gap)
            scratch = memoryview(self._scratch)[:gap]
            offset = entry.offset + (a * cols + piece.start) * item
            buffers = []
            for i in range(b - a):
                buffers.append(mem[i * width:(i + 1) * width])
                if i < b - a - 1 and gap:
                    buffers.append(scratch)
            self.stats.scratch_bytes += gap * (b - a - 1)
        _read_exact(fd, buffers, offset, entry)
        self.stats.bytes_read += mem.nbytes


def _read_exact(fd: int, buffers: list[memoryview], offset: int, entry: Entry) -> None:
    while buffers:
        got = os.preadv(fd, buffers, offset)
        if got == 0:
            raise CheckpointError(f"{entry.path}: tensor {entry.name}: truncated file "
                                  f"(no data at byte {offset})")
        offset += got
        while buffers and got >= len(buffers[0]):  # drop what is filled, keep the rest
            got -= len(buffers[0])
            buffers.pop(0)
        if got:
            buffers[0] = buffers[0][got:]
