"""Tensor-parallel blocks: each node's devices cut into groups of `tp`, and the sets of blocks a
replica's stages are worth trying on. Pure."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from .inventory import Device


@dataclass(frozen=True, eq=False)
class Block:
    """A tensor-parallel group's devices: all on one node, as big and fast as the smallest.

    Compared by identity: a block is one physical set of devices."""

    node: str
    devices: tuple[Device, ...]
    memory: int
    speed: float
    kind: str
    order: tuple  # (node, first device index): the stable tie-breaker
    host_gbps: float = 0.0  # copies from host memory and reads of the files (offload)
    file_gbps: float = 0.0

    @classmethod
    def of(cls, node: str, devices: tuple[Device, ...]) -> Block:
        return cls(node=node, devices=devices, memory=min(d.memory_bytes for d in devices),
                   speed=min(d.speed for d in devices), kind=devices[0].kind, order=(node, devices[0].index),
                   host_gbps=min(d.host_gbps for d in devices), file_gbps=min(d.file_gbps for d in devices))

    @property
    def shape(self) -> tuple:
        """Blocks with equal shape are interchangeable."""
        return (self.memory, self.speed, self.kind, self.host_gbps, self.file_gbps)


def make_blocks(devices: Iterable[Device], tp: int) -> list[Block]:
    """Cut each node's devices into TP groups, largest and fastest first, so small and big
    devices are not mixed in one group when the node has enough of each."""
    by_node: dict[str, list[Device]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d)
    blocks = []
    for node in sorted(by_node):
        devs = sorted(by_node[node], key=lambda d: (-d.memory_bytes, -d.speed, d.index))
        for start in range(0, len(devs) - tp + 1, tp):
            blocks.append(Block.of(node, tuple(devs[start:start + tp])))
    return blocks


def arrangements(chosen: list[Block]) -> Iterable[list[Block]]:
    """Stage orders worth trying: every choice of block shape for the first and the last stage
    (they also hold the embeddings and the LM head), the rest fastest first."""
    if len(chosen) == 1:
        yield chosen
        return
    shapes = sorted({b.shape for b in chosen}, key=lambda s: (-s[0], -s[1]))
    for first, last in itertools.product(shapes, repeat=2):
        rest = list(chosen)
        head = next((b for b in rest if b.shape == first), None)
        if head is None:
            continue
        rest.remove(head)
        tail = next((b for b in reversed(rest) if b.shape == last), None)
        if tail is None:
            continue
        rest.remove(tail)
        rest.sort(key=lambda b: (-b.speed, -b.memory, b.order))
        yield [head, *rest, tail]


class BlockPool:
    """The blocks of one TP degree, grouped by shape, with the ones already taken by a replica."""

    def __init__(self, blocks: list[Block]):
        self.by_shape: dict[tuple, list[Block]] = {}
        for b in sorted(blocks, key=lambda b: b.order):
            self.by_shape.setdefault(b.shape, []).append(b)
        self.fastest = sorted(self.by_shape, key=lambda s: (-s[1], -s[0]))
        self.roomiest = sorted(self.by_shape, key=lambda s: (-s[0], -s[1]))
        self.taken: set[int] = set()

    def take(self, shapes: list[tuple], count: int, used_nodes: set[str]) -> list[Block] | None:
        """The first `count` free blocks in this shape order; within a shape, nodes no other
        replica uses come first (replicas spread), then node order."""
        chosen: list[Block] = []
        for shape in shapes:
            free = [b for b in self.by_shape[shape] if id(b) not in self.taken]
            free.sort(key=lambda b: b.node in used_nodes)  # stable: keeps node order
            chosen.extend(free[:count - len(chosen)])
            if len(chosen) == count:
                return chosen
        return None

    def selections(self, count: int, used_nodes: set[str]) -> Iterable[list[Block]]:
        """Sets of `count` blocks worth trying for one group: the fastest, the roomiest, and all
        of one shape (a homogeneous group) for every shape."""
        candidates = [self.take(self.fastest, count, used_nodes), self.take(self.roomiest, count, used_nodes)]
        candidates += [self.take([shape], count, used_nodes) for shape in self.fastest]
        seen = set()
        for chosen in candidates:
            if chosen is None:
                continue
            key = tuple(sorted(b.order for b in chosen))
            if key not in seen:
                seen.add(key)
                yield chosen


