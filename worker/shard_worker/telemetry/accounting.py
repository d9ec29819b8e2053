"""What one rank spends: communication bytes and seconds per operation, compute and idle seconds,
and resident memory read from the kernel (and CUDA on a GPU).

Each timed region is a span between two marks of a clock. Host work (CPU tensors, gloo's control
messages) is timed with `perf_counter` and counted at once. On a GPU the model's kernels and
NCCL's collectives are asynchronous: the host returns long before the device is done, so they are
timed with CUDA events recorded on the current stream, and a span is counted once both of its
events have run, in stream order: the thread that records them counts what has run whenever it
closes a span (`resolve`), and `snapshot` waits for the device first. Other threads (heartbeat,
metrics) only read `counters`: CUDA's current device is per thread, so they never touch events.
Compute is a `computing` span less the communication and waiting inside it. The metrics families
of `metrics.py` are filled from these counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

COMM_OPS = ("all_reduce", "all_gather", "send", "recv", "broadcast", "gather")


@dataclass
class Counters:
    comm_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMM_OPS, 0))
    comm_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMM_OPS, 0.0))
    compute_seconds: float = 0.0
    idle_seconds: float = 0.0  # blocked in recv: waiting for another pipeline stage
    # offload: bytes of streamed layers brought in (copied or mapped), seconds spent on it, seconds a
    # forward pass waited
    streamed_bytes: int = 0
    stream_seconds: float = 0.0
    stall_seconds: float = 0.0
    device_stall_seconds: float = 0.0  # GPU: the compute stream waited for a slot's copy (stall_seconds: the host)

    @property
    def comm_total(self) -> float:
        return sum(self.comm_seconds.values())

    def copy(self) -> Counters:
        return Counters(dict(self.comm_bytes), dict(self.comm_seconds), self.compute_seconds, self.idle_seconds,
                        self.streamed_bytes, self.stream_seconds, self.stall_seconds, self.device_stall_seconds)

    def minus(self, earlier: Counters) -> Counters:
        return Counters({k: v - earlier.comm_bytes[k] for k, v in self.comm_bytes.items()},
                        {k: v - earlier.comm_seconds[k] for k, v in self.comm_seconds.items()},
                        self.compute_seconds - earlier.compute_seconds,
                        self.idle_seconds - earlier.idle_seconds,
                        self.streamed_bytes - earlier.streamed_bytes,
                        self.stream_seconds - earlier.stream_seconds,
                        self.stall_seconds - earlier.stall_seconds,
                        self.device_stall_seconds - earlier.device_stall_seconds)

    def summary(self) -> dict[str, float]:
        return {"comm_seconds": self.comm_total, "compute_seconds": self.compute_seconds,
                "idle_seconds": self.idle_seconds, "comm_bytes": sum(self.comm_bytes.values()),
                "streamed_bytes": self.streamed_bytes, "stream_seconds": self.stream_seconds,
                "stall_seconds": self.stall_seconds, "device_stall_seconds": self.device_stall_seconds}


class Clock(Protocol):
    def mark(self) -> Any: ...
    def done(self, mark: Any) -> bool: ...
    def seconds(self, start: Any, end: Any) -> float: ...
    def release(self, mark: Any) -> None: ...
    def synchronize(self) -> None: ...


class HostClock:
    """perf_counter: right for work the host waits for."""

    def mark(self) -> float:
        return time.perf_counter()

    def done(self, mark: float) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def release(self, mark: float) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaClock:
    """CUDA events recorded on the current stream: the device's time between two marks. Events are
    reused once counted (a decode step records two per collective)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._free: list[Any] = []

    def mark(self) -> Any:
        event = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def release(self, mark: Any) -> None:
        self._free.append(mark)

    def done(self, mark: Any) -> bool:
        return mark.query()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def synchronize(self) -> None:
        self._torch.cuda.current_stream().synchronize()


@dataclass(eq=False)
class _Span:
    kind: str  # compute | comm | idle | stall
    clock: Clock
    start: Any
    op: str = ""
    end: Any = None
    inner: float = 0.0  # comm and idle seconds of the spans inside a compute span
    parent: _Span | None = None


