"""Timing with a clock per kind of work: device spans (CUDA events on a GPU) are counted once
their marks have run, in stream order, and compute is its span less the communication and waiting
inside; host spans (gloo's control messages) are counted at once. Fake clocks stand in for the
host's perf_counter and for a device that runs what was queued when the test says so."""

from __future__ import annotations

import pytest

from shard_worker.telemetry.accounting import Accounting, HostClock


class Mark:
    def __init__(self, time: float | None = None):
        self.time = time


class FakeHost:
    """perf_counter, advanced by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> Mark:
        return Mark(self.now)

    def done(self, mark: Mark) -> bool:
        return True

    def seconds(self, start: Mark, end: Mark) -> float:
        return end.time - start.time

    def release(self, mark: Mark) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeDevice(FakeHost):
    """A stream: marks are queued when recorded and get their time when the device reaches them."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[Mark] = []

    def mark(self) -> Mark:
        self.queue.append(Mark())
        return self.queue[-1]

    def done(self, mark: Mark) -> bool:
        return mark.time is not None

    def run(self, *gaps: float) -> None:
        """The device reaches the next len(gaps) marks, each `gap` seconds after the one before."""
        for gap in gaps:
            self.now += gap
            self.queue.pop(0).time = self.now

    def synchronize(self) -> None:
        self.run(*[0.0] * len(self.queue))


def test_device_spans_count_what_the_device_spent_once_it_has_run_them():
    device, host = FakeDevice(), FakeHost()
    acct = Accounting(device, host)
    with acct.computing():  # the host only queues kernels and a collective: no time passes for it
        with acct.communicating("all_reduce", 4096):
            pass
    with acct.waiting():  # a receive the stream waits for
        pass
    assert acct.counters.comm_bytes["all_reduce"] == 4096  # bytes are known at once
    assert (acct.counters.compute_seconds, acct.counters.comm_total, acct.counters.idle_seconds) == (0, 0, 0)
    device.run(0.0, 1.0, 0.5, 2.0)  # compute starts, the all-reduce runs 0.5 s, 2 s more compute
    acct.resolve()  # the engine thread does at every span it closes
    assert acct.counters.compute_seconds == pytest.approx(3.0)  # 3.5 s less the 0.5 s all-reduce
    assert acct.counters.comm_seconds["all_reduce"] == pytest.approx(0.5)
    assert acct.counters.idle_seconds == 0  # its marks have not run yet
    device.run(1.0, 4.0)
    acct.resolve()
    assert acct.counters.idle_seconds == pytest.approx(4.0)


def test_device_spans_are_counted_in_stream_order():
    device = FakeDevice()
    acct = Accounting(device, FakeHost())
    with acct.computing():
        pass
    with acct.computing():
        pass
    second = device.queue[2:]
    del device.queue[2:]
    second[0].time, second[1].time = 4.0, 7.0  # as if done: still counted after the first span only
    acct.resolve()
    assert acct.counters.compute_seconds == 0
    device.run(1.0, 1.0)
    acct.resolve()
    assert acct.counters.compute_seconds == pytest.approx(1.0 + 3.0)


def test_snapshot_waits_for_the_device_and_host_spans_count_at_once():
    device, host = FakeDevice(), FakeHost()
    acct = Accounting(device, host)
    with acct.computing():
        with acct.communicating("broadcast", 8, host=True):  # gloo: the host waits 0.25 s
            host.now += 0.25
        with acct.waiting(host=True):
            host.now += 1.0
    assert acct.counters.comm_seconds["broadcast"] == 0.25 and acct.counters.idle_seconds == 1.0
    before = acct.counters.copy()
    device.run(0.0)  # the compute span starts on the device; it is still running
    device.now = 3.0
    acct.resolve()
    assert acct.counters.compute_seconds == 0
    snapshot = acct.snapshot()  # waits until the device is done: 3 s, less 1.25 s spent on the host
    assert snapshot.compute_seconds == pytest.approx(1.75)
    assert snapshot.minus(before).compute_seconds == pytest.approx(1.75)


