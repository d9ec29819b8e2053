"""A communicator with NCCL's point-to-point semantics, for the ranks of a group run as threads.

What NCCL may do, and gloo (the CPU tests' backend) does not: a send completes only together with
the matching receive (a rendezvous: nothing is buffered); sends and receives between two ranks
match in the order they were posted, whatever their tags; and all of a rank's point-to-point
operations (one communicator and one stream when the group is created with `device_id`) run in
the order they were posted, each waiting for the one before. Here the tensor channel is exactly
that: each rank's operations form one queue, and the operation at the head of a rank's queue
completes with the operation at the head of its peer's queue when they match (a send and a
receive between the two). `isend` queues and returns; `recv` queues and blocks the rank's thread.

The control channel (the gloo control group: commands, reports, returned tokens) is what gloo is:
buffered, tagged, in order per sender.

A deadlock is found at once: when every rank still running waits on the fabric, no operation can
ever complete, and every waiter raises `Deadlock` with what each rank waits for.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from shard_worker.comm.dist import Comm, Pending, Topology


class Deadlock(RuntimeError):
    pass


@dataclass(eq=False)
class Op:
    rank: int
    peer: int
    send: bool
    tensor: torch.Tensor
    number: int  # the rank's n-th tensor-channel operation
    done: bool = False

    def __str__(self) -> str:
        what = f"send to {self.peer}" if self.send else f"receive from {self.peer}"
        return f"#{self.number} {what} ({str(self.tensor.dtype).removeprefix('torch.')}{list(self.tensor.shape)})"


@dataclass
class Fabric:
    world: int
    running: int = 0  # ranks whose threads have not left
    waiting: dict[int, Any] = field(default_factory=dict)  # rank -> what it waits for (a predicate)
    broken: str = ""
    cv: threading.Condition = field(default_factory=threading.Condition)
    queues: dict[int, deque[Op]] = field(default_factory=lambda: defaultdict(deque))
    posted: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    mail: dict[tuple, deque] = field(default_factory=lambda: defaultdict(deque))

    def connect(self, env, topo: Topology, device, acct) -> RendezvousComm:
        """`Worker.start`'s `connect`: this rank's communicator."""
        return RendezvousComm(self, topo, acct)

    # ------------------------------------------------------------ ranks
    def join(self) -> None:
        with self.cv:
            self.running += 1

    def leave(self, rank: int) -> None:
        with self.cv:
            self.running -= 1
            self.cv.notify_all()

    def fail(self, why: str) -> None:
        with self.cv:
            self.broken = self.broken or why
            self.cv.notify_all()

    def heads(self) -> str:
        return "; ".join(f"rank {r}: {q[0]}" for r, q in sorted(self.queues.items()) if q) or "no operation queued"

    def _wait(self, rank: int, ready, what: str) -> Any:
        """Block rank `rank` until `ready()` is truthy (under the lock)."""
        self.waiting[rank] = ready
        try:
            while not (value := ready()):
                if self.broken:
                    raise Deadlock(self.broken)
                # every rank still running waits, and none of them can go on (a rank woken by a
                # match may not have run yet: its predicate is true then)
                if len(self.waiting) == self.running and not any(wait() for wait in self.waiting.values()):
                    self.broken = (f"deadlock: every rank waits ({', '.join(map(str, sorted(self.waiting)))}); "
                                   f"rank {rank} for {what}; queue heads: {self.heads()}")
                    self.cv.notify_all()
                    raise Deadlock(self.broken)
                self.cv.wait(5.0)
            return value
        finally:
            del self.waiting[rank]

    # ------------------------------------------------------------ tensor channel (NCCL)
    def post(self, rank: int, peer: int, send: bool, tensor: torch.Tensor) -> Op:
        with self.cv:
            self.posted[rank] += 1
            op = Op(rank, peer, send, tensor, self.posted[rank])
            self.queues[rank].append(op)
            self._match()
            self.cv.notify_all()
            return op

    def _match(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank, queue in list(self.queues.items()):
                if not queue or not queue[0].send:
                    continue
                send, other = queue[0], self.queues[queue[0].peer]
                if not other or other[0].send or other[0].peer != rank:
                    continue
                recv = other[0]
                if (send.tensor.shape, send.tensor.dtype) != (recv.tensor.shape, recv.tensor.dtype):
                    self.broken = f"mismatched pair: rank {rank} {send} against rank {recv.rank} {recv}"
                    return
                recv.tensor.copy_(send.tensor)  # read when it runs, as NCCL reads the send buffer
                queue.popleft()
                other.popleft()
                send.done = recv.done = True
                progress = True

    def complete(self, op: Op) -> None:
        with self.cv:
            self._wait(op.rank, lambda: op.done, str(op))

    # ------------------------------------------------------------ control channel (gloo)
    def put(self, key: tuple, value: Any) -> None:
        with self.cv:
            self.mail[key].append(value)
            self.cv.notify_all()

    def take(self, rank: int, key: tuple) -> Any:
        with self.cv:
            box = self.mail[key]
            self._wait(rank, lambda: bool(box), f"control message {key}")
            return box.popleft()


class _Work:
    def __init__(self, fabric: Fabric, op: Op):
        self.fabric, self.op = fabric, op

    def wait(self) -> None:
        self.fabric.complete(self.op)


class RendezvousComm(Comm):
    """`Comm` over a `Fabric`: the pipeline's tensors on the tensor channel, the rest on the
    control channel. Tensor parallelism is not modelled (TP = 1)."""

    def __init__(self, fabric: Fabric, topo: Topology, acct):
        assert topo.tp == 1, "the rendezvous fabric runs TP = 1 groups"
        super().__init__(topo, acct)
        self.fabric, self.rank = fabric, topo.rank

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Pending:
        return Pending(self, _Work(self.fabric, self.fabric.post(self.rank, dst, True, t)), t)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.fabric.complete(self.fabric.post(self.rank, src, False, t))
        return t

    def isend_control(self, t: torch.Tensor, dst: int) -> Pending:
        self.fabric.put(("tensor", self.rank, dst), t.detach().clone())
        return Pending(self, None, t)

    def recv_control(self, t: torch.Tensor, src: int) -> torch.Tensor:
        got = self.fabric.take(self.rank, ("tensor", src, self.rank))
        assert (got.shape, got.dtype) == (t.shape, t.dtype), (got.shape, got.dtype, t.shape, t.dtype)
        return t.copy_(got)

    def broadcast_json(self, obj: Any = None) -> Any:
        if self.topo.is_leader:
            for rank in range(1, self.topo.world):
                self.fabric.put(("json", rank), json.dumps(obj))
            return obj
        return json.loads(self.fabric.take(self.rank, ("json", self.rank)))

    def gather_json(self, obj: Any) -> list[Any] | None:
        if not self.topo.is_leader:
            self.fabric.put(("gather", self.rank), json.dumps(obj))
            return None
        return [obj] + [json.loads(self.fabric.take(0, ("gather", r))) for r in range(1, self.topo.world)]
