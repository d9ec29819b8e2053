"""Which pods a group's ranks run in, and what their messages cost over the transport that layout
gives them. Pure.

`spec.placement.podLayout`: `perRank` is one pod per rank (one GPU each); `perTensorGroup` is one
pod per tensor-parallel group (a pipeline stage, always on one node), holding its GPUs and running
one rank process per GPU. What a message between two ranks travels over follows from that:

| peers              | GPUs (NCCL)                                  | CPUs (gloo)                       |
|--------------------|----------------------------------------------|-----------------------------------|
| in one pod         | NVLink or PCIe peer-to-peer (CUDA IPC)       | shared memory (`shm.py`)          |
| pods of one node   | NCCL's network transport: to NCCL each pod   | gloo over TCP                     |
|                    | is a host of its own (own hostname, /dev/shm |                                   |
|                    | and IPC namespace), so sockets over the pod  |                                   |
|                    | network, no CUDA IPC                         |                                   |
| different nodes    | the network (sockets, or InfiniBand / RoCE   | gloo over TCP                     |
|                    | where pods reach it)                         |                                   |

The figures are latency floors of decode-sized messages (a few KB: a decode step's hidden state),
which dominate a decode step: one all-reduce or all-gather call, one pipeline send. GPU figures
are typical published NCCL latencies (not measured here: no GPU has run this code yet); CPU
figures were measured on this project's 2-core machines. All of them are settable
(`PlannerOptions.transport`, and the operator's `planner_options` setting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PER_RANK, PER_TENSOR_GROUP = "perRank", "perTensorGroup"
PodLayout = Literal["auto", "perRank", "perTensorGroup"]


def pod_layout(asked: str, kind: str, tp: int) -> str:
    """The layout of a group of `kind` devices at tensor degree `tp`. auto: a pod per tensor-parallel
    group on GPUs, where NCCL can then use NVLink between the group's ranks, which it cannot across
    pods; a pod per rank elsewhere (at TP=1 both are the same pods; CPU devices are the dev
    cluster's simulated GPUs, processes of one machine that share its memory whatever their pods)."""
    if asked != "auto":
        return asked
    return PER_TENSOR_GROUP if kind == "gpu" and tp > 1 else PER_RANK


def pod_ranks(ranks: list[int], tp: int, layout: str) -> list[list[int]]:
    """The ranks of each pod of a group, in rank order: one each, or each stage's tensor-parallel
    ranks together (rank = stage * tp + tp_rank, and a stage never spans nodes)."""
    size = tp if layout == PER_TENSOR_GROUP else 1
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


@dataclass(frozen=True)
class Transport:
    """Seconds of one call by device kind (`gpu`, `cpu`), for each place the peers can be."""

    # a tensor-parallel all-reduce or all-gather: its ranks are in one pod, or in pods of one node
    collective_in_pod: dict[str, float] = field(default_factory=lambda: {"gpu": 15e-6, "cpu": 30e-6})
    collective_across_pods: dict[str, float] = field(default_factory=lambda: {"gpu": 100e-6, "cpu": 300e-6})
    # a pipeline send between stages (always different pods): on one node, or between nodes
    hop_across_pods: dict[str, float] = field(default_factory=lambda: {"gpu": 50e-6, "cpu": 200e-6})
    hop_across_nodes: dict[str, float] = field(default_factory=lambda: {"gpu": 90e-6, "cpu": 260e-6})

    def collective(self, kind: str, layout: str) -> float:
        return (self.collective_in_pod if layout == PER_TENSOR_GROUP else self.collective_across_pods)[kind]

    def hop(self, kind: str, same_node: bool) -> float:
        return (self.hop_across_pods if same_node else self.hop_across_nodes)[kind]