def test_on_a_cpu_every_span_is_host_time():
    host = FakeHost()
    acct = Accounting(host_clock=host)
    assert acct.device is acct.host
    with acct.computing():
        host.now += 2.0
        with acct.communicating("all_reduce", 64):
            host.now += 0.5
        with acct.waiting():
            host.now += 0.25
    c = acct.counters
    assert (c.compute_seconds, c.comm_seconds["all_reduce"], c.idle_seconds) == (2.0, 0.5, 0.25)
    assert isinstance(Accounting().device, HostClock)


def test_a_stall_for_a_streamed_layer_is_not_compute_and_streaming_counts_beside_it():
    """Offload: the forward pass's thread waits for the prefetch thread to deliver a layer's slot
    inside its compute span: that wait is a stall, not compute. The prefetch thread's copies count
    on their own."""
    host = FakeHost()
    acct = Accounting(host_clock=host)
    with acct.computing():
        host.now += 2.0
        host.now += 0.75
        acct.stalled(0.75)  # what Streamer measured it waited
        host.now += 1.0
    acct.streamed(4096, 0.5)
    acct.stalled(0.1)  # a stall outside any compute span: counted, nothing to take it from
    c = acct.counters
    assert (c.compute_seconds, c.stall_seconds) == (pytest.approx(3.0), pytest.approx(0.85))
    assert (c.streamed_bytes, c.stream_seconds) == (4096, 0.5)


def test_a_gpus_device_stall_is_timed_on_the_compute_stream_apart_from_the_hosts():
    """Offload on a GPU: the compute stream's wait for a layer's copy is a span of the device clock
    (events around the wait), counted in stream order as `device_stall_seconds` and not as
    compute; the host's wait for the prefetch thread counts apart, in `stall_seconds`."""
    device, host = FakeDevice(), FakeHost()
    acct = Accounting(device, host)
    with acct.computing():
        acct.stalled(0.25)  # the host waited for the prefetch thread to deliver the slot
        with acct.device_stall():
            pass
    assert (acct.counters.stall_seconds, acct.counters.device_stall_seconds) == (0.25, 0)
    device.run(0.0, 1.0, 2.0, 0.5)  # compute starts; 1 s in, the stream waits 2 s for the copy; 0.5 s more
    acct.resolve()
    c = acct.counters
    assert c.device_stall_seconds == pytest.approx(2.0)
    assert c.compute_seconds == pytest.approx(3.5 - 2.0 - 0.25)
    assert c.stall_seconds == 0.25
    assert c.summary()["device_stall_seconds"] == pytest.approx(2.0)


def test_a_gpus_copies_count_once_they_have_run_in_their_streams_order():
    """Offload on a GPU: a copy on the side stream counts its bytes and its seconds together, once
    its end mark has run, in the side stream's order; whatever ran before a snapshot is in it."""
    device, side = FakeDevice(), FakeDevice()
    acct = Accounting(device, FakeHost())
    before = acct.snapshot()
    for nbytes in (100, 200, 300):
        acct.copied(nbytes, side.mark(), side.mark())
    acct.resolve()
    assert (acct.counters.streamed_bytes, acct.counters.stream_seconds) == (0, 0)
    side.run(0.0, 1.0, 0.5, 2.0)  # the first two copies: 1 s and 2 s
    with acct.computing():  # any span the engine closes counts what has run
        pass
    assert (acct.counters.streamed_bytes, acct.counters.stream_seconds) == (300, pytest.approx(3.0))
    snapshot = acct.snapshot()  # waits for the compute stream, not for a copy still running (a prefetch)
    assert snapshot.minus(before).streamed_bytes == 300
    side.run(1.0, 4.0)
    after = acct.snapshot()
    assert after.minus(snapshot).streamed_bytes == 300
    assert after.minus(before).stream_seconds == pytest.approx(3.0 + 4.0)
