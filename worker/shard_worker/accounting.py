"""What one rank spends: communication bytes and seconds per operation, compute and idle seconds,
and resident memory read from the kernel (and CUDA's allocator on a GPU).

Counters are plain floats bumped around each collective with `perf_counter` (tens of nanoseconds),
so they stay on in production; the metrics families of `metrics.py` are filled from them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

COMM_OPS = ("all_reduce", "all_gather", "send", "recv", "broadcast", "gather")


@dataclass
class Counters:
    comm_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMM_OPS, 0))
    comm_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMM_OPS, 0.0))
    compute_seconds: float = 0.0
    idle_seconds: float = 0.0  # blocked in recv: waiting for another pipeline stage

    @property
    def comm_total(self) -> float:
        return sum(self.comm_seconds.values())

    def copy(self) -> "Counters":
        return Counters(dict(self.comm_bytes), dict(self.comm_seconds), self.compute_seconds, self.idle_seconds)

    def minus(self, earlier: "Counters") -> "Counters":
        return Counters({k: v - earlier.comm_bytes[k] for k, v in self.comm_bytes.items()},
                        {k: v - earlier.comm_seconds[k] for k, v in self.comm_seconds.items()},
                        self.compute_seconds - earlier.compute_seconds,
                        self.idle_seconds - earlier.idle_seconds)

    def summary(self) -> dict[str, float]:
        return {"comm_seconds": self.comm_total, "compute_seconds": self.compute_seconds,
                "idle_seconds": self.idle_seconds, "comm_bytes": sum(self.comm_bytes.values())}


class Accounting:
    def __init__(self) -> None:
        self.counters = Counters()

    def comm(self, op: str, nbytes: int, seconds: float) -> None:
        self.counters.comm_bytes[op] += nbytes
        self.counters.comm_seconds[op] += seconds

    def idle(self, seconds: float) -> None:
        self.counters.idle_seconds += seconds

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Time a region as compute, less what it spent communicating or waiting inside."""
        c = self.counters
        start, waited = time.perf_counter(), c.comm_total + c.idle_seconds
        try:
            yield
        finally:
            c.compute_seconds += time.perf_counter() - start - (c.comm_total + c.idle_seconds - waited)


# ---------------------------------------------------------------- memory
_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def proc_status(path: str = "/proc/self/status") -> dict[str, int]:
    """Resident set figures of this process in bytes (Linux): VmRSS, VmHWM (peak), RssAnon, RssFile."""
    values = dict.fromkeys(_STATUS_FIELDS, 0)
    try:
        with open(path) as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


@dataclass(frozen=True)
class MemorySample:
    rss: int
    rss_anon: int
    peak_rss: int
    cuda_allocated: int = 0
    cuda_reserved: int = 0

    @classmethod
    def take(cls, device=None) -> "MemorySample":
        status = proc_status()
        allocated = reserved = 0
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return cls(rss=status["VmRSS"], rss_anon=status["RssAnon"], peak_rss=status["VmHWM"],
                   cuda_allocated=allocated, cuda_reserved=reserved)

    def held(self, on_cuda: bool) -> int:
        """The bytes that grow with what the rank allocates: what CUDA's caching allocator
        reserved on the device (what the device really gives up), or anonymous memory."""
        return self.cuda_reserved if on_cuda else self.rss_anon
