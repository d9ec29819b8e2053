"""One stage's cost: its memory and its decode time as linear functions of its number of layers
(`StageModel`), from the sizing arithmetic (`sizing.py`), the transport's prices, the step's own
costs (`step.py`: launches, the read share reached, int8's measured gain) and, when layers
stream, the offload model; and the split of the layers over stages that minimises the slowest.
Pure."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from . import kvcache, offload
from .offload import OffloadStage
from .profile import ModelProfile
from .request import PlannerOptions, Request
from .sizing import (
    Shard,
    activation_bytes,
    kv_token_bytes,
    layer_copied_bytes,
    layer_read_bytes,
    layer_streamed_bytes,
    layer_weight_bytes,
    mask_bytes,
    mask_token_bytes,
    nvls_bytes,
    weight_bytes,
)
from .transport import pod_layout


@dataclass(frozen=True)
class StageModel:
    """Memory and time of a stage as a linear function of its number of layers."""

    fixed_bytes: int
    layer_bytes: int
    fixed_seconds: float
    layer_seconds: float
    usable: int
    max_layers: int | None = None  # a bound of its own: the layers whose KV a fixed cache holds

    def capacity(self) -> int:
        """Most layers this stage can hold."""
        if self.fixed_bytes > self.usable:
            return -1
        most = (self.usable - self.fixed_bytes) // self.layer_bytes if self.layer_bytes else 10**9
        return most if self.max_layers is None else min(most, self.max_layers)

    def seconds(self, n: int) -> float:
        return self.fixed_seconds + n * self.layer_seconds


class Costs:
    """Stage models of one planning run, memoised: blocks of one shape cost the same. With
    `streaming`, a stage whose layers do not all fit streams some (offload)."""

    def __init__(self, profile: ModelProfile, request: Request, options: PlannerOptions, streaming: bool = False):
        self.profile, self.request, self.options, self.streaming = profile, request, options, streaming
        self._cache: dict[tuple, StageModel] = {}
        self._offload: dict[tuple, OffloadStage] = {}
        self._partitions: dict[tuple, list[int] | None] = {}
        self._layer_bytes: dict[tuple[int, str], int] = {}

    def layer_bytes(self, tp: int, quantization: str | None = None) -> int:
        """A decoder layer's weight bytes on a rank (as quantized, or as `quantization` says)."""
        r = self.request
        key = (tp, quantization or r.quantization)
        if key not in self._layer_bytes:  # layers are alike in these families; take the largest
            self._layer_bytes[key] = max(layer_weight_bytes(self.profile, i, tp, r.dtype, key[1])
                                         for i in range(self.profile.shape.num_layers))
        return self._layer_bytes[key]

    def partition(self, shapes: tuple[tuple, ...], tp: int, given: list[int] | None) -> list[int] | None:
        """Layers per stage for stages of these block shapes (memoised: replicas repeat shapes)."""
        key = (shapes, tp, tuple(given) if given else None)
        if key not in self._partitions:
            last = len(shapes) - 1
            stages = [self.stage_model(shape, tp, i == 0, i == last) for i, shape in enumerate(shapes)]
            if self.streaming:
                streamed = [self.offload_stage(shape, tp, i == 0, i == last) for i, shape in enumerate(shapes)]
                if given is not None:
                    fits = all(n >= 1 and s.at(n) is not None for n, s in zip(given, streamed, strict=False))
                    self._partitions[key] = list(given) if fits else None
                else:
                    self._partitions[key] = offload.partition(streamed, self.profile.shape.num_layers)
            elif given is not None:
                fits = all(1 <= n <= s.capacity() for n, s in zip(given, stages, strict=False))
                self._partitions[key] = list(given) if fits else None
            else:
                self._partitions[key] = partition_layers(stages, self.profile.shape.num_layers)
        counts = self._partitions[key]
        return None if counts is None else list(counts)

    def seconds(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool, n: int) -> float:
        """Decode time of a stage of `n` layers on a block of this shape (streaming ones included)."""
        if self.streaming:
            stage = self.offload_stage(shape, tp, embeds, has_lm_head).at(n)
            assert stage is not None, f"{n} layers do not fit this block"
            return stage.seconds
        return self.stage_model(shape, tp, embeds, has_lm_head).seconds(n)

    def offload_stage(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool) -> OffloadStage:
        key = (shape, tp, embeds, has_lm_head)
        if key not in self._offload:
            model = self.stage_model(shape, tp, embeds, has_lm_head)
            profile, request = self.profile, self.request
            layers = range(profile.shape.num_layers)  # alike in these families: take the largest
            self._offload[key] = OffloadStage(
                kind=shape[2], usable=model.usable, fixed=model.fixed_bytes, max_layers=model.max_layers,
                kv=self.layer_kv_bytes(tp, shape[2]),
                layer=self.layer_bytes(tp),
                streamed=max(layer_streamed_bytes(profile, i, tp, request.dtype) for i in layers),
                copied=max(layer_copied_bytes(profile, i, tp, request.dtype, shape[2]) for i in layers),
                read=max(layer_read_bytes(profile, i, tp) for i in layers),
                fixed_seconds=model.fixed_seconds, layer_seconds=model.layer_seconds,
                host_rate=shape[3] * 1e9, file_rate=shape[4] * 1e9, request=request.offload)
        return self._offload[key]

    def kv_policy(self, kind: str) -> kvcache.KvPolicy:
        return kvcache.kv_policy(self.request, kind)

    def layer_kv_bytes(self, tp: int, kind: str) -> int:
        """The KV cache a layout must leave room for per layer on a rank of this kind: the
        reservation, or one whole sequence in the share of the free memory the cache may take."""
        r = self.request
        return kv_token_bytes(self.profile, tp, 1, r.dtype) * kvcache.fit_tokens(self.kv_policy(kind), r)

    def overhead(self, kind: str, tp: int, pipeline: bool) -> int:
        """A rank's runtime beyond the model: the options' per kind, and NCCL's NVLS buffers when on."""
        return self.options.runtime_overhead[kind] + nvls_bytes(self.request.nvls, kind, tp, pipeline)

    def stage_model(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool) -> StageModel:
        """The cost of a stage on a block of this shape (memoised: blocks of one shape cost the same)."""
        key = (shape, tp, embeds, has_lm_head)
        if key not in self._cache:
            self._cache[key] = self._stage(shape, tp, embeds, has_lm_head)
        return self._cache[key]

    def _stage(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool) -> StageModel:
        memory, speed, kind = shape[:3]
        profile, request = self.profile, self.request
        empty = Shard(tp=tp, layers=(0, 0), embeds=embeds, has_lm_head=has_lm_head)
        layer_bytes = self.layer_bytes(tp)
        policy = self.kv_policy(kind)
        # the block masks over the pool a layout must make room for, whatever its layers
        masks = mask_bytes(request.max_len, request.batch, kvcache.fit_tokens(policy, request), kind)
        fixed = (weight_bytes(profile, empty, request.dtype)
                 + activation_bytes(profile, empty, request.max_len, request.batch, request.dtype, kind)
                 + self.overhead(kind, tp, not (embeds and has_lm_head)) + kvcache.fixed_bytes(policy) + masks)
        bandwidth = speed * 1e12
        collective = self.options.transport.collective(kind,
                                                       pod_layout(request.pod_layout, kind, tp)) if tp > 1 else 0.0
        step = self.options.step
        return StageModel(
            fixed_bytes=fixed,
            layer_bytes=layer_bytes + self.layer_kv_bytes(tp, kind),
            fixed_seconds=(step.fixed_seconds(kind, weight_bytes(profile, empty, request.dtype), bandwidth)
                           + (embeds + has_lm_head) * collective),
            layer_seconds=(step.layer_seconds(kind, layer_bytes, self.layer_bytes(tp, "none"), bandwidth)
                           + 2 * collective),
            usable=int(memory * (1 - request.headroom)),
            max_layers=kvcache.max_layers(policy, kv_token_bytes(profile, tp, 1, request.dtype), request,
                                          mask_token_bytes(request.max_len, request.batch, kind)),
        )


def partition_layers(stages: list[StageModel], num_layers: int) -> list[int] | None:
    """Layers per stage minimising the slowest stage, within memory; None when they do not fit.

    Every stage gets one layer, then each further layer goes to the stage that would be done with
    it soonest (ties: the earlier stage). For identical layers this is optimal for the slowest
    stage (uniform jobs on machines of different speeds).
    """
    caps = [s.capacity() for s in stages]
    if min(caps) < 1 or sum(min(c, num_layers) for c in caps) < num_layers:
        return None
    counts = [1] * len(stages)
    heap = [(s.seconds(2), i) for i, s in enumerate(stages) if caps[i] >= 2]
    heapq.heapify(heap)
    for _ in range(num_layers - len(stages)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, (stages[i].seconds(counts[i] + 1), i))
    return counts


