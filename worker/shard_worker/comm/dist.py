"""Process groups of one sharded group, and the few collectives the model calls.

Ranks follow the Plan: `rank = stage * tp + tp_rank`. Each stage's TP ranks form a tensor-parallel
group (all-reduce, all-gather); activations move between stages point to point, TP rank j of one
stage to TP rank j of the next (every TP rank holds the same activations after its all-reduce, so
the pairs run side by side). Control messages (the leader's commands, reports, and the sampled
tokens the last stage returns to the first) go over the whole group, and the leader's per-step
message to its first-stage TP peers (who joins a continuous batch) over the stage's TP ranks, on
gloo even when the tensors use NCCL.

Every collective is timed and counted in the rank's `Accounting`: the model's forward calls these
methods explicitly, never through hooks. Tensor-backend operations are timed on the device's clock
(CUDA events on a GPU, where NCCL runs asynchronously), control messages on the host's. On CPUs, TP
ranks on one machine sum decode-sized tensors through shared memory (`shm.py`); otherwise gloo (or
NCCL) does it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shard_contract.env import SHM_DIR_ENV, SHM_ENV, WorkerEnv

from ..telemetry.accounting import Accounting
from . import shm

FORWARD_TAG, RETURN_TAG = 1, 2  # activations downstream (tensor backend); tokens back (control group)


class RendezvousError(RuntimeError):
    pass


@dataclass(frozen=True)
class Topology:
    """Who this rank is in its group and who its neighbours are. Pure."""

    rank: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def next(self) -> int | None:
        return None if self.is_last else self.rank_of(self.stage + 1, self.tp_rank)

    @property
    def prev(self) -> int | None:
        return None if self.is_first else self.rank_of(self.stage - 1, self.tp_rank)

    @property
    def first(self) -> int:
        """This rank's partner on the first stage (where sampled tokens return)."""
        return self.rank_of(0, self.tp_rank)

    @property
    def last(self) -> int:
        return self.rank_of(self.pp - 1, self.tp_rank)

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, j) for j in range(self.tp)]


# Messages up to this size are latency-bound (a decode step's hidden state is 4-16 KB). On gloo,
# torch's all_reduce of 8 KB measured 1.4-2.2 ms on our 2-core machines, a broadcast 0.2-0.3 ms:
# so small tensors are summed by having each TP rank broadcast its part and every rank adding the
# parts in rank order (bitwise the same result everywhere). Larger ones use the bandwidth-optimal
# ring of dist.all_reduce; NCCL always does.
SMALL_MESSAGE_BYTES = 64 * 1024
# TP ranks of one machine exchange small tensors through shared memory (see shm.py), which cut a
# TP=2 decode step by about 30% against the broadcasts above; SHARD_SHM_COLLECTIVES=0 turns it off
# (env.SHM_ENV), SHARD_SHM_DIR moves it (env.SHM_DIR_ENV).


