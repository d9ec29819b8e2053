"""Health and readiness, judged from heartbeats; the memory check; batch selection and admission
at step boundaries; and the engine loop's promise that every request ends (answered, refused, or
failed with a reason)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from shard_contract.plan import PredictedBytes, RankPlan
from shard_contract.wire import Completion, GenerateRequest, ResidentBytes
from shard_operator.local.launcher import free_port
from shard_worker.engine.engine import RequestError
from shard_worker.engine.kvblocks import Blocks
from shard_worker.engine.sequences import SequenceState
from shard_worker.serving.batcher import EngineLoop, take_batch, take_joiners
from shard_worker.serving.events import Done, Failed, Pending, Sink, Step, Unavailable
from shard_worker.serving.servelog import Throughput
from shard_worker.telemetry.health import (
    ForgedRecord,
    GroupKeyError,
    GroupMonitor,
    Heartbeat,
    Record,
    memory_problems,
    read_group_key,
)
from shard_worker.telemetry.rankmetrics import RankMetrics

MiB = 2**20


def record(rank: int, seq: int, state: str = "ready", **kw) -> Record:
    return Record(rank=rank, seq=seq, state=state, **kw)


def test_a_group_is_ready_once_every_rank_has_loaded():
    m = GroupMonitor(world_size=3, stale_seconds=5)
    m.observe({0: record(0, 1), 1: record(1, 1, "loading")}, now=0.0)
    v = m.verdict(0.0)
    assert (v.alive, v.ready, v.reason) == (True, False, "waiting for ranks 1, 2 to join and load")
    m.observe({0: record(0, 2), 1: record(1, 2), 2: record(2, 1)}, now=1.0)
    assert m.verdict(1.0).ready and m.verdict(1.0).reason == ""


def test_a_rank_that_stops_beating_is_dead_or_hung_and_stays_so():
    m = GroupMonitor(world_size=2, stale_seconds=5)
    for t in range(6):
        m.observe({0: record(0, t), 1: record(1, min(t, 1))}, now=float(t))  # rank 1 froze at seq 1 (t=1)
    assert m.verdict(5.5).alive
    m.observe({0: record(0, 7), 1: record(1, 1)}, now=6.5)
    v = m.verdict(6.5)
    assert not v.alive and not v.ready
    assert v.reason == "rank 1 has sent no heartbeat for 5.5 s (dead or hung)"
    assert v.ranks_alive == {0: True, 1: False}
    m.observe({0: record(0, 8), 1: record(1, 2)}, now=7.0)  # it beats again: the communicator is still broken
    assert not m.verdict(7.0).alive


def test_a_failed_rank_or_an_unreachable_store_is_a_lost_group():
    m = GroupMonitor(world_size=2)
    m.observe({0: record(0, 1), 1: record(1, 1, "failed", error="RuntimeError: connection reset")}, now=0.0)
    assert m.verdict(0.0).reason == "rank 1 failed: RuntimeError: connection reset"
    m = GroupMonitor(world_size=2)
    m.observe({}, now=0.0, store_error="cannot reach the group's store at h:1 (rank 0's process): timeout")
    assert not m.verdict(0.0).alive and "cannot reach the group's store" in m.verdict(0.0).reason


def test_a_rank_whose_collective_failed_is_named_only_until_the_cause_shows():
    m = GroupMonitor(world_size=2, stale_seconds=5)
    m.observe({0: record(0, 1), 1: record(1, 1)}, now=0.0)
    broken = record(0, 2, "broken", error="RuntimeError: Connection closed by peer")
    m.observe({0: broken, 1: record(1, 1)}, now=1.0)  # rank 1 was killed at t=0+: its socket closed
    v = m.verdict(1.0)
    assert not v.alive
    assert v.reason == "rank 0 lost its group: RuntimeError: Connection closed by peer"
    m.observe({0: record(0, 7, "broken", error=broken.error), 1: record(1, 1)}, now=6.5)
    assert m.verdict(6.5).reason == "rank 1 has sent no heartbeat for 6.5 s (dead or hung)"


def test_a_record_equal_to_or_older_than_the_last_is_no_beat():
    """Writing a rank's record back, its latest or an older one, never keeps a dead rank alive."""
    m = GroupMonitor(world_size=2, stale_seconds=5)
    m.observe({0: record(0, 1), 1: record(1, 3)}, now=0.0)
    for t in range(1, 7):  # rank 1 died after beat 3; its records are replayed every second
        rejected = m.observe({0: record(0, 1 + t), 1: record(1, 3 if t % 2 else 2)}, now=float(t))
        assert rejected == ([] if t % 2 else ["rank 1's record number 2 was written again after number 3"])
    v = m.verdict(6.0)
    assert v.ranks_alive[1] is False and not v.ready
    assert m.records[1].seq == 3  # nothing older was believed


