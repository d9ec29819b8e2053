"""Offload: a stage that holds some decoder layers and streams the others in as each step needs
them. Pure arithmetic for the planner.

A streamed layer keeps its norms and biases resident (and its KV cache: every layer's stays);
its projection matrices come in, before each step needs them, one layer per slot of `prefetch`:
on a GPU rank copied into staging slots on the device, from host memory (pinned copies, at
`host_gbps`) or read from the checkpoint files (at `file_gbps`); on a CPU rank, whose device
memory is host memory, mapped from the checkpoint files and computed on in place (at `file_gbps`:
mapping page-cached pages), so its slots take no memory (but for the tensors it must copy:
another dtype than the runtime's, or misaligned data, at most the copy rate FILE_GBPS). With two
or more slots the next layers load while the current one computes, so a stage of n layers, r of
them resident, takes

    max(compute of all n layers, streaming the n - r others)          (prefetch >= 2)
    max(compute, streaming + computing the streamed layers)           (prefetch 1: a layer's load
                                                                       cannot overlap its own compute)

Where the slots take memory (`copied` bytes a layer), streaming s layers needs s >= prefetch to
save memory at all, so such a stage either holds every layer or streams more than `prefetch`.

Choosing layers per stage (`partition`): the fewest streamed bytes per step (every stage's
streamed layers are alike), then the shortest decode step, the sum of the stages' times (a decode
step passes through them one after another), exactly, by a dynamic program. Which layers of a
stage stream: spread evenly, so each load has resident layers' compute to hide behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shard_contract.plan import OffloadPlan, OffloadSettings, Plan, RankPlan
from shard_contract.units import human

from .inventory import FILE_GBPS


@dataclass(frozen=True)
class Streaming:
    """A stage of `n` layers: `resident` held, `host` + `files` streamed per step."""

    n: int
    resident: int
    host: int
    files: int
    compute: float
    stream: float
    seconds: float

    @property
    def streamed(self) -> int:
        return self.host + self.files


@dataclass(frozen=True)
class OffloadStage:
    """A stage's memory and time as functions of its layers, with streaming allowed. Bytes per
    rank; `layer` is a whole resident layer, `streamed` its part that streams, `copied` the part
    of that copied into a staging slot (a GPU's all; a CPU's what it cannot map in place), `read`
    what the files give for the streamed part."""

    kind: str
    usable: int
    fixed: int  # weights outside the layers, activations, runtime overhead
    kv: int  # KV cache per layer
    layer: int
    streamed: int
    copied: int
    read: int
    fixed_seconds: float
    layer_seconds: float
    host_rate: float  # bytes/s
    file_rate: float
    request: OffloadSettings
    max_layers: int | None = None  # a fixed KV cache holds a whole sequence of no more layers

    def slots(self, streamed_layers: int) -> int:
        return min(self.request.prefetch, streamed_layers)

    def file_seconds(self) -> float:
        """One layer from the files: read; a GPU copies it on while the next is read. A CPU maps
        it in place, and copies (no faster than FILE_GBPS) only its `copied` share."""
        if self.kind == "gpu":
            return max(self.read / self.file_rate, self.streamed / self.host_rate)
        share = self.copied / self.streamed if self.streamed else 0.0
        return self.read * ((1 - share) / self.file_rate + share / min(self.file_rate, FILE_GBPS * 1e9))

    def at(self, n: int) -> Streaming | None:
        """The stage holding `n` layers: as many resident as fit (every one when all fit, none
        with policy always); None when even streaming cannot make it fit its memory or tiers."""
        if self.max_layers is not None and n > self.max_layers:
            return None
        compute = self.fixed_seconds + n * self.layer_seconds
        always = self.request.policy == "always"
        if not always and self.fixed + n * (self.kv + self.layer) <= self.usable:
            return Streaming(n, n, 0, 0, compute, 0.0, compute)
        rest = self.layer - self.streamed  # what a streamed layer keeps resident
        free = self.usable - self.fixed - n * (self.kv + rest)
        if always:
            resident = 0 if free >= self.slots(n) * self.copied else -1
        else:
            resident = math.floor((free - self.request.prefetch * self.copied) / self.streamed) \
                if self.streamed else -1
        if resident < 0:
            return None
        s = n - resident
        host = 0
        if self.kind == "gpu":
            budget = self.request.host_memory
            host = s if budget is None else min(s, budget // self.streamed)
        files = s - host
        if files and not self.request.from_files:
            return None
        stream = host * self.streamed / self.host_rate + files * self.file_seconds()
        busy = stream if self.request.prefetch >= 2 else stream + s * self.layer_seconds
        return Streaming(n, resident, host, files, compute, stream, max(compute, busy))

    def table(self, most: int) -> list[Streaming | None]:
        """at(n) for n = 0..most."""
        return [None] + [self.at(n) for n in range(1, most + 1)]


def partition(stages: list[OffloadStage], num_layers: int) -> list[int] | None:
    """Layers per stage (at least one each): the fewest streamed layers, then the shortest decode
    step (the stages' times summed: a decode step passes through them one after another); None
    when no split fits. A dynamic program over the stages and the layers placed so far."""
    tables = [s.table(num_layers) for s in stages]
    best: dict[int, tuple[int, float]] = {0: (0, 0.0)}  # layers placed -> (streamed, seconds)
    picks: list[dict[int, int]] = []
    for i, table in enumerate(tables):
        room = num_layers - (len(stages) - i - 1)  # leave a layer for each later stage
        nxt: dict[int, tuple[int, float]] = {}
        picked: dict[int, int] = {}
        for placed, (streamed, seconds) in best.items():
            for n in range(1, room - placed + 1):
                at = table[n]
                if at is None:
                    break  # more layers fit no better
                cost = (streamed + at.streamed, seconds + at.seconds)
                total = placed + n
                if total not in nxt or cost < nxt[total]:
                    nxt[total], picked[total] = cost, n
        best = nxt
        picks.append(picked)
    if num_layers not in best:
        return None
    counts, left = [], num_layers
    for picked in reversed(picks):
        counts.append(picked[left])
        left -= counts[-1]
    return counts[::-1]


def spread(layers: tuple[int, int], count: int) -> list[int]:
    """`count` of the layers [start, stop), spread evenly (each followed by resident ones)."""
    start, stop = layers
    n = stop - start
    return [start + (2 * i + 1) * n // (2 * count) for i in range(count)] if count else []


def rank_offload(stage: OffloadStage, layers: tuple[int, int], streamed_bytes: list[int], copied_bytes: list[int],
                 read_bytes: list[int]) -> OffloadPlan | None:
    """The OffloadPlan of a rank of `stage` holding `layers`; `streamed_bytes`/`copied_bytes`/
    `read_bytes` per layer of the model. None when it holds every layer."""
    at = stage.at(layers[1] - layers[0])
    assert at is not None, "the partition placed a stage that does not fit"
    if at.streamed == 0:
        return None
    streamed = spread(layers, at.streamed)
    files = [streamed[i] for i in spread((0, at.streamed), at.files)]
    host_bytes = sum(streamed_bytes[j] for j in streamed if j not in files)
    read = sum(read_bytes[j] for j in files)
    bounce = stage.slots(at.streamed) * stage.streamed if stage.kind == "gpu" and files else 0
    return OffloadPlan(layers=streamed, file_layers=files, prefetch=stage.slots(at.streamed),
                       streamed_bytes=sum(streamed_bytes[j] for j in streamed),
                       copied_bytes=sum(copied_bytes[j] for j in streamed), read_bytes=read,
                       host_bytes=host_bytes + read + bounce,
                       host_bandwidth=stage.host_rate if stage.kind == "gpu" else 0.0,
                       file_bandwidth=stage.file_rate if files else 0.0,
                       compute_seconds=at.compute, stream_seconds=at.stream)


def summary(ranks: list[RankPlan], policy: str) -> str:
    """One phrase for the plan's reason and the Events: which ranks stream how much, from where."""
    streaming = [(r, r.offload) for r in ranks if r.offload is not None]
    if not streaming:
        return ""
    alike: dict[tuple[int, int], list[int]] = {}
    for r, o in streaming:
        alike.setdefault((len(o.layers), r.num_layers), []).append(r.rank)
    who = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} stream{'' if len(rs) > 1 else 's'} "
                    f"{k} of {'their' if len(rs) > 1 else 'its'} {n} layers" for (k, n), rs in alike.items())
    tiers = " and ".join(sorted({TIER_WORDS[t] for _, o in streaming for t in o.tier.split("+")}))
    slowest = max((o for _, o in streaming), key=lambda o: max(o.compute_seconds, o.stream_seconds))
    why = "offload always" if policy == "always" else "offload auto: the devices cannot hold every layer"
    return (f"{why}: {who}; {human(sum(o.streamed_bytes for _, o in streaming))} per decode step from "
            f"{tiers}, est. {slowest.stream_seconds * 1e3:.2f} ms of streaming against "
            f"{slowest.compute_seconds * 1e3:.2f} ms of compute on the slowest rank")


def event(previous: Plan | None, plan: Plan) -> tuple[str, str] | None:
    """The Event a newly adopted plan deserves about streaming: Offloading (which ranks stream how
    much) when it streams, FullyResident when the plan before it streamed and it does not."""
    if plan.streams:
        return "Offloading", summary(plan.ranks, plan.offload.policy)
    if previous is not None and previous.streams:
        return "FullyResident", "every layer is resident again: the pool holds the whole model"
    return None


def layer_count(plan: Plan) -> str:
    """e.g. "29 of the 32 layers on every rank", for group 0 of a plan that streams."""
    counts = sorted({(len(r.offload.layers) if r.offload else 0, r.num_layers) for r in plan.group(0)})
    if len(counts) == 1:
        (k, n), = counts
        return f"{k} of the {n} layers on {'every rank' if plan.world_size > 1 else 'its one rank'}"
    streamed = sum(len(r.offload.layers) for r in plan.group(0) if r.offload and r.tp_rank == 0)
    return f"{streamed} of the {plan.num_layers} layers"


TIER_WORDS = {"host": "host memory", "files": "the checkpoint files"}
