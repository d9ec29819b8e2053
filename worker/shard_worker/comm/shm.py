"""Small-tensor collectives of the TP ranks of one machine through shared memory.

A decode step makes two all-reduces per layer of a few KB each; over gloo each costs a socket
round trip through gloo's threads (0.2-2 ms on a loaded 2-core machine). Here each rank copies its
part into its own slot of a shared buffer and publishes a round number; every rank waits until all
ranks have published the round, then adds the slots in rank order (the same bits on every rank).

Two slot sets alternate by round: a rank cannot start round r+2 (and overwrite its round-r slot)
before every rank has published round r+1, which each does only after reading round r. Stores are
made visible in program order (x86-64's TSO): the slot is written before the round number, and
read after it. Other architectures keep gloo. Where the decode kernels' extension is built, an
all-reduce of float32 or bfloat16 is one call into it (`_gemv.shm_all_reduce`: the copy, the
waits with the GIL released, the sum), a few microseconds where torch's indexing took tens.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

import torch

try:  # the decode kernels' extension runs an all-reduce round in one call (same protocol, same bits)
    from .. import _gemv
except ImportError:
    _gemv = None  # type: ignore[assignment]  # built without a compiler: torch's path

SLOT_BYTES = 64 * 1024  # the largest message handled here (a decode step's hidden state and logits)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # what _gemv.shm_all_reduce sums
FLAG_STRIDE = 8  # int64s between two ranks' round numbers: one cache line each
SPINS_BEFORE_YIELD = 200


SHM_DIR = "/dev/shm"  # shared by the processes of a machine, or of a pod


def supported(directory: str = SHM_DIR) -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir(directory)


class ShmGroup:
    def __init__(self, path: str, size: int, rank: int, timeout: float):
        self.size, self.rank, self.timeout = size, rank, timeout
        total = 2 * size * SLOT_BYTES + size * FLAG_STRIDE * 8
        self.buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.slots = self.buf[:2 * size * SLOT_BYTES].view(2, size, SLOT_BYTES)
        self.flags = self.buf[2 * size * SLOT_BYTES:].view(torch.int64)
        self.round = 0

    @staticmethod
    def create(size: int, directory: str = SHM_DIR) -> str:
        """A fresh zeroed buffer for `size` ranks; returns its path (for the other ranks)."""
        fd, path = tempfile.mkstemp(prefix="shard-tp-", dir=directory)
        os.ftruncate(fd, 2 * size * SLOT_BYTES + size * FLAG_STRIDE * 8)
        os.close(fd)
        return path

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= SLOT_BYTES

    def _publish_and_wait(self, t: torch.Tensor) -> torch.Tensor:
        """Publish `t`; return the slots of this round, [size, nbytes] bytes, once all are in."""
        self.round += 1
        nbytes = t.numel() * t.element_size()
        slots = self.slots[self.round % 2, :, :nbytes]
        slots[self.rank].copy_(t.contiguous().view(-1).view(torch.uint8))
        self.flags[self.rank * FLAG_STRIDE] = self.round
        for peer in range(self.size):
            spins, deadline = 0, None
            while int(self.flags[peer * FLAG_STRIDE]) < self.round:
                spins += 1
                if spins % SPINS_BEFORE_YIELD == 0:
                    os.sched_yield()  # let a peer sharing this core run
                    deadline = deadline or time.monotonic() + self.timeout
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"TP rank {peer} did not reach collective round {self.round} "
                                           f"within {self.timeout:.0f}s")
        return slots

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` in place over the group's ranks."""
        if _gemv is not None and t.dtype in _DTYPES and t.is_contiguous():  # the same round, in one C call
            self.round += 1
            missed = _gemv.shm_all_reduce(_DTYPES[t.dtype], t.data_ptr(), t.numel(), self.slots.data_ptr(), SLOT_BYTES,
                                          self.flags.data_ptr(), FLAG_STRIDE, self.size, self.rank, self.round,
                                          self.timeout)
            if missed >= 0:
                raise TimeoutError(f"TP rank {missed} did not reach collective round {self.round} "
                                   f"within {self.timeout:.0f}s")
            return
        parts = self._publish_and_wait(t).view(t.dtype).view(self.size, *t.shape)
        if self.size == 2:
            torch.add(parts[0], parts[1], out=t)
        else:
            torch.sum(parts, dim=0, out=t)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dimension (a copy: slots are reused)."""
        parts = self._publish_and_wait(t).view(t.dtype).view(self.size, *t.shape)
        return torch.cat(parts.unbind(0), dim=-1)