def test_a_rank_incarnation_is_pinned_and_another_start_s_records_are_ignored():
    """A record of an earlier start of rank 1 (same key, a higher number) cannot displace the live
    rank's records, nor can one of another start of this very process's rank."""
    m = GroupMonitor(world_size=2, stale_seconds=5, incarnations={0: "me"})
    m.observe({0: record(0, 1, incarnation="me"), 1: record(1, 1, incarnation="live")}, now=0.0)
    old = record(1, 10**6, "failed", error="an old start's failure", incarnation="earlier")
    assert m.observe({1: old}, now=0.5) == ["rank 1's record comes from another start of that rank (earlier)"]
    assert m.observe({0: record(0, 10**6, "failed", incarnation="other")}, now=0.6) == [
        "rank 0's record comes from another start of that rank (other)"]
    for t in range(1, 8):  # the live rank's own records go on being believed
        assert m.observe({0: record(0, 1 + t, incarnation="me"), 1: record(1, 1 + t, incarnation="live")},
                         now=float(t)) == []
    assert m.verdict(7.0).ready and m.records[1].incarnation == "live"


def test_overwriting_a_live_rank_s_key_cannot_make_the_group_lost_nor_the_rank_look_alive():
    m = GroupMonitor(world_size=2, stale_seconds=5)
    m.observe({0: record(0, 1), 1: record(1, 1)}, now=0.0)
    for t in range(1, 9):  # rank 1's key holds forged records: its true ones are never read
        m.tampered(1, float(t))
        m.observe({0: record(0, 1 + t)}, now=float(t))
    v = m.verdict(8.0)
    assert v.alive and not v.ready and v.ranks_alive == {0: True, 1: False}
    assert v.reason == ("rank 1's heartbeat records are being overwritten by someone without the group's key; "
                        "its last true record is 8.0 s old")
    m.observe({0: record(0, 10), 1: record(1, 9)}, now=9.0)  # a true record gets through again
    assert m.verdict(9.0).ready


def test_a_silent_rank_whose_key_nobody_touched_since_its_last_beat_is_dead():
    m = GroupMonitor(world_size=2, stale_seconds=5)
    m.tampered(1, 0.5)  # before its last true record: no excuse for its silence since
    m.observe({0: record(0, 1), 1: record(1, 1)}, now=1.0)
    m.observe({0: record(0, 2)}, now=6.5)
    assert m.verdict(6.5).reason == "rank 1 has sent no heartbeat for 5.5 s (dead or hung)"


def test_memory_problems_keep_a_rank_unready():
    m = GroupMonitor(world_size=1)
    m.observe({0: record(0, 1, problems=["rank 0 holds too much"])}, now=0.0)
    v = m.verdict(0.0)
    assert v.alive and not v.ready and v.reason == "memory check failed: rank 0 holds too much"


def rank_plan(weights: int, kv: int, capacity: int) -> RankPlan:
    return RankPlan(replica=0, rank=1, stage=0, tp_rank=1, node="n", device="cpu:1", device_index=1, kind="cpu",
                    layers=(0, 2), embeds=True, has_lm_head=True, capacity_bytes=capacity, usable_bytes=capacity,
                    predicted_bytes=PredictedBytes(weights=weights, kv_cache=kv, activations=0, overhead=0))


def resident(weights: int, kv: int, total: int) -> ResidentBytes:
    return ResidentBytes(weights=weights, kv_cache=kv, rss_anon=total, total=total)


