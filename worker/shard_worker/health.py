"""Is the whole group alive, and is it ready? Every rank answers the same way.

Each rank heartbeats into the group's rendezvous store (the TCPStore that rank 0 hosts at
MASTER_ADDR:MASTER_PORT, which every rank can already reach): once a second it writes a record of
its state, its memory check and its report (`RankReport`). Each rank also reads every other
rank's record, so any rank's `/health` knows the whole group, and the leader's `/v1/shards` shows
every rank's figures without stopping generation to gather them.

A rank whose record has not changed for `STALE_SECONDS` is dead or hung (a stopped process writes
nothing, a killed one neither); a store that cannot be reached means rank 0 is gone. Judging
uses only this process's clock (when did the sequence number last change), never a peer's.

The store takes whatever anyone who reaches it writes, so every record is sealed with an HMAC
(SHA-256) under the group's secret key (SHARD_GROUP_SECRET_FILE: a file `shardctl run` writes, a
Secret the operator mounts). A record whose seal does not verify, that sits under another rank's
key, or whose sequence number went backwards (an old record written again) is ignored and
counted: nobody without the key can claim that a rank failed, or keep a dead rank looking alive.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from shard_contract.plan import RankPlan
from shard_contract.units import human
from shard_contract.wire import ResidentBytes

HEARTBEAT_SECONDS = 1.0
STALE_SECONDS = 5.0  # a beat, a missed beat or two, and a busy machine: `/health` fails well within 10 s
STORE_TIMEOUT_SECONDS = 3.0
KEY_PREFIX = "shard/rank/"
MIN_KEY_BYTES = 16  # a group key shorter than 128 bits is refused

# How far measured weights + KV cache may exceed the plan's prediction before a rank is not
# ready: 10% (the worker's tests hold it within that) plus a little for tiny models, whose
# allocator noise is large next to their tensors.
MEMORY_TOLERANCE = 0.10
MEMORY_SLACK_BYTES = 8 * 2**20


def memory_problems(rank_plan: RankPlan, resident: ResidentBytes, budget_bytes: int | None = None) -> list[str]:
    """Why this rank's measured memory disagrees with its plan (empty when it agrees)."""
    problems = []
    predicted = rank_plan.predicted_bytes
    expected = predicted.weights + predicted.kv_cache + predicted.staging
    measured = resident.weights + resident.kv_cache + resident.staging
    if measured > expected * (1 + MEMORY_TOLERANCE) + MEMORY_SLACK_BYTES:
        problems.append(f"rank {rank_plan.rank} holds {human(measured)} of weights, KV cache and staging, more "
                        f"than the plan's {human(expected)} (+{MEMORY_TOLERANCE:.0%})")
    limits = [(rank_plan.capacity_bytes, f"its device's capacity ({rank_plan.device} on {rank_plan.node})")]
    if budget_bytes is not None:
        limits.append((budget_bytes, "its memory budget (SHARD_MEMORY_BUDGET)"))
    for limit, what in limits:
        if resident.total > limit:
            problems.append(f"rank {rank_plan.rank} holds {human(resident.total)} in all, more than {what}: "
                            f"{human(limit)}")
    return problems


@dataclass
class Record:
    """What one rank publishes each beat."""

    rank: int
    seq: int
    state: str  # loading | ready | failed (its own fault, e.g. a bad checkpoint) | broken (a collective failed)
    problems: list[str] = field(default_factory=list)
    error: str = ""
    report: dict[str, Any] | None = None
    progress: tuple[int, int] | None = None  # bytes of its tensors loaded, and in all

    def seal(self, key: bytes) -> bytes:
        """The record as stored: the hex HMAC-SHA256 of its JSON under `key`, a space, the JSON."""
        body = json.dumps(self.__dict__).encode()
        return hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b" " + body

    @classmethod
    def open(cls, data: bytes, key: bytes, rank: int) -> Record:
        """The record rank `rank`'s key held, if its seal verifies; else `ForgedRecord`."""
        mac, _, body = data.partition(b" ")
        if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).hexdigest().encode()):
            raise ForgedRecord(f"a record under rank {rank}'s key does not carry the group key's seal")
        record = cls(**json.loads(body))
        if record.rank != rank:
            raise ForgedRecord(f"rank {record.rank}'s record was written under rank {rank}'s key")
        return record


class ForgedRecord(ValueError):
    """A heartbeat record that was not written by a rank of this group, as it is."""


class GroupKeyError(ValueError):
    pass


def read_group_key(path: str | None) -> bytes:
    """The group's secret key from SHARD_GROUP_SECRET_FILE (raw bytes)."""
    if not path:
        raise GroupKeyError("SHARD_GROUP_SECRET_FILE is not set: a serving rank needs the group's secret key "
                            "to authenticate heartbeats (shardctl run and the operator provide one)")
    try:
        key = Path(path).read_bytes()
    except OSError as err:
        raise GroupKeyError(f"SHARD_GROUP_SECRET_FILE {path}: {err.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise GroupKeyError(f"SHARD_GROUP_SECRET_FILE {path}: the key has {len(key)} bytes; at least "
                            f"{MIN_KEY_BYTES} are needed")
    return key


@dataclass(frozen=True)
class Verdict:
    alive: bool
    ready: bool
    reason: str  # why not alive, or why not ready; empty when both
    ranks_alive: dict[int, bool]


