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
Secret the operator mounts; both make a new key for each incarnation of the group, so a record
sealed in one incarnation does not open in the next). Inside the seal a record carries its rank,
the *incarnation* of its process (random, drawn at each process start) and a counter that rises
by one each beat. A rank's records count as liveness only while they are new: the first record
seen of a rank pins its incarnation, and after that only a record of that incarnation with a
higher counter is believed. A record whose seal does not verify, that sits under another rank's
key, that comes from another incarnation or whose counter is not above the last one believed (an
old record written again) is ignored, counted, and never counted as a beat.

Nobody without the key can claim that a rank failed, nor keep a dead rank looking alive. What a
stranger who reaches the store can still do is overwrite the keys (the store has no access
control): a rank whose key has held such records within the stale window is reported as
*tampered* (not ready, its liveness unknown) rather than dead, so overwriting cannot make a live
group lost. The residual risk, a stranger who writes a rank's latest record back within
milliseconds of each true write, is why the rendezvous port must be reachable only by the group
(the operator's NetworkPolicy; loopback for `shardctl run`): docs/operations.md, the trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
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
    seq: int  # rises by one each beat of the same incarnation
    # loading | ready | failed (its own fault, e.g. a bad checkpoint) | broken (the group is lost: a
    # collective failed, or its engine raised)
    state: str
    problems: list[str] = field(default_factory=list)
    error: str = ""
    report: dict[str, Any] | None = None
    progress: tuple[int, int] | None = None  # bytes of its tensors loaded, and in all
    incarnation: str = ""  # this start of the rank's process (random)

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
        fields = json.loads(body)
        record = cls(**fields) if isinstance(fields, dict) else None
        if record is None or type(record.seq) is not int or not isinstance(record.incarnation, str):
            raise ForgedRecord(f"a sealed record under rank {rank}'s key is malformed")
        if record.rank != rank:
            raise ForgedRecord(f"rank {record.rank}'s record was written under rank {rank}'s key")
        return record


def new_incarnation() -> str:
    return secrets.token_hex(8)


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
    """Pure judge of a group's records over time: feed it what the store held and when.

    `incarnations` pins ranks whose incarnation is known beforehand (a rank's own)."""

    def __init__(self, world_size: int, stale_seconds: float = STALE_SECONDS,
                 incarnations: dict[int, str] | None = None):
        self.world, self.stale = world_size, stale_seconds
        self.records: dict[int, Record] = {}
        self._pinned: dict[int, str] = dict(incarnations or {})
        self._heard: dict[int, float] = {}  # rank -> when its newest believed record was first seen
        self._tampered: dict[int, float] = {}  # rank -> when a record under its key was last ignored
        self._store_error = ""
        self._lost = ""  # set once: a dead group never heals

    def judge(self, record: Record) -> str | None:
        """Why `record` must not be believed (None: it is new). An equal record is not new either:
        the reason is empty then (the store still holds it; nobody need be told)."""
        rank = record.rank
        pinned = self._pinned.get(rank)
        if pinned is not None and record.incarnation != pinned:
            return f"rank {rank}'s record comes from another start of that rank ({record.incarnation or 'none'})"
        last = self.records.get(rank)
        if last is not None and record.seq <= last.seq:
            return "" if record == last else \
                f"rank {rank}'s record number {record.seq} was written again after number {last.seq}"
        return None

    def tampered(self, rank: int, now: float) -> None:
        """Someone wrote a record under rank `rank`'s key that was ignored (forged or replayed)."""
        self._tampered[rank] = now

    def observe(self, records: dict[int, Record], now: float, store_error: str = "") -> list[str]:
        """Take what the store held at `now`; the reasons each record was ignored for (an unchanged
        record is ignored silently)."""
        self._store_error = store_error
        rejected = []
        for rank, record in records.items():
            why = self.judge(record)
            if why is None:
                self._pinned.setdefault(rank, record.incarnation)
                self.records[rank] = record
                self._heard[rank] = now
            elif why:
                rejected.append(why)
                self.tampered(rank, now)
        if not self._lost:
            self._lost = self._loss(now)
        return rejected

    def _silent(self, now: float) -> list[tuple[int, float, bool]]:
        """(rank, seconds since its last believed record, whether its key was tampered with since)
        of each rank silent for longer than the stale window."""
        return [(rank, now - since, self._tampered.get(rank, -1.0) >= since)
                for rank, since in sorted(self._heard.items()) if now - since > self.stale]

    def _loss(self, now: float) -> str:
        failed = [r for r in self.records.values() if r.state == "failed"]
        if failed:
            return f"rank {failed[0].rank} failed: {failed[0].error}"
        if self._store_error:
            return self._store_error
        for rank, silent, tampered in self._silent(now):
            if not tampered:
                return f"rank {rank} has sent no heartbeat for {silent:.1f} s (dead or hung)"
        return ""

    def verdict(self, now: float) -> Verdict:
        lost = self._lost or self._loss(now)
        if not lost:  # a rank whose collective failed is a victim: name it only until the cause shows
            broken = [r for r in self.records.values() if r.state == "broken"]
            lost = f"rank {broken[0].rank} lost its group: {broken[0].error}" if broken else ""
        silent = {rank for rank, _, _ in self._silent(now)}
        alive = {rank: rank not in silent and (not lost or self.records[rank].state not in ("failed", "broken"))
                 for rank in self._heard}
        if lost:
            return Verdict(False, False, lost, alive)
        if silent:  # tampered with, else it would be lost: its liveness is unknown
            rank, seconds, _ = self._silent(now)[0]
            return Verdict(True, False, f"rank {rank}'s heartbeat records are being overwritten by someone without "
                                        f"the group's key; its last true record is {seconds:.1f} s old", alive)
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

    `record(seq)` builds this rank's current record (given this process's incarnation here), sealed
    with `key`; `on_lost(reason)` is called
    once when the group is found dead, `on_rejected(reason)` for each record ignored (counted in
    `rejected`). The store appears when rank 0 creates it during rendezvous; until then the
    thread keeps trying to connect.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, record: Callable[[int], Record],
                 key: bytes, on_lost: Callable[[str], None] | None = None,
                 on_rejected: Callable[[str], None] | None = None, period: float = HEARTBEAT_SECONDS,
                 stale: float = STALE_SECONDS):
        self.host, self.port, self.rank, self.key = host, port, rank, key
        self.incarnation = new_incarnation()  # this process's start
        self.monitor = GroupMonitor(world_size, stale, {rank: self.incarnation})
        self.record, self.on_lost, self.on_rejected, self.period = record, on_lost, on_rejected, period
        self.rejected = 0
        self._read: dict[int, bytes] = {}  # rank -> its value last read
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
            records: dict[int, Record] = {}
            error, now = "", time.monotonic()
            try:
                mine = self.record(seq)
                mine.incarnation = self.incarnation
                sealed = mine.seal(self.key)
                store.set(keys[self.rank], sealed)
                present += [r for r in keys if r not in present and store.check([keys[r]])]
                values = store.multi_get([keys[r] for r in present]) if present else []
                now = time.monotonic()
                for r, value in zip(present, values, strict=True):
                    if r == self.rank:  # its own beat is known first-hand; what its key holds is checked
                        self._own(bytes(value), sealed)
                    elif (rec := self._open(r, bytes(value), now)) is not None:
                        records[r] = rec
                records[self.rank] = mine
            except (RuntimeError, OSError) as err:  # DistStoreError is a RuntimeError
                error = (f"cannot reach the group's store at {self.host}:{self.port} (rank 0's process): "
                         f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
            with self.lock:
                for why in self.monitor.observe(records, now, error):
                    self._reject(why)
                verdict = self.monitor.verdict(time.monotonic())
            if not verdict.alive and not reported and self.on_lost is not None:
                reported = True
                self.on_lost(verdict.reason)
            self._stop.wait(self.period)

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.on_rejected is not None:
            self.on_rejected(reason)

    def _own(self, value: bytes, sealed: bytes) -> None:
        """Count (once per value) a record under this rank's key that it did not just write."""
        if value != sealed and self._read.get(self.rank) != value:
            self._reject(f"rank {self.rank}'s key held a record other than the one it wrote last")
        self._read[self.rank] = value

    def _open(self, rank: int, value: bytes, now: float) -> Record | None:
        """Rank `rank`'s record in `value`, or None when its seal does not verify or the value is
        the one read last time (judged once: neither a beat nor counted again). Whether a record
        that opens is new is the monitor's judgement."""
        if self._read.get(rank) == value:
            return None
        try:
            record: Record | None = Record.open(value, self.key, rank)
        except (ValueError, TypeError) as err:  # ForgedRecord is a ValueError
            record = None
            self._reject(str(err))
            with self.lock:
                self.monitor.tampered(rank, now)
        self._read[rank] = value
        return record