@pytest.mark.parametrize("measured,total,budget,problems", [
    ((100, 20), 150, None, []),
    ((110, 20), 150, None, []),  # within 10%
    ((200, 20), 250, None,
     ["rank 1 holds 220.0 MiB of weights, KV cache and staging, more than the plan's 120.0 MiB (+10%)"]),
    ((100, 20), 300, None, ["rank 1 holds 300.0 MiB in all, more than its device's capacity (cpu:1 on n): 256.0 MiB"]),
    ((100, 20), 200, 160, ["rank 1 holds 200.0 MiB in all, more than its memory budget (SHARD_MEMORY_BUDGET): "
                           "160.0 MiB"]),
])
def test_memory_check(measured, total, budget, problems):
    plan = rank_plan(100 * MiB, 20 * MiB, capacity=256 * MiB)
    got = memory_problems(plan, resident(measured[0] * MiB, measured[1] * MiB, total * MiB),
                          budget * MiB if budget else None)
    assert got == problems


KEY = b"k" * 32


def test_a_sealed_record_opens_only_with_its_key_and_under_its_rank():
    sealed = record(1, 7, "failed", error="boom").seal(KEY)
    assert Record.open(sealed, KEY, 1) == record(1, 7, "failed", error="boom")
    mac, body = sealed.split(b" ", 1)
    forgeries = {
        "another key": record(1, 7, "failed").seal(b"x" * 32),
        "no seal": body,
        "an edited body": mac + b" " + body.replace(b"boom", b"bam!"),
        "an empty value": b"",
    }
    for value in forgeries.values():
        with pytest.raises(ForgedRecord, match="does not carry the group key's seal"):
            Record.open(value, KEY, 1)
    with pytest.raises(ForgedRecord, match="rank 1's record was written under rank 0's key"):
        Record.open(sealed, KEY, 0)


@pytest.mark.parametrize("content,message", [
    (None, "SHARD_GROUP_SECRET_FILE is not set"),
    (b"short", "the key has 5 bytes; at least 16 are needed"),
    ("missing", "No such file or directory"),
])
def test_a_rank_needs_a_usable_group_key(tmp_path, content, message):
    path = tmp_path / "key"
    if isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(GroupKeyError, match=message):
        read_group_key(None if content is None else str(path))


def test_forged_and_replayed_records_in_a_real_store_are_ignored_and_counted():
    """Rank 0 reads rank 1's records; whoever else writes under rank 1's key is not believed."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    rejected: list[str] = []
    beat = Heartbeat("127.0.0.1", port, 0, 2, lambda seq: record(0, seq), KEY, on_rejected=rejected.append,
                     period=0.05, stale=5)
    key = "shard/rank/1"

    try:
        beat.start()
        for seq in (1, 2):
            store.set(key, record(1, seq).seal(KEY))
            wait_until(lambda: (r := beat.records().get(1)) is not None and r.seq == seq)
        old = record(1, 1).seal(KEY)
        forged = [record(1, 9, "failed", error="forged").seal(b"x" * 32),  # a wrong key
                  record(1, 9, "failed", error="forged").seal(KEY).split(b" ", 1)[1],  # no seal
                  record(2, 9, "failed", error="forged").seal(KEY),  # another rank's record
                  old]  # rank 1's own old record, written again
        for n, value in enumerate(forged, 1):
            store.set(key, value)
            wait_until(lambda: beat.rejected == n)
        time.sleep(0.2)  # read again and again: judged once
        assert beat.rejected == len(forged) == len(rejected)
        assert rejected[3] == "rank 1's record number 1 was written again after number 2"
        assert beat.records()[1] == record(1, 2) and beat.verdict().alive  # nothing forged was believed
    finally:
        beat.stop()
        del store


def test_garbage_written_over_a_live_rank_s_key_never_makes_the_group_lost():
    """Two ranks beat every 50 ms; a stranger overwrites rank 1's key with garbage every millisecond
    or so for four times the stale window. Rank 0 never calls the group lost (whether true records
    get through between the stranger's or not: GroupMonitor's tables judge the silent case), and it
    is ready once the stranger stops."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    lost: list[str] = []  # stale 2 s: a beat thread starved for a moment on a busy machine is not lost
    stale = 2.0
    beats = [Heartbeat("127.0.0.1", port, rank, 2, lambda seq, rank=rank: record(rank, seq), KEY,
                       on_lost=lost.append, period=0.05, stale=stale) for rank in (0, 1)]
    stop = threading.Event()

    def overwrite() -> None:
        writer = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=5))
        n = 0
        while not stop.is_set():
            n += 1
            writer.set("shard/rank/1", b"0" * 64 + b" garbage %d" % n)
            time.sleep(0.001)

    stranger = threading.Thread(target=overwrite, daemon=True)
    try:
        for b in beats:
            b.start()
        wait_until(lambda: all(b.verdict().ready for b in beats))
        stranger.start()
        wait_until(lambda: beats[0].rejected > 0)
        for _ in range(int(4 * stale / 0.05)):  # four stale windows under attack: tampered with (or not), never lost
            assert beats[0].verdict().alive and lost == [], beats[0].verdict()
            time.sleep(0.05)
        stop.set()
        stranger.join(10)
        wait_until(lambda: beats[0].verdict().ready)
        assert lost == [] and beats[0].rejected > 0
    finally:
        stop.set()
        for b in beats:
            b.stop()
        del master