class GroupMonitor:
    """Pure judge of a group's records over time: feed it what the store held and when."""

    def __init__(self, world_size: int, stale_seconds: float = STALE_SECONDS):
        self.world, self.stale = world_size, stale_seconds
        self.records: dict[int, Record] = {}
        self._changed: dict[int, tuple[int, float]] = {}  # rank -> (seq, when it was first seen)
        self._store_error = ""
        self._lost = ""  # set once: a dead group never heals

    def observe(self, records: dict[int, Record], now: float, store_error: str = "") -> None:
        self._store_error = store_error
        for rank, record in records.items():
            seen = self._changed.get(rank)
            if seen is None or seen[0] != record.seq:
                self._changed[rank] = (record.seq, now)
            self.records[rank] = record
        if not self._lost:
            self._lost = self._loss(now)

    def _loss(self, now: float) -> str:
        failed = [r for r in self.records.values() if r.state == "failed"]
        if failed:
            return f"rank {failed[0].rank} failed: {failed[0].error}"
        if self._store_error:
            return self._store_error
        for rank, (_, since) in sorted(self._changed.items()):
            if now - since > self.stale:
                return f"rank {rank} has sent no heartbeat for {now - since:.1f} s (dead or hung)"
        return ""

    def verdict(self, now: float) -> Verdict:
        lost = self._lost or self._loss(now)
        if not lost:  # a rank whose collective failed is a victim: name it only until the cause shows
            broken = [r for r in self.records.values() if r.state == "broken"]
            lost = f"rank {broken[0].rank} lost its group: {broken[0].error}" if broken else ""
        alive = {rank: not lost or (now - since <= self.stale and self.records[rank].state not in ("failed", "broken"))
                 for rank, (_, since) in self._changed.items()}
        if lost:
            return Verdict(False, False, lost, alive)
        waiting = [r for r in range(self.world) if r not in self.records or self.records[r].state != "ready"]
        if waiting:
            return Verdict(True, False, f"waiting for rank{'s' if len(waiting) > 1 else ''} "
                                        f"{', '.join(map(str, waiting))} to join and load", alive)
        problems = [p for r in sorted(self.records) for p in self.records[r].problems]
        if problems:
            return Verdict(True, False, "memory check failed: " + "; ".join(problems), alive)
        return Verdict(True, True, "", alive)


class Heartbeat:
    """The thread that publishes this rank's record and reads everyone's into a `GroupMonitor`.

    `record()` builds this rank's current record, sealed with `key`; `on_lost(reason)` is called
    once when the group is found dead, `on_rejected(reason)` for each record ignored (counted in
    `rejected`). The store appears when rank 0 creates it during rendezvous; until then the
    thread keeps trying to connect.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, record: Callable[[int], Record],
                 key: bytes, on_lost: Callable[[str], None] | None = None,
                 on_rejected: Callable[[str], None] | None = None, period: float = HEARTBEAT_SECONDS,
                 stale: float = STALE_SECONDS):
        self.host, self.port, self.rank, self.key = host, port, rank, key
        self.monitor = GroupMonitor(world_size, stale)
        self.record, self.on_lost, self.on_rejected, self.period = record, on_lost, on_rejected, period
        self.rejected = 0
        self._read: dict[int, tuple[bytes, Record | None]] = {}  # rank -> its value last read, opened
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._connected = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def verdict(self) -> Verdict:
        with self.lock:
            if not self._connected:
                return Verdict(True, False, "waiting for the group to assemble", {})
            return self.monitor.verdict(time.monotonic())

    def records(self) -> dict[int, Record]:
        with self.lock:
            return dict(self.monitor.records)

    def _listening(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=STORE_TIMEOUT_SECONDS):
                return True
        except OSError:
            return False

    def _connect(self) -> Any:
        import torch.distributed as dist

        while not self._stop.is_set():
            # Rank 0 creates the store at rendezvous. Probe first: the store's client logs a
            # stack trace for every connection it is refused.
            if self._listening():
                try:
                    return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                         timeout=timedelta(seconds=STORE_TIMEOUT_SECONDS))
                except (RuntimeError, OSError):
                    pass
            self._stop.wait(self.period)
        return None

    def _run(self) -> None:
        store = self._connect()
        if store is None:
            return
        self._connected = True
        seq, keys, reported = 0, {r: f"{KEY_PREFIX}{r}" for r in range(self.monitor.world)}, False
        present: list[int] = []
        while not self._stop.is_set():
            seq += 1
            records, error = {}, ""
            try:
                store.set(keys[self.rank], self.record(seq).seal(self.key))
                present += [r for r in keys if r not in present and store.check([keys[r]])]
                values = store.multi_get([keys[r] for r in present]) if present else []
                records = {r: rec for r, v in zip(present, values, strict=False) if (rec := self._open(r, bytes(v)))}
            except (RuntimeError, OSError) as err:  # DistStoreError is a RuntimeError
                error = (f"cannot reach the group's store at {self.host}:{self.port} (rank 0's process): "
                         f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
            with self.lock:
                self.monitor.observe(records, time.monotonic(), error)
                verdict = self.monitor.verdict(time.monotonic())
            if not verdict.alive and not reported and self.on_lost is not None:
                reported = True
                self.on_lost(verdict.reason)
            self._stop.wait(self.period)

    def _open(self, rank: int, value: bytes) -> Record | None:
        """Rank `rank`'s record in `value`, or None when it must be ignored. A value is judged once:
        read again unchanged, it gives the same answer and is not counted again."""
        last = self._read.get(rank)
        if last is not None and last[0] == value:
            return last[1]
        try:
            record = Record.open(value, self.key, rank)
            newest = self.monitor.records.get(rank)
            if newest is not None and record.seq < newest.seq:
                raise ForgedRecord(f"rank {rank}'s record number {record.seq} was written again after number "
                                   f"{newest.seq}")
        except (ValueError, TypeError) as err:  # ForgedRecord is a ValueError
            record = None
            self.rejected += 1
            if self.on_rejected is not None:
                self.on_rejected(str(err))
        self._read[rank] = (value, record)
        return record