class Accounting:
    def __init__(self, device_clock: Clock | None = None, host_clock: Clock | None = None) -> None:
        self.host: Clock = host_clock or HostClock()
        self.device: Clock = device_clock or self.host  # CPU tensors: the host's clock
        self._counters = Counters()
        self._pending: deque[_Span] = deque()  # closed device spans, in stream order
        self._copies: deque[tuple[int, Any, Any]] = deque()  # offload's copies on a side stream, in its order
        self._open: _Span | None = None  # the innermost open compute span
        self._lock = threading.Lock()  # the heartbeat thread reads while the engine thread times

    @property
    def counters(self) -> Counters:
        """What has been counted so far (any thread)."""
        return self._counters

    def resolve(self) -> None:
        """Count the spans whose events have run, without waiting (the recording thread)."""
        with self._lock:
            while self._pending and self._pending[0].clock.done(self._pending[0].end):  # one stream: in order
                self._count(self._pending.popleft())
            while self._copies and self.device.done(self._copies[0][2]):  # the side stream: in its order
                nbytes, start, end = self._copies.popleft()
                self._counters.streamed_bytes += nbytes
                self._counters.stream_seconds += self.device.seconds(start, end)

    def snapshot(self) -> Counters:
        """A copy of the counters once the device has run everything timed so far (the recording thread)."""
        self.device.synchronize()
        self.resolve()
        with self._lock:
            return self._counters.copy()

    def streamed(self, nbytes: int, seconds: float) -> None:
        """Offload: bytes of a streamed layer brought in (copied or mapped) and the seconds that took
        (the prefetch thread)."""
        with self._lock:
            self._counters.streamed_bytes += nbytes
            self._counters.stream_seconds += seconds

    def copied(self, nbytes: int, start: Any, end: Any) -> None:
        """Offload (GPU): a copy of `nbytes` into a slot between two marks of the device clock on a
        side stream (the prefetch thread); its bytes and seconds count together once it has run."""
        with self._lock:
            self._copies.append((nbytes, start, end))

    def stalled(self, seconds: float) -> None:
        """Offload: the forward pass's thread waited `seconds` for the prefetch thread to deliver a
        streamed layer (the recording thread): not compute, so it leaves the compute span it fell
        in, as communication does."""
        with self._lock:
            self._counters.stall_seconds += seconds
            if self._open is not None:
                self._open.inner += seconds

    @contextmanager
    def device_stall(self) -> Iterator[None]:
        """Offload (GPU): time the compute stream's wait for a streamed layer's copy, queued inside:
        a span of the device clock, not compute (`device_stall_seconds`)."""
        with self._span("stall", "", False):
            yield

    def comm(self, op: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counters.comm_bytes[op] += nbytes
            self._counters.comm_seconds[op] += seconds

    def replayed(self, collectives: list[tuple[str, int]] | tuple[tuple[str, int], ...]) -> None:
        """The collectives of a replayed graph (recorded when it was captured: `Comm.recording`):
        their bytes count as sent. Their time cannot be told apart from the graph's kernels (one
        launch runs them all), so it stays in the compute span around the replay: a captured
        step's communication seconds read 0, its compute seconds hold them."""
        with self._lock:
            for op, nbytes in collectives:
                self._counters.comm_bytes[op] += nbytes

    def communicated(self, op: str, nbytes: int, seconds: float) -> None:
        """A collective its caller timed (inside a C call: `fused.py`), counted as `communicating`
        counts one: its time is not the open compute span's."""
        self.comm(op, nbytes, seconds)
        with self._lock:
            if self._open is not None:
                self._open.inner += seconds

    @contextmanager
    def communicating(self, op: str, nbytes: int, host: bool = False) -> Iterator[None]:
        """Time a collective or a send: on the device clock, or `host` for gloo's CPU messages."""
        self.comm(op, nbytes, 0.0)
        with self._span("comm", op, host):
            yield

    @contextmanager
    def waiting(self, host: bool = False) -> Iterator[None]:
        """Time a receive as idle (it is another stage's compute)."""
        with self._span("idle", "", host):
            yield

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Time a region as compute, less what it spent communicating or waiting inside."""
        with self._span("compute", "", False):
            yield

    @contextmanager
    def _span(self, kind: str, op: str, host: bool) -> Iterator[None]:
        clock = self.host if host else self.device
        span = _Span(kind, clock, clock.mark(), op, parent=self._open)
        if kind == "compute":
            self._open = span
        try:
            yield
        finally:
            span.end = clock.mark()
            if kind == "compute":
                self._open = span.parent
            with self._lock:
                if host:
                    self._count(span)
                else:
                    self._pending.append(span)
            self.resolve()

    def _count(self, span: _Span) -> None:
        seconds = span.clock.seconds(span.start, span.end)
        span.clock.release(span.start)
        span.clock.release(span.end)
        c = self._counters
        if span.kind == "compute":
            c.compute_seconds += seconds - span.inner
        elif span.kind == "comm":
            c.comm_seconds[span.op] += seconds
        elif span.kind == "stall":
            c.device_stall_seconds += seconds
        else:
            c.idle_seconds += seconds
        if span.parent is not None and span.kind != "compute":
            span.parent.inner += seconds


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
    cuda_reserved: int = 0  # what torch's caching allocator holds on the device
    cuda_used: int = 0  # the whole device's memory in use (mem_get_info): contexts, NCCL, every allocator

    @classmethod
    def take(cls, device=None) -> MemorySample:
        status = proc_status()
        allocated = reserved = used = 0
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(device)
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            used = total - free
        return cls(rss=status["VmRSS"], rss_anon=status["RssAnon"], peak_rss=status["VmHWM"],
                   cuda_allocated=allocated, cuda_reserved=reserved, cuda_used=used)

    def held(self, on_cuda: bool) -> int:
        """The bytes that grow with what the rank allocates: what CUDA's caching allocator
        reserved on the device (what the device really gives up), or anonymous memory."""
        return self.cuda_reserved if on_cuda else self.rss_anon