def wait_until(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s"
        time.sleep(0.02)


def test_heartbeats_through_a_real_store():
    """Two ranks beat into a real TCPStore; when one stops, the other calls the group lost."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    lost: list[str] = []  # stale 3 s: a beat thread starved for a moment on a busy machine is not lost
    beats = [Heartbeat("127.0.0.1", port, rank, 2, lambda seq, rank=rank: record(rank, seq), KEY,
                       on_lost=lost.append if rank == 0 else None, period=0.05, stale=3) for rank in (0, 1)]
    try:
        for b in beats:
            b.start()
        deadline = time.monotonic() + 60
        while not all(b.verdict().ready for b in beats):  # every rank knows the whole group
            assert time.monotonic() < deadline, [b.verdict() for b in beats]
            time.sleep(0.05)
        beats[1].stop()
        while beats[0].verdict().alive:
            assert time.monotonic() < deadline, beats[0].verdict()
            time.sleep(0.05)
        assert beats[0].verdict().reason.startswith("rank 1 has sent no heartbeat")
        wait_until(lambda: lost)  # rank 0's beat thread tells it, when it next runs
        time.sleep(0.2)
        assert lost == [beats[0].verdict().reason]  # told once
    finally:
        for b in beats:
            b.stop()
        del master


# ---------------------------------------------------------------- batching
def req(prompt: int, new: int) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1] * prompt, max_new_tokens=new)


@pytest.mark.parametrize("waiting,max_batch,max_len,n", [
    ([(4, 4)], 4, 16, 1),
    ([(4, 4)] * 6, 4, 16, 4),  # at most maxBatchSize
    ([(4, 4), (10, 4), (4, 4)], 4, 16, 3),  # padded to 10: 10 + 4 - 1 fits
    ([(4, 4), (14, 3), (4, 4)], 4, 16, 1),  # padded to 14, the first's 4 new tokens do not fit
    ([(4, 13), (4, 4)], 4, 16, 2),
    ([(16, 1), (2, 2)], 4, 16, 1),  # the long prompt goes alone
])
def test_take_batch(waiting, max_batch, max_len, n):
    assert take_batch([req(p, m) for p, m in waiting], max_batch, max_len) == n


@pytest.mark.parametrize("waiting,free_rows,col,chosen", [
    ([(4, 4)], 1, 10, [0]),
    ([(4, 4), (4, 4)], 1, 10, [0]),  # one free row
    ([(12, 2), (4, 4)], 2, 10, [0, 1]),  # a prompt longer than the column joins too (the batch is reframed)
    ([(12, 6), (4, 4)], 2, 10, [1]),  # 12 + 6 - 1 columns do not fit maxModelLen 16: the next one joins
    ([(4, 4), (4, 8)], 2, 10, [0]),  # 10 + 8 - 1 columns do not fit maxModelLen 16
    ([(4, 7)], 1, 10, [0]),  # 10 + 7 - 1 do
    ([(4, 1), (2, 1)], 2, 16, [0, 1]),  # the last column still takes one-token answers
    ([(4, 4)], 0, 10, []),
])
def test_take_joiners(waiting, free_rows, col, chosen):
    assert take_joiners([req(p, m) for p, m in waiting], free_rows, col, max_len=16) == chosen


class ScriptedEngine:
    """Stands in for the engine's leader methods: each generate call follows the next script.

    "ok" answers the whole batch at its first step. "join" starts the first request, then runs one
    decode step, at columns 10, 11, ... (maxModelLen 16), each time `tick` is released: the step
    admits at most one request into a free row and answers it at once; once `finish` is set, the
    next tick ends the first request and the generate."""

    max_len = 16

    def __init__(self, scripts):
        self.scripts, self.batches, self.heartbeats, self.shut = list(scripts), [], 0, False
        self.blocks = Blocks(num_blocks=64, block_size=16)  # the paged KV cache's bookkeeping: room for all
        self.preemptions = 0
        self.release, self.finish, self.tick = threading.Event(), threading.Event(), threading.Semaphore(0)
        self.joined: list[tuple[int, int]] = []  # (column, sequence index)
        self.cancelled: list[list[int]] = []  # what hooks.cancelled() said at each step boundary

    def check(self, request):
        if len(request.prompt_ids) + request.max_new_tokens - 1 > self.max_len:
            raise RequestError("never fits")

    def generate(self, requests, hooks):
        self.batches.append(len(requests))
        script = self.scripts.pop(0)
        if isinstance(script, Exception):
            raise script
        if script == "block":
            self.release.wait(300)  # (the test releases it: a bound against a hung test, not a deadline)
            raise RuntimeError("Connection closed by peer")
        seqs = [SequenceState(r, (), index=i) for i, r in enumerate(requests)]
        if script == "ok":
            return self._step(seqs, seqs, hooks)
        if script == "one fails":  # the last sequence fails alone (its token could not be chosen)
            self._step(seqs, seqs[:-1], hooks)
            return hooks.finished(seqs[-1], Completion(token_ids=[], finish_reason="error", error="no token"))
        self._step(seqs, [], hooks)
        for col in range(10, self.max_len + 1):
            self.tick.acquire(timeout=300)  # (as `release`: each step waits for the test's tick)
            if self.finish.is_set():
                break
            self.cancelled.append(hooks.cancelled())
            joining = [SequenceState(r, (), index=len(seqs)) for r in hooks.admit(1, col)]
            seqs += joining
            self.joined += [(col, seq.index) for seq in joining]
            self._step([seqs[0], *joining], joining, hooks)
        self._step([seqs[0]], [seqs[0]], hooks)

    @staticmethod
    def _step(took, stopping, hooks):
        for seq in took:
            seq.tokens = [7, 8]
        hooks.step(took)
        for seq in stopping:
            hooks.finished(seq, Completion(token_ids=[7, 8], text="ab", finish_reason="length"))

    def heartbeat(self):
        self.heartbeats += 1

    def shutdown(self):
        self.shut = True


def metrics() -> RankMetrics:
    return RankMetrics("m", 0, rank_plan(1, 1, 10), leader=True, max_batch=4, max_len=64)


async def result(sink: Sink):
    return await asyncio.wait_for(sink.queue.get(), 60)


async def test_requests_waiting_together_run_as_one_batch_and_all_end():
    engine = ScriptedEngine(["ok", RequestError("too long"), "ok"])
    loop = EngineLoop(engine, max_batch=4, max_len=64, metrics=metrics(), idle_seconds=0.05)
    aio = asyncio.get_running_loop()
    sinks = [Sink(aio, stream=i == 0) for i in range(6)]
    for s in sinks:
        loop.submit(Pending(req(3, 4), s, "cmpl-test"))  # queued before the engine thread starts: two batches
    thread = threading.Thread(target=loop.run)
    thread.start()
    events = [await result(s) for s in sinks]
    assert engine.batches == [4, 2]
    assert events[0] == Step([7, 8]) and isinstance(await result(sinks[0]), Done)  # streamed, then done
    assert all(isinstance(e, Done) for e in events[1:4])
    assert events[4] == Failed(400, "too long") == events[5]  # refused batch; the group is fine
    later = Sink(aio, stream=False)
    loop.submit(Pending(req(3, 4), later, "cmpl-test"))
    assert isinstance(await result(later), Done)
    await until("an idle heartbeat: the followers are kept from timing out", lambda: engine.heartbeats > 0)
    loop.close()
    thread.join(60)
    assert engine.shut and not thread.is_alive()


async def test_a_sequence_that_fails_alone_fails_its_request_only():
    engine = ScriptedEngine(["one fails", "ok"])
    counted = metrics()
    loop = EngineLoop(engine, max_batch=4, max_len=64, metrics=counted, idle_seconds=0.05)
    aio = asyncio.get_running_loop()
    sinks = [Sink(aio, stream=False) for _ in range(3)]
    for s in sinks:
        loop.submit(Pending(req(3, 4), s, "cmpl-test"))
    thread = threading.Thread(target=loop.run)
    thread.start()
    assert [type(await result(s)) for s in sinks[:2]] == [Done, Done]
    assert await result(sinks[2]) == Failed(500, "this request failed: no token")
    later = Sink(aio, stream=False)
    loop.submit(Pending(req(3, 4), later, "cmpl-test"))
    assert isinstance(await result(later), Done) and not loop.lost  # the group serves on
    assert counted.m.get("shard_requests", outcome="failed")._value.get() == 1
    loop.close()
    thread.join(60)
    assert engine.shut


def test_the_events_of_a_step_wake_the_loop_once_and_arrive_in_order():
    """32 streaming requests take a token in one step: the engine thread posts 32 events with one
    wake-up of the event loop (a write to its self-pipe), and each request gets its own, in order."""
    aio = asyncio.new_event_loop()
    wakeups = []
    post = aio.call_soon_threadsafe
    aio.call_soon_threadsafe = lambda *args: (wakeups.append(args), post(*args))[1]  # type: ignore[method-assign]
    try:
        sinks = [Sink(aio, stream=True) for _ in range(32)]
        engine = threading.Thread(target=lambda: [(s.step([i]), s.step([i, i + 1])) for i, s in enumerate(sinks)])
        engine.start()
        engine.join(60)

        async def read() -> list[list]:
            return [[await result(s), await result(s)] for s in sinks]

        got = aio.run_until_complete(read())
    finally:
        aio.close()
    assert got == [[Step([i]), Step([i, i + 1])] for i in range(32)]
    assert len(wakeups) == 1


def delivered(sink: Sink) -> list:
    """The events delivered to `sink` and not yet read."""
    events = []
    while not sink.queue.empty():
        events.append(sink.queue.get_nowait())
    return events


async def test_waiting_requests_join_the_running_batch_when_they_fit_and_are_answered_when_they_stop():
    engine = ScriptedEngine(["join", "ok"])
    loop = EngineLoop(engine, max_batch=2, max_len=16, metrics=metrics(), idle_seconds=5)
    aio = asyncio.get_running_loop()
    first = Sink(aio, stream=True)
    long_prompt, late, short, never = (Sink(aio, stream=False) for _ in range(4))
    loop.submit(Pending(req(3, 12), first, "cmpl-test"))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert await result(first) == Step([7, 8])  # it runs
    loop.submit(Pending(req(12, 2), long_prompt, "cmpl-test"))  # its prompt ends past column 10: it joins
    loop.submit(Pending(req(3, 8), late, "cmpl-test"))  # 8 new tokens do not fit from column 10 on
    loop.submit(Pending(req(3, 2), short, "cmpl-test"))
    loop.submit(Pending(req(20, 1), never, "cmpl-test"))
    assert await result(never) == Failed(400, "never fits")  # refused at once, never queued
    engine.tick.release()  # the step at column 10: the long prompt joins all the same (the engine reframes)
    assert isinstance(await result(long_prompt), Done)
    assert delivered(first) == [Step([7, 8])]  # the first is still running: a step, no answer
    engine.tick.release()  # column 11: the short one joins, passing the one that does not fit
    assert isinstance(await result(short), Done)
    assert engine.joined == [(10, 1), (11, 2)] and engine.batches == [1]
    engine.finish.set()
    engine.tick.release()
    while isinstance(event := await result(first), Step):
        pass
    assert isinstance(event, Done)
    assert isinstance(await result(late), Done)  # in the next batch, from column 0
    assert engine.batches == [1, 1]
    loop.close()
    thread.join(60)
    assert not thread.is_alive()


async def test_a_client_that_leaves_is_dropped_from_the_queue_or_stopped_at_the_next_step():
    engine = ScriptedEngine(["join"])
    counted = metrics()
    loop = EngineLoop(engine, max_batch=2, max_len=16, metrics=counted, idle_seconds=5)
    aio = asyncio.get_running_loop()
    running = Pending(req(3, 12), Sink(aio, stream=True), "cmpl-test")
    waiting = Pending(req(12, 2), Sink(aio, stream=False), "cmpl-test")  # it could join at column 12
    loop.submit(running)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert await result(running.sink) == Step([7, 8])
    loop.submit(waiting)
    loop.cancel(waiting)
    loop.cancel(running)
    loop.cancel(running)  # a second disconnect notice changes nothing
    for _ in range(3):  # columns 10, 11, 12
        engine.tick.release()
    while len(engine.cancelled) < 3:
        await asyncio.sleep(0.01)
    assert engine.cancelled == [[0], [], []]  # the running one is stopped at the next boundary, once
    assert engine.joined == []  # the one that left the queue never runs
    engine.finish.set()
    engine.tick.release()
    loop.close()
    thread.join(60)
    assert delivered(running.sink) == [] and delivered(waiting.sink) == []  # nothing after they left
    assert counted.m.get("shard_requests", outcome="cancelled")._value.get() == 2
    assert counted.m.get("shard_requests", outcome="completed")._value.get() == 0


def _raises_runtime_error(run) -> None:
    with pytest.raises(RuntimeError):
        run()


async def test_a_lost_group_fails_running_and_waiting_requests_and_refuses_new_ones():
    engine = ScriptedEngine(["block"])
    loop = EngineLoop(engine, max_batch=1, max_len=64, metrics=metrics(), idle_seconds=5)
    aio = asyncio.get_running_loop()
    running, waiting = Sink(aio, stream=True), Sink(aio, stream=False)
    loop.submit(Pending(req(3, 4), running, "cmpl-test"))
    thread = threading.Thread(target=_raises_runtime_error, args=(loop.run,))
    thread.start()
    while not engine.batches:
        await asyncio.sleep(0.01)
    loop.submit(Pending(req(3, 4), waiting, "cmpl-test"))
    loop.fail_all("rank 1 has sent no heartbeat for 5.0 s (dead or hung)")  # as the health monitor does
    for sink in (running, waiting):
        assert await result(sink) == Failed(503, "the group failed: rank 1 has sent no heartbeat for 5.0 s "
                                                 "(dead or hung)")
    with pytest.raises(Unavailable, match="no heartbeat"):
        loop.submit(Pending(req(3, 4), Sink(aio, stream=False), "cmpl-test"))
    engine.release.set()  # the stuck collective finally errors: nothing more to tell anyone
    thread.join(60)
    assert not engine.shut  # never talk to a broken group


async def test_a_failing_collective_fails_the_batch_with_its_error():
    engine = ScriptedEngine([RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")])
    loop = EngineLoop(engine, max_batch=4, max_len=64, metrics=metrics(), idle_seconds=5)
    sink = Sink(asyncio.get_running_loop(), stream=False)
    loop.submit(Pending(req(3, 4), sink, "cmpl-test"))
    thread = threading.Thread(target=_raises_runtime_error, args=(loop.run,))
    thread.start()
    assert await result(sink) == Failed(503, "the group failed: RuntimeError: [gloo] Connection closed by peer "
                                             "[127.0.0.1]:1234")
    thread.join(60)


async def test_a_full_queue_says_try_later_and_a_closing_server_says_so():
    loop = EngineLoop(ScriptedEngine([]), max_batch=4, max_len=64, metrics=metrics(), idle_seconds=5, max_waiting=1)
    aio = asyncio.get_running_loop()
    loop.submit(Pending(req(3, 4), Sink(aio, stream=False), "cmpl-test"))
    with pytest.raises(Unavailable, match="1 requests are already waiting") as info:
        loop.submit(Pending(req(3, 4), Sink(aio, stream=False), "cmpl-test"))
    assert info.value.status == 429
    loop.close()
    with pytest.raises(Unavailable, match="shutting down"):
        loop.submit(Pending(req(3, 4), Sink(aio, stream=False), "cmpl-test"))


def value(metrics: RankMetrics, name: str, **labels: str) -> float:
    return metrics.m.get(name, **labels)._value.get()


async def until(what: str, check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_running_requests_and_the_kv_cache_use_are_gauged_at_every_step():
    engine = ScriptedEngine(["join"])
    counted = metrics()  # maxBatchSize 4 x maxModelLen 64
    loop = EngineLoop(engine, max_batch=2, max_len=16, metrics=counted, idle_seconds=5)
    aio = asyncio.get_running_loop()
    first = Pending(req(3, 12), Sink(aio, stream=True), "cmpl-first")
    joiner = Pending(req(5, 2), Sink(aio, stream=False), "cmpl-joiner")
    assert (value(counted, "shard_kv_cache_capacity_rows"), value(counted, "shard_kv_cache_capacity_tokens")) == \
        (4, 256)
    loop.submit(first)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert await result(first.sink) == Step([7, 8])
    # its prompt and its tokens so far (before the step, its prompt alone)
    await until("its first step gauged", lambda: value(counted, "shard_kv_cache_used_tokens") == 3 + 2)
    assert value(counted, "shard_requests_running") == 1
    loop.submit(joiner)
    assert value(counted, "shard_requests_waiting") == 1
    engine.tick.release()  # it joins at column 10 and takes its tokens
    assert isinstance(await result(joiner.sink), Done)
    # set in the step that answered it, before its answer
    assert (value(counted, "shard_requests_running"), value(counted, "shard_requests_waiting"),
            value(counted, "shard_kv_cache_used_tokens")) == (2, 0, 3 + 2 + 5 + 2)
    engine.finish.set()
    engine.tick.release()
    while isinstance(event := await result(first.sink), Step):
        pass
    assert isinstance(event, Done)
    await until("nothing running", lambda: value(counted, "shard_requests_running") == 0)
    assert value(counted, "shard_kv_cache_used_tokens") == 0
    # two completed requests of two tokens each: one time per output token each
    assert counted.m.get("shard_time_per_output_token_seconds")._sum.get() >= 0
    text = counted.exposition(None, ready=True).decode()
    assert "shard_time_per_output_token_seconds_count{" in text and "_created" not in text
    assert [line.rsplit(" ", 1)[1] for line in text.splitlines()
            if line.startswith("shard_time_per_output_token_seconds_count")] == ["2.0"]
    loop.close()
    thread.join(60)


REQUEST_LINE = re.compile(r"\[shard_worker rank 0\] request (\S+): prompt (\d+) tokens, generated (\d+), "
                          r"TTFT (-|[\d.]+ s), total [\d.]+ s, finish (\w+)")


async def test_every_queued_request_is_logged_once_when_it_ends_and_throughput_while_busy(capsys):
    engine = ScriptedEngine(["one fails", "join"])
    loop = EngineLoop(engine, max_batch=3, max_len=64, metrics=metrics(), idle_seconds=0.05)
    loop.throughput = Throughput(period=0.0)  # a line at every chance
    aio = asyncio.get_running_loop()
    batch = [Pending(req(3, 4), Sink(aio, stream=False), f"cmpl-{i}") for i in range(3)]
    for pending in batch:
        loop.submit(pending)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    for pending in batch:
        await result(pending.sink)
    running = Pending(req(3, 12), Sink(aio, stream=True), "cmpl-running")
    waiting = Pending(req(12, 2), Sink(aio, stream=False), "cmpl-waiting")
    loop.submit(running)
    assert await result(running.sink) == Step([7, 8])
    loop.submit(waiting)
    loop.cancel(waiting)
    loop.cancel(running)
    engine.finish.set()
    engine.tick.release()
    await until("the batch ended", lambda: not loop.running)
    loop.close()
    thread.join(60)
    err = capsys.readouterr().err
    ends = {m[1]: (int(m[2]), int(m[3]), m[4] != "-", m[5]) for m in REQUEST_LINE.finditer(err)}
    assert len(REQUEST_LINE.findall(err)) == len(ends) == 5  # one line each
    assert ends == {"cmpl-0": (3, 2, True, "length"), "cmpl-1": (3, 2, True, "length"),
                    "cmpl-2": (3, 2, True, "error"),  # it failed alone
                    "cmpl-running": (3, 2, True, "cancelled"), "cmpl-waiting": (12, 0, False, "cancelled")}
    throughput = re.findall(r"throughput: prompt ([\d.]+) tokens/s, generation ([\d.]+) tokens/s; "
                            r"running (\d) of 3 rows, waiting (\d); KV cache (\d+) of 192 tokens", err)
    assert throughput and any(float(prompt) > 0 and float(generated) > 0 for prompt, generated, *_ in throughput)
