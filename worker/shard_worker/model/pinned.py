"""Pinned host memory of exactly the bytes asked for, for a GPU rank's host-to-device copies.

Why not `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds every pinned
allocation up to the next power of two before it asks CUDA for it (`PowerOf2Ceil` in
ATen/core/CachingHostAllocator.h; `torch.cuda.host_memory_stats` says so too), and keeps a freed
block pinned, in its cache, for the life of the process. A layer's projections of 1.1x a power of
two would pin 1.8x their bytes, and a pod would hold up to twice the host memory its plan asks for.

A `PinnedArena` is one anonymous private memory map of the bytes asked for (whole pages), pinned by
registering it with CUDA (`cudaHostRegister`, through torch's own binding `torch.cuda.cudart()`, as
torch.distributed's checkpoint stager pins its buffers), and carved into views, each aligned to
`ALIGN` bytes. Copies from a registered range are asynchronous DMA, as from `cudaHostAlloc`'s
memory. `close` unregisters the range and unmaps it, which gives the memory back to the kernel:
its owner must first wait for every copy from or into it (`torch.cuda.synchronize`).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable
from typing import Any

import torch

ALIGN = 256  # bytes: where each view starts (cudaMalloc's alignment; a multiple of every dtype's size)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def arena_bytes(shapes: Iterable[tuple[int, ...]], dtype: torch.dtype) -> int:
    """The bytes an arena needs for one tensor of `dtype` per shape (each view aligned)."""
    return sum(aligned(math.prod(shape) * dtype.itemsize) for shape in shapes)


class PinnedArena:
    def __init__(self, nbytes: int, pin: bool = True, cudart: Any = None):
        """`nbytes` of host memory, pinned unless `pin` is false (tests on machines without CUDA);
        `cudart`: the CUDA runtime binding (default `torch.cuda.cudart()`)."""
        self.nbytes = nbytes
        self._cudart = (cudart or torch.cuda.cudart()) if pin and nbytes else None
        self._map: mmap.mmap | None = None
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._at = 0  # the next free byte
        self._registered = False
        if nbytes == 0:
            return
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_DONTFORK"):  # a child process must not share (copy on write) pages CUDA reads
            self._map.madvise(mmap.MADV_DONTFORK)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        if self._cudart is not None:
            self._check(self._cudart.cudaHostRegister(self._bytes.data_ptr(), nbytes, 0), "cudaHostRegister")
            self._registered = True

    @property
    def used(self) -> int:
        """Bytes taken so far (with the views' alignment)."""
        return self._at

    @property
    def closed(self) -> bool:
        return self._map is None and not self._registered

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new `shape` tensor of `dtype` in the arena (its contents undefined: zeros at first)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._at + nbytes > self.nbytes:
            raise ValueError(f"a pinned arena of {self.nbytes} bytes has {self.nbytes - self._at} left, "
                             f"not the {nbytes} asked for")
        view = self._bytes[self._at:self._at + nbytes].view(dtype).view(shape)
        self._at = min(self.nbytes, aligned(self._at + nbytes))
        return view

    def close(self) -> None:
        """Unpin and unmap. Every copy from or into the arena must be done (the caller waits)."""
        if self._registered and self._cudart is not None:
            self._registered = False
            self._check(self._cudart.cudaHostUnregister(self._bytes.data_ptr()), "cudaHostUnregister")
        self._bytes = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            try:
                self._map.close()  # no view is left: the pages go back to the kernel
            except BufferError:  # a view lives on (in an error's traceback): unmapped when it goes
                pass
            self._map = None

    def _check(self, error: Any, call: str) -> None:
        code = int(error)
        if code != 0 and self._cudart is not None:
            raise RuntimeError(f"{call} of {self.nbytes} bytes of host memory failed: CUDA error {code} "
                               f"({self._cudart.cudaGetErrorString(error)})")