class Comm:
    """The collectives of one rank, timed. `tp_group` None means the whole world (PP = 1)."""

    def __init__(self, topo: Topology, acct: Accounting, tp_group: Any = None, control_group: Any = None,
                 backend: str = "gloo", shm_group: shm.ShmGroup | None = None, stage_control_group: Any = None):
        self.topo, self.acct = topo, acct
        self.tp_group, self.control_group = tp_group, control_group
        # this stage's TP ranks for small CPU messages: the TP group itself on gloo
        self.stage_control_group = tp_group if backend == "gloo" else stage_control_group
        self.small_by_broadcast = backend == "gloo"
        self.host_sends = backend == "gloo"  # gloo's send and recv take host memory (GPU ranks on gloo stage)
        self.tp_ranks = topo.stage_ranks(topo.stage)
        self.shm = shm_group
        self.raw = False  # within `captured()`
        self.tape: list[tuple[str, int]] | None = None  # within `recording()`: the raw collectives issued

    @contextmanager
    def captured(self, on: bool = True) -> Iterator[None]:
        """Within (with `on`): the tensor-parallel collectives are the tensor backend's own calls,
        untimed and uncounted, so that a CUDA graph can capture them and torch.compile trace them
        (NCCL's can be captured; gloo's, on the host, cannot: `graphs.chosen_mode` keeps them out)."""
        before, self.raw = self.raw, on or self.raw
        try:
            yield
        finally:
            self.raw = before

    @contextmanager
    def recording(self) -> Iterator[list[tuple[str, int]]]:
        """Within: each raw collective's (op, bytes) in issue order, as `communicating` would count
        them: what a captured graph replays, to be counted at each replay (`Accounting.replayed`)."""
        before, self.tape = self.tape, []
        try:
            yield self.tape
        finally:
            self.tape = before

    # ------------------------------------------------------------ tensor parallel
    def _parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's `t`, in TP rank order, by one broadcast from each."""
        parts = []
        for src in self.tp_ranks:
            part = t if src == self.topo.rank else torch.empty_like(t)
            dist.broadcast(part, src=src, group=self.tp_group)
            parts.append(part)
        return parts

    def _small(self, t: torch.Tensor) -> bool:
        return self.small_by_broadcast and t.numel() * t.element_size() <= SMALL_MESSAGE_BYTES

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` in place over this stage's TP ranks."""
        if self.topo.tp == 1:
            return
        if self.raw:
            if self.tape is not None:
                self.tape.append(("all_reduce", t.numel() * t.element_size()))
            dist.all_reduce(t, group=self.tp_group)
            return
        with self.acct.communicating("all_reduce", t.numel() * t.element_size()):
            if self.shm is not None and self.shm.fits(t):
                self.shm.all_reduce(t)
            elif self._small(t):
                parts = self._parts(t.contiguous())
                total = parts[0].clone()
                for part in parts[1:]:
                    total += part
                t.copy_(total)
            else:
                dist.all_reduce(t, group=self.tp_group)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every TP rank's `t` along the last dimension, in TP rank order."""
        if self.topo.tp == 1:
            return t
        t = t.contiguous()
        if self.raw:
            if self.tape is not None:
                self.tape.append(("all_gather", t.numel() * t.element_size() * self.topo.tp))
            out = torch.empty((self.topo.tp, *t.shape), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t, group=self.tp_group)
            return torch.cat(out.unbind(0), dim=-1)
        with self.acct.communicating("all_gather", t.numel() * t.element_size() * self.topo.tp):
            if self.shm is not None and self.shm.fits(t):
                return self.shm.all_gather(t)
            if self._small(t):
                parts = self._parts(t)
            else:
                parts = [torch.empty_like(t) for _ in range(self.topo.tp)]
                dist.all_gather(parts, t, group=self.tp_group)
            return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------ pipeline
    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Pending:
        with self.acct.communicating("send", t.numel() * t.element_size()):
            if self.host_sends and t.device.type != "cpu":
                t = t.to("cpu")  # gloo sends host memory: a GPU's tensor goes through the host
            work = dist.isend(t, dst, tag=tag)
        return Pending(self, work, t)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Blocking receive; the wait counts as idle (it is the upstream stage's compute)."""
        self.acct.comm("recv", t.numel() * t.element_size(), 0.0)
        staged = torch.empty_like(t, device="cpu") if self.host_sends and t.device.type != "cpu" else t
        with self.acct.waiting():
            dist.recv(staged, src, tag=tag)
        if staged is not t:
            t.copy_(staged)
        return t

    # ------------------------------------------------------------ control (gloo, CPU tensors)
    def isend_control(self, t: torch.Tensor, dst: int) -> Pending:
        """Send a small tensor to `dst` over the control group (gloo, on the CPU, whatever the
        tensor backend), as one contiguous CPU copy."""
        t = t.detach().to("cpu").contiguous()  # gloo sends CPU memory; a sliced view is not one buffer
        with self.acct.communicating("send", t.numel() * t.element_size(), host=True):
            work = dist.isend(t, dst, group=self.control_group, tag=RETURN_TAG)
        return Pending(self, work, t, host=True)

    def recv_control(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Blocking receive of a CPU tensor from `src` over the control group; the wait is idle."""
        self.acct.comm("recv", t.numel() * t.element_size(), 0.0)
        with self.acct.waiting(host=True):
            dist.recv(t, src, group=self.control_group, tag=RETURN_TAG)
        return t

    def broadcast_json(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank (others pass None). JSON bytes, never pickle."""
        data = json.dumps(obj).encode() if self.topo.is_leader else b""
        buf = self._broadcast_bytes(data, 0, self.control_group, self._broadcast_size)
        return json.loads(bytes(buf.numpy())) if buf.numel() else None

    def broadcast_in_stage(self, obj: Any = None) -> Any:
        """This stage's first TP rank's `obj` on each of its TP peers (JSON; the others pass None).
        A falsy `obj` arrives as None after one size exchange only (through shared memory where
        the peers have it): cheap enough to call at every decode step."""
        source = self.tp_ranks[0]
        data = json.dumps(obj).encode() if obj and self.topo.rank == source else b""
        buf = self._broadcast_bytes(data, source, self.stage_control_group, self._stage_size)
        return json.loads(bytes(buf.numpy())) if buf.numel() else None

    def _broadcast_size(self, size: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        dist.broadcast(size, src=src, group=group)
        return size

    def _stage_size(self, size: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        if self.shm is None:
            return self._broadcast_size(size, src, group)
        return self.shm.all_gather(size)[:1]  # every peer's part; the source's comes first

    def _broadcast_bytes(self, data: bytes, src: int, group: Any, exchange_size) -> torch.Tensor:
        start = time.perf_counter()
        size = exchange_size(torch.tensor([len(data)], dtype=torch.int64), src, group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data \
            else torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, src=src, group=group)
        self.acct.comm("broadcast", buf.numel() + 8, time.perf_counter() - start)  # gloo: the host waits
        return buf

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank of the group (over the control group)."""
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return bool(t.item())

    def gather_json(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on the leader (None elsewhere)."""
        start = time.perf_counter()
        world = self.topo.world
        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, size, group=self.control_group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if self.topo.is_leader else None
        dist.gather(buf, bufs, dst=0, group=self.control_group)
        self.acct.comm("gather", longest, time.perf_counter() - start)
        if bufs is None:
            return None
        return [json.loads(bytes(b[:int(s.item())].numpy())) for b, s in zip(bufs, sizes, strict=True)]


class Pending:
    """An outstanding isend: its tensor stays alive until `wait`. `host`: a control message (gloo),
    whose wait the host clock times."""

    def __init__(self, comm: Comm, work: Any, tensor: torch.Tensor, host: bool = False):
        self.comm, self.work, self.host = comm, work, host
        self.tensor: torch.Tensor | None = tensor

    def wait(self) -> None:
        if self.work is None:
            return
        with self.comm.acct.communicating("send", 0, host=self.host):
            self.work.wait()
        self.work = self.tensor = None


def backend_for(env: WorkerEnv, device: torch.device) -> str:
    if env.backend != "auto":
        return env.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_comm(env: WorkerEnv, topo: Topology, device: torch.device, acct: Accounting) -> Comm:
    """Join the group at MASTER_ADDR:MASTER_PORT and build the TP and control groups.

    Fails with `RendezvousError` naming the address when the group does not assemble within
    SHARD_RENDEZVOUS_TIMEOUT seconds. The same timeout bounds every later collective, so a leader
    with nothing to do must keep its followers busy (the engine's `heartbeat` command).
    """
    backend = backend_for(env, device)
    timeout = timedelta(seconds=env.rendezvous_timeout)
    where = f"{env.master_addr}:{env.master_port}"
    listener = store_listener(env) if env.rank == 0 else None
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                              timeout=timeout, wait_for_workers=True, master_listen_fd=listener)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
    except (RuntimeError, TimeoutError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RendezvousError(
            f"rank {env.rank} of {env.world_size}: the group did not assemble at {where} "
            f"(MASTER_ADDR:MASTER_PORT) within {env.rendezvous_timeout}s: {first_line}") from None
    tp_group = _stage_group(topo) if topo.pp > 1 and topo.tp > 1 else None
    control = dist.new_group(list(range(topo.world)), backend="gloo") if backend != "gloo" else None
    # the first stage's per-step message is a CPU tensor, which NCCL cannot carry
    stage_control = _stage_group(topo, "gloo") if backend != "gloo" and topo.tp > 1 else None
    shm_group = _shared_memory_group(topo, tp_group, env.rendezvous_timeout) if backend == "gloo" else None
    return Comm(topo, acct, tp_group=tp_group, control_group=control, backend=backend, shm_group=shm_group,
                stage_control_group=stage_control)


def store_listener(env: WorkerEnv) -> int:
    """A socket listening on the one address of rank 0 the group uses (SHARD_BIND_ADDR, else what
    MASTER_ADDR resolves to), as a file descriptor for the store's server to own and close.

    Given a host name alone, torch's TCPStore server listens on every address of the machine; the
    store takes anything written to it, so it must be reachable by the group's ranks only.
    """
    host = env.bind_addr or env.master_addr
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, env.master_port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a previous group's TIME_WAITs
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
    except OSError as err:
        raise RendezvousError(f"rank 0 cannot listen on {host}:{env.master_port} for the group's store "
                              f"(SHARD_BIND_ADDR or MASTER_ADDR, and MASTER_PORT): {err}") from None
    return sock.detach()


def _stage_group(topo: Topology, backend: str | None = None) -> Any:
    """A group of this stage's TP ranks (every rank creates every stage's group, in the same order)."""
    own = None
    for stage in range(topo.pp):
        group = dist.new_group(topo.stage_ranks(stage), backend=backend)
        if stage == topo.stage:
            own = group
    return own


def _shared_memory_group(topo: Topology, tp_group: Any, timeout: float) -> shm.ShmGroup | None:
    """Shared-memory collectives for this stage's TP ranks when they share a machine (local
    processes, not separate pods), else None. Every TP rank takes part and all agree."""
    if topo.tp == 1:
        return None
    directory = os.environ.get(SHM_DIR_ENV, shm.SHM_DIR)
    wanted = shm.supported(directory) and os.environ.get(SHM_ENV, "1") != "0"
    leader = topo.stage_ranks(topo.stage)[0]
    path = shm.ShmGroup.create(topo.tp, directory) if wanted and topo.rank == leader else ""
    name = torch.zeros(256, dtype=torch.uint8)  # the leader's file name, to every TP peer
    name[:len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
    dist.broadcast(name, src=leader, group=tp_group)
    path = bytes(name[name > 0].tolist()).decode()
    # the leader's buffer, in this rank's own shared-memory directory (a pod sees only its own)
    mine = bool(path) and os.path.dirname(path) == directory and os.path.exists(path)
    usable = torch.tensor([int(wanted and mine)])
    dist.all_reduce(usable, op=dist.ReduceOp.MIN, group=tp_group)
    group = shm.ShmGroup(path, topo.tp, topo.tp_rank, timeout) if usable.item() else None
    dist.barrier(group=tp_group)  # every peer has mapped it (or given up): the name can go
    if path and topo.rank == leader:
        os.unlink(path)
    return group


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
