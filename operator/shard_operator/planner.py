"""The planner: profile + devices + spec -> Plan. Pure and deterministic.

How it decides, in order:
1. Candidate tensor degrees divide the attention heads, the MLP width and (either way) the KV heads,
   and fit in one node (a TP group never crosses a node: its all-reduces run every layer).
2. Each node's devices, largest first, are cut into TP blocks; a block is as big and as fast as its
   smallest device. For every (TP, PP) each replica takes PP blocks (fastest, roomiest, or all of
   one kind -- whichever gives the shortest decode step) and arranges them into stages.
3. Layers go to stages one at a time, each to the stage that would finish it soonest and still has
   memory for it. Layers are identical work, so this greedy minimises the slowest stage (the
   pipeline's throughput) while every rank fits: a device twice as big and fast gets about twice
   the layers.
4. Among feasible layouts, those that place the most replicas (as many as fit, up to the spec's);
   among them the shortest critical path (one decode step through every stage, collectives and
   hops included); layouts within `tolerance` of it count as ties and the one with fewer devices
   wins.
With `spec.placement.offload` (policy auto, when nothing fits otherwise; always) a stage may hold
more layers than its memory by streaming some in at every step (`offload.py`): the same search,
with each stage's time max(compute, streaming) and its layers resident as far as they fit.
Parallelism no pool could ever run (a tensor degree that does not divide the heads, more stages
than layers) is an `InvalidParallelism` PlanError before any device is looked at. When not even
one replica fits, `PlanError` says what stands in the way first (a given layout's device count or
rank size), how much is needed, what the pool has, and what would fit; when some but not all do,
the Plan has fewer groups than `replicas` and `shortfall` says what the others lack. What would
fit is `advice.py`'s: every suggestion was checked by planning again with it applied.
`consider` lists every layout tried (`shardctl plan --explain`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pydantic import TypeAdapter, ValidationError

from shard_contract.plan import DEFAULT_PREFETCH, GroupPlan, OffloadSettings, Plan, PredictedBytes, RankPlan, StagePlan
from shard_contract.sharding import tp_problem, valid_tensor_degrees
from shard_contract.units import apart, count, exactly, human

from . import offload
from .advice import Asked, Fits, Suggestion, offer, suggestions
from .api import OFFLOAD_INT8, ShardedModelSpec
from .inventory import Device, Inventory, SkippedNode
from .offload import OffloadStage
from .profile import ModelProfile
from .sizing import (
    RUNTIME_OVERHEAD,
    Shard,
    activation_bytes,
    kv_cache_bytes,
    layer_copied_bytes,
    layer_read_bytes,
    layer_streamed_bytes,
    layer_weight_bytes,
    nvls_bytes,
    weight_bytes,
)
from .transport import Transport, pod_layout

DEFAULT_MAX_MODEL_LEN = 4096
# `dtype: auto` of a bfloat16 checkpoint on GPUs without native bfloat16 (compute capability < 8.0)
AUTO_FALLBACK = {"bfloat16": "float16"}


@dataclass(frozen=True)
class Shortfall:
    """What one replica that fits nowhere needs, against what the pool offers (for its picture)."""

    weights: int  # one replica's, at the runtime dtype
    kv_cache: int  # one replica's
    per_device: int  # runtime overhead and activations, on every device
    devices: tuple[Device, ...]
    usable: tuple[int, ...]  # each device's memory below the headroom

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache + len(self.usable) * self.per_device


class PlanError(ValueError):
    """No layout fits. `reason` is a condition reason; the message says what would help; a
    `shortfall` says it in numbers when the pool is too small, and `suggestions` are the changes
    the message offers, each checked by planning again."""

    def __init__(self, reason: str, message: str, shortfall: Shortfall | None = None,
                 suggestions: list[Suggestion] | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.shortfall = shortfall
        self.suggestions = suggestions or []


@dataclass(frozen=True)
class PlannerOptions:
    runtime_overhead: dict[str, int] = field(default_factory=lambda: dict(RUNTIME_OVERHEAD))
    tolerance: float = 0.10  # critical paths this close count as equal; fewer devices wins
    transport: Transport = field(default_factory=Transport)  # seconds per collective and hop

    @classmethod
    def from_json(cls, text: str) -> PlannerOptions:
        """The defaults with what a JSON object changes, key by key, e.g.
        {"runtime_overhead": {"gpu": 3221225472}, "transport": {"collective_across_pods": {"gpu": 2e-4}}}."""
        def merged(default: Any, given: Any, where: str) -> Any:
            if not isinstance(default, dict):
                return given
            if not isinstance(given, dict) or set(given) - set(default):
                raise ValueError(f"planner options: {where or 'the options'} takes an object with keys "
                                 f"{', '.join(sorted(default))} (got {json.dumps(given)})")
            return {k: merged(v, given.get(k, v), f"{where}.{k}".lstrip(".")) for k, v in default.items()}
        try:
            values = merged(asdict(cls()), json.loads(text or "{}"), "")
            values["transport"] = Transport(**values["transport"])
            return TypeAdapter(cls).validate_python(values)
        except (json.JSONDecodeError, ValidationError) as err:
            raise ValueError(f"planner options: {err}") from None


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


@dataclass(frozen=True)
class Request:
    """What the spec asks for, resolved against the profile."""

    dtype: str
    quantization: str
    max_len: int
    batch: int
    replicas: int
    headroom: float
    spread_replicas: bool
    pod_layout: str = "auto"
    offload: OffloadSettings = OffloadSettings()
    nvls: bool = False  # spec.worker.nccl.nvls: NCCL's NVLS buffers are budgeted


@dataclass
class GroupLayout:
    blocks: list[Block]
    counts: list[int]
    stage_seconds: list[float]
    critical_path: float

    @property
    def bottleneck(self) -> float:
        return max(self.stage_seconds)


@dataclass
class Candidate:
    tp: int
    pp: int
    groups: list[GroupLayout]

    @property
    def devices(self) -> int:
        return self.tp * self.pp * len(self.groups)

    @property
    def critical_path(self) -> float:
        return max(g.critical_path for g in self.groups)


@dataclass(frozen=True)
class Considered:
    """One layout the planner tried: the groups it placed, or why none fit. `onwards`: this and
    every larger pipeline degree at this tensor degree (tried no further, for `why`)."""

    tp: int
    pp: int
    candidate: Candidate | None
    why: str = ""
    onwards: bool = False


# ---------------------------------------------------------------- entry point
def plan(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
         options: PlannerOptions | None = None) -> Plan:
    """The Plan of as many of `spec.replicas` groups as fit (at least one; zero when 0 are asked).

    When not one fits, the PlanError says why, and what would fit: every suggestion it makes was
    checked by planning again with it applied (`PlanError.suggestions`)."""
    options = options or PlannerOptions()
    try:
        return _plan(profile, spec, inventory, options)
    except NothingFits as nothing:
        note = _offload_note(profile, spec, nothing.request, nothing.inventory, nothing.tps, options)
        message, found = explain_infeasible(profile, spec, nothing.request, nothing.inventory, nothing.tps, options,
                                            nothing.shortfall, note)
        raise PlanError("InsufficientCapacity", message, nothing.shortfall, found) from None


class NothingFits(Exception):
    """No layout places even one group: what `plan` explains."""

    def __init__(self, request: Request, inventory: Inventory, tps: list[int], shortfall: Shortfall):
        self.request, self.inventory, self.tps, self.shortfall = request, inventory, tps, shortfall


def _plan(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, options: PlannerOptions) -> Plan:
    request, inventory, tps = _prepare(profile, spec, inventory)
    streaming, *then = _streaming_modes(request)
    found = _fitting(profile, spec, inventory, request, tps, options, streaming)
    placed = max((len(c.groups) for c in found), default=0)
    if then and placed < max(request.replicas, 1):
        more = _fitting(profile, spec, inventory, request, tps, options, streaming=True)
        # auto: only when streaming places more replicas than holding every layer does
        if max((len(c.groups) for c in more), default=0) > placed:
            found, streaming = more, True
    if not found:
        raise NothingFits(request, inventory, tps, _capacity_needed(profile, request, inventory, tps, options))
    found, best = _pick(found, options.tolerance)
    request, why = _fallback_dtype(request, spec, best)
    result = _to_plan(profile, spec, request, Costs(profile, request, options, streaming), best, found)
    return result.model_copy(update={"reason": result.reason + why}) if why else result


def _streaming_modes(request: Request) -> list[bool]:
    """Whether layers may stream, in the order `_plan` tries: `always` streams, `never` does not,
    `auto` holds every layer first and streams only when that places too few (never int8)."""
    policy = request.offload.policy
    return [policy == "always"] + ([True] if policy == "auto" and request.quantization == "none" else [])


def _pick(found: list[Candidate], tolerance: float) -> tuple[list[Candidate], Candidate]:
    """The layouts that place the most groups, and the one chosen among them."""
    most = max(len(c.groups) for c in found)
    found = [c for c in found if len(c.groups) == most]
    return found, _choose(found, tolerance)


def _fitting(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, request: Request,
             tps: list[int], options: PlannerOptions, streaming: bool = False) -> list[Candidate]:
    """The layouts that place at least one group."""
    return [c.candidate for c in _tries(profile, spec, inventory, request, tps, options, streaming=streaming)
            if c.candidate is not None]


STREAMING_FITS = "Streaming layers would fit it (planned): "


def _offload_note(profile: ModelProfile, spec: ShardedModelSpec, request: Request, inventory: Inventory,
                  tps: list[int], options: PlannerOptions) -> str:
    """What offload would do for a model that does not fit: fit it (at what speed), or why not."""
    if request.quantization != "none":
        return "" if request.offload.policy == "never" else OFFLOAD_INT8.replace("always", request.offload.policy) + "."
    if request.offload.policy != "never":
        return ("Offload streams the decoder layers' projections only: each rank keeps its KV cache, "
                "activations, runtime, embeddings or LM head and its staging slots resident.")
    auto = replace(request, offload=request.offload.model_copy(update={"policy": "auto"}))
    found = _fitting(profile, spec, inventory, auto, tps, options, streaming=True)
    if not found:
        return ""
    found, best = _pick(found, options.tolerance)
    fitted = _to_plan(profile, spec, auto, Costs(profile, auto, options, streaming=True), best, found)
    per_step = sum(r.offload.streamed_bytes for r in fitted.group(0) if r.offload)
    step = fitted.groups[0].critical_path_seconds
    return (f"{STREAMING_FITS}set spec.placement.offload.policy auto: streaming {offload.layer_count(fitted)} "
            f"({human(per_step)} per decode step over the group) fits it at tensor={best.tp} x pipeline={best.pp}, "
            f"est. {step * 1e3:.2f} ms per decode step ({1 / step:.1f} tokens/s per sequence).")


def consider(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
             options: PlannerOptions) -> tuple[Request, list[int], list[Considered]]:
    """Every layout the planner tries, in order (`plan` chooses among those that fit)."""
    request, inventory, tps = _prepare(profile, spec, inventory)
    streaming = _streaming_modes(request)[0]
    return request, tps, list(_tries(profile, spec, inventory, request, tps, options, streaming=streaming))


def _prepare(profile: ModelProfile, spec: ShardedModelSpec,
             inventory: Inventory) -> tuple[Request, Inventory, list[int]]:
    """The request, the devices that can run it and the tensor degrees to try; a PlanError for a
    spec no pool could run."""
    request = _resolve_request(profile, spec)
    check_parallelism(profile, spec)
    inventory = _running(inventory, spec.model.dtype)
    if not inventory.devices:
        skipped = "; ".join(f"{s.node}: {s.reason}" for s in inventory.skipped) or "no nodes"
        raise PlanError("NoDevices", f"no usable devices in the node pool ({skipped})")
    return request, inventory, _tensor_candidates(profile, spec, inventory)


def _tries(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, request: Request,
           tps: list[int], options: PlannerOptions, groups: int = 0,
           streaming: bool = False) -> Iterator[Considered]:
    """`consider`'s layouts one at a time, so a question that any one answers can stop early.
    With `groups`, only the layouts that could place that many groups are tried (`places`);
    `streaming`: a stage may stream the layers it cannot hold (offload)."""
    pps = _pipeline_candidates(profile, spec)
    partition = spec.parallelism.layer_partition
    wanted = max(request.replicas, 1)
    costs = Costs(profile, request, options, streaming)
    for tp in tps:
        blocks = make_blocks(inventory.devices, tp)
        room = _layer_room(costs, blocks, tp) if groups and not streaming else []  # streamed layers need no room
        previous: float | None = None
        for pp in pps:
            if len(blocks) < pp:
                have = "has" if tp == 1 else "makes"
                yield Considered(tp, pp, None, f"needs {_sets(pp, tp)}; the pool {have} {len(blocks)}",
                                 onwards=pp < pps[-1])
                break
            if groups and len(blocks) < groups * pp:
                break
            if room and sum(room[:groups * pp]) < groups * profile.num_layers:
                continue  # the roomiest blocks cannot hold the layers: more stages might
            candidate = _place_replicas(costs, blocks, tp, pp, wanted, partition)
            yield Considered(tp, pp, candidate, "" if candidate else "no split of the layers fits the devices' memory")
            if candidate is None or len(candidate.groups) < wanted:
                continue  # more stages may fit more replicas (smaller devices take part)
            # More stages only add hops and slower devices once every replica fits: stop when worse.
            if previous is not None and candidate.critical_path >= previous:
                if pp < pps[-1]:
                    yield Considered(tp, pp + 1, None, "not tried: once every replica fits, more stages only "
                                                       "add hops", onwards=True)
                break
            previous = candidate.critical_path


def _layer_room(costs: Costs, blocks: list[Block], tp: int) -> list[int]:
    """The most layers each block could hold, roomiest first: as a middle stage (a stage with the
    embeddings or the LM head has more fixed bytes, so it holds no more), and no more than the
    model has (a block is one stage of one group). `groups` groups of `pp` stages need the first
    `groups * pp` to hold `groups` times the layers."""
    layers = costs.profile.num_layers
    return sorted((min(max(costs._stage_of(b.shape, tp, False, False).capacity(), 0), layers) for b in blocks),
                  reverse=True)


def _sets(pp: int, tp: int) -> str:
    """What `pp` stages of `tp` ranks take: 'pipeline=3 devices', '2 sets of 4 devices on one node'."""
    return count(pp, "device") if tp == 1 else f"{pp} set{'s' if pp > 1 else ''} of {tp} devices on one node"


def _running(inventory: Inventory, dtype: str) -> Inventory:
    """bfloat16 asked for by name: only the devices that run it natively; the nodes of the others
    are skipped, saying why (with `dtype: auto` they run float16 instead)."""
    lacking = [d for d in inventory.devices if not d.native_bf16] if dtype == "bfloat16" else []
    if not lacking:
        return inventory
    reasons = {d.node: f"{d.product or 'GPU'} (compute capability {d.compute_capability}) has no native bfloat16 "
                       "(spec.model.dtype bfloat16; auto would run float16 there)" for d in lacking}
    return Inventory(devices=[d for d in inventory.devices if d.native_bf16],
                     skipped=inventory.skipped + [SkippedNode(node=n, reason=r) for n, r in sorted(reasons.items())])


def _fallback_dtype(request: Request, spec: ShardedModelSpec, best: Candidate) -> tuple[Request, str]:
    """`dtype: auto` keeps the checkpoint's dtype, except bfloat16 on a GPU without it: float16
    (same bytes, so the layout stands). Returns the request to plan with and what to add to the reason."""
    fallback = AUTO_FALLBACK.get(request.dtype) if spec.model.dtype == "auto" else None
    lacking = sorted({f"{d.product or 'a GPU'} (compute capability {d.compute_capability})"
                      for g in best.groups for b in g.blocks for d in b.devices if not d.native_bf16})
    if fallback is None or not lacking:
        return request, ""
    return replace(request, dtype=fallback), (f"; {fallback}, not the checkpoint's {request.dtype}: "
                                              f"{', '.join(lacking)} has no native {request.dtype}")


def _resolve_request(profile: ModelProfile, spec: ShardedModelSpec) -> Request:
    dtype = profile.dtype if spec.model.dtype == "auto" else spec.model.dtype
    max_len = spec.model.max_model_len or min(profile.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_len > profile.max_position_embeddings:
        raise PlanError("InvalidSpec", f"spec.model.maxModelLen {max_len} exceeds the model's "
                        f"max_position_embeddings {profile.max_position_embeddings}")
    off = spec.placement.offload
    return Request(dtype=dtype, quantization=spec.model.quantization, max_len=max_len,
                   batch=spec.model.max_batch_size,
                   replicas=spec.replicas, headroom=spec.placement.memory_headroom,
                   spread_replicas=spec.placement.topology.spread_replicas, pod_layout=spec.placement.pod_layout,
                   nvls=spec.worker.nccl.nvls,
                   offload=OffloadSettings(policy=off.policy, host_memory=off.host_memory_bytes,
                                           from_files=off.from_files,
                                           prefetch=DEFAULT_PREFETCH if off.prefetch == "auto" else off.prefetch))


def check_parallelism(profile: ModelProfile, spec: ShardedModelSpec) -> None:
    """Raise InvalidParallelism for degrees this model can never run, whatever the pool."""
    par = spec.parallelism
    if par.tensor != "auto" and (problem := tp_problem(profile, par.tensor)):
        valid = ", ".join(map(str, valid_tensor_degrees(profile, profile.num_heads)))
        raise PlanError("InvalidParallelism", f"spec.parallelism.tensor: {problem}; valid: {valid}")
    if par.pipeline != "auto" and par.pipeline > profile.num_layers:
        raise PlanError("InvalidParallelism", f"spec.parallelism.pipeline={par.pipeline} exceeds the "
                        f"{profile.num_layers} decoder layers; valid: 1 to {profile.num_layers}")
    if par.layer_partition is not None and sum(par.layer_partition) != profile.num_layers:
        raise PlanError("InvalidParallelism", f"spec.parallelism.layerPartition {par.layer_partition} places "
                        f"{sum(par.layer_partition)} layers; the model has {profile.num_layers}")


def _tensor_candidates(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory) -> list[int]:
    per_node: dict[str, int] = {}
    for d in inventory.devices:
        per_node[d.node] = per_node.get(d.node, 0) + 1
    widest = max(per_node.values())
    tensor = spec.parallelism.tensor
    return valid_tensor_degrees(profile, widest) if tensor == "auto" else [tensor]


def _pipeline_candidates(profile: ModelProfile, spec: ShardedModelSpec) -> list[int]:
    pipeline, partition = spec.parallelism.pipeline, spec.parallelism.layer_partition
    if partition is not None:
        return [len(partition)]
    if pipeline == "auto":
        return list(range(1, profile.num_layers + 1))
    return [pipeline]


# ---------------------------------------------------------------- blocks
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


# ---------------------------------------------------------------- one stage's cost
@dataclass(frozen=True)
class StageModel:
    """Memory and time of a stage as a linear function of its number of layers."""

    fixed_bytes: int
    layer_bytes: int
    fixed_seconds: float
    layer_seconds: float
    usable: int

    def capacity(self) -> int:
        """Most layers this stage can hold."""
        if self.fixed_bytes > self.usable:
            return -1
        return (self.usable - self.fixed_bytes) // self.layer_bytes if self.layer_bytes else 10**9

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
        self._layer_bytes: dict[int, int] = {}

    def layer_bytes(self, tp: int) -> int:
        if tp not in self._layer_bytes:  # layers are alike in these families; take the largest
            r = self.request
            self._layer_bytes[tp] = max(layer_weight_bytes(self.profile, i, tp, r.dtype, r.quantization)
                                        for i in range(self.profile.num_layers))
        return self._layer_bytes[tp]

    def partition(self, shapes: tuple[tuple, ...], tp: int, given: list[int] | None) -> list[int] | None:
        """Layers per stage for stages of these block shapes (memoised: replicas repeat shapes)."""
        key = (shapes, tp, tuple(given) if given else None)
        if key not in self._partitions:
            last = len(shapes) - 1
            stages = [self._stage_of(shape, tp, i == 0, i == last) for i, shape in enumerate(shapes)]
            if self.streaming:
                streamed = [self.offload_stage(shape, tp, i == 0, i == last) for i, shape in enumerate(shapes)]
                if given is not None:
                    fits = all(n >= 1 and s.at(n) is not None for n, s in zip(given, streamed, strict=False))
                    self._partitions[key] = list(given) if fits else None
                else:
                    self._partitions[key] = offload.partition(streamed, self.profile.num_layers)
            elif given is not None:
                fits = all(1 <= n <= s.capacity() for n, s in zip(given, stages, strict=False))
                self._partitions[key] = list(given) if fits else None
            else:
                self._partitions[key] = partition_layers(stages, self.profile.num_layers)
        counts = self._partitions[key]
        return None if counts is None else list(counts)

    def seconds(self, block: Block, tp: int, embeds: bool, has_lm_head: bool, n: int) -> float:
        """Decode time of a stage of `n` layers on `block` (streaming ones included)."""
        if self.streaming:
            stage = self.offload_stage(block.shape, tp, embeds, has_lm_head).at(n)
            assert stage is not None, f"{n} layers do not fit this block"
            return stage.seconds
        return self._stage_of(block.shape, tp, embeds, has_lm_head).seconds(n)

    def offload_stage(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool) -> OffloadStage:
        key = (shape, tp, embeds, has_lm_head)
        if key not in self._offload:
            model = self._stage_of(shape, tp, embeds, has_lm_head)
            profile, request = self.profile, self.request
            one = Shard(tp=tp, layers=(0, 1), embeds=False, has_lm_head=False)
            layers = range(profile.num_layers)  # alike in these families: take the largest
            self._offload[key] = OffloadStage(
                kind=shape[2], usable=model.usable, fixed=model.fixed_bytes,
                kv=kv_cache_bytes(profile, one, request.max_len, request.batch, request.dtype),
                layer=self.layer_bytes(tp),
                streamed=max(layer_streamed_bytes(profile, i, tp, request.dtype) for i in layers),
                copied=max(layer_copied_bytes(profile, i, tp, request.dtype, shape[2]) for i in layers),
                read=max(layer_read_bytes(profile, i, tp) for i in layers),
                fixed_seconds=model.fixed_seconds, layer_seconds=model.layer_seconds,
                host_rate=shape[3] * 1e9, file_rate=shape[4] * 1e9, request=request.offload)
        return self._offload[key]

    def overhead(self, kind: str, tp: int, pipeline: bool) -> int:
        """A rank's runtime beyond the model: the options' per kind, and NCCL's NVLS buffers when on."""
        return self.options.runtime_overhead[kind] + nvls_bytes(self.request.nvls, kind, tp, pipeline)

    def _stage_of(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool) -> StageModel:
        key = (shape, tp, embeds, has_lm_head)
        if key not in self._cache:
            self._cache[key] = self._stage(shape, tp, embeds, has_lm_head)
        return self._cache[key]

    def _stage(self, shape: tuple, tp: int, embeds: bool, has_lm_head: bool) -> StageModel:
        memory, speed, kind = shape[:3]
        profile, request = self.profile, self.request
        empty = Shard(tp=tp, layers=(0, 0), embeds=embeds, has_lm_head=has_lm_head)
        one = Shard(tp=tp, layers=(0, 1), embeds=False, has_lm_head=False)
        layer_bytes = self.layer_bytes(tp)
        fixed = (weight_bytes(profile, empty, request.dtype)
                 + activation_bytes(profile, empty, request.max_len, request.batch, request.dtype)
                 + self.overhead(kind, tp, not (embeds and has_lm_head)))
        bandwidth = speed * 1e12
        collective = self.options.transport.collective(kind,
                                                       pod_layout(request.pod_layout, kind, tp)) if tp > 1 else 0.0
        return StageModel(
            fixed_bytes=fixed,
            layer_bytes=layer_bytes + kv_cache_bytes(profile, one, request.max_len, request.batch, request.dtype),
            fixed_seconds=weight_bytes(profile, empty, request.dtype) / bandwidth + (embeds + has_lm_head) * collective,
            layer_seconds=layer_bytes / bandwidth + 2 * collective,
            usable=int(memory * (1 - request.headroom)),
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


def _layout(costs: Costs, blocks: list[Block], tp: int, partition: list[int] | None) -> GroupLayout | None:
    counts = costs.partition(tuple(b.shape for b in blocks), tp, partition)
    if counts is None:
        return None
    last = len(blocks) - 1
    seconds = [costs.seconds(b, tp, i == 0, i == last, n) for i, (b, n) in enumerate(zip(blocks, counts, strict=False))]
    hops = sum(costs.options.transport.hop(a.kind, a.node == b.node) for a, b in itertools.pairwise(blocks))
    return GroupLayout(blocks=blocks, counts=counts, stage_seconds=seconds, critical_path=sum(seconds) + hops)


def _arrangements(chosen: list[Block]) -> Iterable[list[Block]]:
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


def _place_replicas(costs: Costs, blocks: list[Block], tp: int, pp: int, replicas: int,
                    partition: list[int] | None) -> Candidate | None:
    pool = BlockPool(blocks)
    used_nodes: set[str] = set()
    groups = []
    for _ in range(replicas):
        best: GroupLayout | None = None
        for chosen in pool.selections(pp, used_nodes if costs.request.spread_replicas else set()):
            for arranged in _arrangements(chosen):
                layout = _layout(costs, arranged, tp, partition)
                if layout and (best is None
                               or (layout.critical_path, layout.bottleneck) < (best.critical_path, best.bottleneck)):
                    best = layout
        if best is None:
            break  # the replicas placed so far are as many as fit this way
        groups.append(best)
        pool.taken.update(id(b) for b in best.blocks)
        used_nodes.update(b.node for b in best.blocks)
    return Candidate(tp=tp, pp=pp, groups=groups) if groups else None


def _choose(found: list[Candidate], tolerance: float) -> Candidate:
    fastest = min(c.critical_path for c in found)
    close = [c for c in found if c.critical_path <= fastest * (1 + tolerance)]
    return min(close, key=lambda c: (c.devices, c.critical_path, c.tp))


# ---------------------------------------------------------------- the Plan
def _to_plan(profile: ModelProfile, spec: ShardedModelSpec, request: Request, costs: Costs,
             best: Candidate, found: list[Candidate]) -> Plan:
    tp, pp = best.tp, best.pp
    streamed = [layer_streamed_bytes(profile, i, tp, request.dtype) for i in range(profile.num_layers)]
    read = [layer_read_bytes(profile, i, tp) for i in range(profile.num_layers)]
    copied = {kind: [layer_copied_bytes(profile, i, tp, request.dtype, kind) for i in range(profile.num_layers)]
              for kind in ("gpu", "cpu")}
    groups, ranks = [], []
    for replica, layout in enumerate(best.groups if request.replicas else []):
        starts = list(itertools.accumulate([0, *layout.counts]))
        stages = []
        for stage, block in enumerate(layout.blocks):
            layers = (starts[stage], starts[stage + 1])
            stages.append(StagePlan(stage=stage, layers=layers, seconds_per_token=layout.stage_seconds[stage]))
            shard = Shard(tp=tp, layers=layers, embeds=stage == 0, has_lm_head=stage == pp - 1)
            off = offload.rank_offload(costs.offload_stage(block.shape, tp, shard.embeds, shard.has_lm_head),
                                       layers, streamed, copied[block.kind], read) if costs.streaming else None
            predicted = PredictedBytes(
                weights=weight_bytes(profile, shard, request.dtype, request.quantization)
                - (sum(streamed[i] for i in off.layers) if off else 0),
                kv_cache=kv_cache_bytes(profile, shard, request.max_len, request.batch, request.dtype),
                activations=activation_bytes(profile, shard, request.max_len, request.batch, request.dtype),
                overhead=costs.overhead(block.kind, tp, pp > 1),
                staging=off.prefetch * max(copied[block.kind][i] for i in off.layers) if off else 0)
            for tp_rank, device in enumerate(block.devices):
                ranks.append(RankPlan(
                    replica=replica, rank=stage * tp + tp_rank, stage=stage, tp_rank=tp_rank,
                    node=device.node, device=device.name, device_index=device.index, kind=device.kind,
                    product=device.product, layers=layers, embeds=shard.embeds,
                    has_lm_head=shard.has_lm_head, capacity_bytes=device.memory_bytes,
                    usable_bytes=int(device.memory_bytes * (1 - request.headroom)),
                    predicted_bytes=predicted, offload=off))
        mean = sum(layout.stage_seconds) / pp
        groups.append(GroupPlan(replica=replica, stages=stages, imbalance=layout.bottleneck / mean - 1,
                                critical_path_seconds=layout.critical_path))
    return Plan(
        model=profile.name, architecture=profile.architecture, profile_digest=profile.digest,
        dtype=request.dtype, quantization=request.quantization, offload=request.offload,
        num_layers=profile.num_layers,
        tensor_parallel=tp, pipeline_parallel=pp,
        replicas=request.replicas, max_model_len=request.max_len, max_batch_size=request.batch,
        memory_headroom=request.headroom, nvls=request.nvls, groups=groups, ranks=ranks,
        reason="; ".join(filter(None, [_reason(spec, best, found), offload.summary(ranks, request.offload.policy)])))


def _reason(spec: ShardedModelSpec, best: Candidate, found: list[Candidate]) -> str:
    given_tp, given_pp = spec.parallelism.tensor != "auto", spec.parallelism.pipeline != "auto" \
        or spec.parallelism.layer_partition is not None
    ms = best.critical_path * 1e3
    if given_tp and given_pp:
        return f"tensor={best.tp} x pipeline={best.pp} as given; it fits (est. {ms:.2f} ms per decode step)"
    fastest = min(found, key=lambda c: c.critical_path)
    text = (f"tensor={best.tp} x pipeline={best.pp} on {count(best.tp * best.pp, 'device')} per replica: "
            f"est. {ms:.2f} ms per decode step, the fastest of {count(len(found), 'layout')} that fit")
    if fastest is not best:
        text = (f"tensor={best.tp} x pipeline={best.pp} on {count(best.tp * best.pp, 'device')} per replica: "
                f"est. {ms:.2f} ms per decode step, "
                f"within {round((best.critical_path / fastest.critical_path - 1) * 100)}% "
                f"of the fastest ({fastest.tp}x{fastest.pp}, {fastest.critical_path * 1e3:.2f} ms) with fewer devices")
    if best.pp > 1:
        smaller = [c for c in found if c.tp == best.tp and c.pp < best.pp]
        if not smaller:
            text += f"; fewer than {best.pp} stages do not fit at tensor={best.tp}"
    return text


# ---------------------------------------------------------------- when not everything fits
def places(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, groups: int,
           options: PlannerOptions | None = None) -> bool:
    """Whether `plan` places at least `groups` groups (how the suggestions are checked): the same
    answer as planning and counting, sooner. Only the layouts that could place them are tried
    (enough blocks, and the roomiest of them hold the layers by the planner's own stage sizes),
    and the first that does answers yes. Each tensor degree's layouts are tried apart from the
    others', so their order does not change the answer: the widest first, which usually answers
    yes soonest (fewer stages to arrange)."""
    try:
        request, inventory, tps = _prepare(profile, spec, inventory)
    except PlanError:
        return False
    return any(c.candidate is not None and len(c.candidate.groups) >= groups
               for mode in _streaming_modes(request)
               for c in _tries(profile, spec, inventory, request, tps[::-1], options or PlannerOptions(), groups,
                               streaming=mode))


def _memoised(fits: Fits) -> Fits:
    """`fits` answering each question once: the searches ask some twice (a count of devices, or
    one replica and all of them on the same pool)."""
    answers: dict[tuple[str, str, int], bool] = {}

    def memo(spec: ShardedModelSpec, inventory: Inventory, groups: int) -> bool:
        key = (spec.model_dump_json(), inventory.model_dump_json(), groups)
        if key not in answers:
            answers[key] = fits(spec, inventory, groups)
        return answers[key]
    return memo


@dataclass(frozen=True)
class _Question:
    """What a search for suggestions depends on, compared by its JSON: the operator asks the same
    question at every reconcile while nothing changes, and an answer costs several plans."""

    key: str
    profile: ModelProfile = field(compare=False)
    spec: ShardedModelSpec = field(compare=False)
    inventory: Inventory = field(compare=False)
    options: PlannerOptions = field(compare=False)

    @classmethod
    def of(cls, profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
           options: PlannerOptions) -> _Question:
        key = "\n".join((profile.name, profile.digest, spec.model_dump_json(), inventory.model_dump_json(),
                         repr(options)))
        return cls(key, profile, spec, inventory, options)


@functools.lru_cache(maxsize=64)
def _suggest(q: _Question, at_least: int, fitting: int = 0) -> tuple[Suggestion, ...]:
    request = _resolve_request(q.profile, q.spec)
    whole = Shard(tp=1, layers=(0, q.profile.num_layers), embeds=True, has_lm_head=True)
    asked = Asked(dtype=request.dtype, quantization=request.quantization, max_len=request.max_len,
                  batch=request.batch, weights={(d, k): weight_bytes(q.profile, whole, d, k)
                                                for d in ("bfloat16", request.dtype) for k in ("int8",
                                                                                               request.quantization)})
    fits = _memoised(lambda spec, inventory, groups: places(q.profile, spec, inventory, groups, q.options))
    return tuple(suggestions(q.spec, q.inventory, asked, fits, at_least, fitting))


def _layout_words(tp: int, pp: int, replicas: int) -> str:
    return f"tensor={tp} x pipeline={pp}" + (f" x {replicas} replicas" if replicas > 1 else "")


@dataclass(frozen=True)
class Shortage:
    """Some replicas fit and some do not: what the others lack, and what would place them all."""

    message: str
    suggestions: list[Suggestion]


def shortfall(plan: Plan, profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
              options: PlannerOptions | None = None) -> Shortage | None:
    """What the replicas that do not fit lack (None when every replica has its group): the count
    of devices the layout needs against the pool's first, then the checked suggestions."""
    placed, missing = len(plan.groups), plan.replicas - len(plan.groups)
    if missing <= 0:
        return None
    options = options or PlannerOptions()
    used = {(r.node, r.device_index) for r in plan.ranks}
    left = Inventory(devices=[d for d in inventory.devices if (d.node, d.index) not in used])
    like = Counter((r.capacity_bytes, r.product or r.kind) for r in plan.group(plan.groups[0].replica))
    kinds = ", ".join(f"{n} x {human(memory)} ({product})"
                      for (memory, product), n in sorted(like.items(), reverse=True))
    tp, pp, world = plan.tensor_parallel, plan.pipeline_parallel, plan.world_size
    needs = (f"{_layout_words(tp, pp, plan.replicas)} needs {count(plan.replicas * world, 'device')}"
             f"{', tensor-parallel ranks on one node' if tp > 1 else ''}; the pool has {len(inventory.devices)} "
             f"({inventory.describe()})")
    found = list(_suggest(_Question.of(profile, spec, inventory, options),
                          at_least=missing * world - len(left.devices), fitting=placed))
    message = (f"{plan.replicas} replicas wanted, {placed} fit{'s' if placed == 1 else ''}: {needs}. A group takes "
               f"{kinds}; unused now: {left.describe()}. {offer(found, 'run them all')}")
    return Shortage(message, found)


def _weights_phrase(request: Request) -> str:
    return request.dtype if request.quantization == "none" else f"{request.quantization} ({request.dtype} activations)"


def _capacity_needed(profile: ModelProfile, request: Request, inventory: Inventory, tps: list[int],
                     options: PlannerOptions) -> Shortfall:
    whole = Shard(tp=1, layers=(0, profile.num_layers), embeds=True, has_lm_head=True)
    kind = inventory.devices[0].kind
    per_device = options.runtime_overhead[kind] + nvls_bytes(request.nvls, kind, max(tps), False) + \
        activation_bytes(profile, Shard(tp=max(tps), layers=(0, 0), embeds=False, has_lm_head=False),
                         request.max_len, request.batch, request.dtype)
    return Shortfall(weights=weight_bytes(profile, whole, request.dtype, request.quantization),
                     kv_cache=kv_cache_bytes(profile, whole, request.max_len, request.batch, request.dtype),
                     per_device=per_device, devices=tuple(inventory.devices),
                     usable=tuple(int(d.memory_bytes * (1 - request.headroom)) for d in inventory.devices))


def _rank_minimum(profile: ModelProfile, request: Request, options: PlannerOptions, inventory: Inventory,
                  tp: int, pp: int, partition: list[int] | None) -> int:
    """The most loaded rank's bytes at tensor=tp x pipeline=pp with the layers split as evenly as
    they go (or as `partition` says), on devices of unbounded memory like the pool's largest."""
    costs = Costs(profile, request, options)
    largest = max(inventory.devices, key=lambda d: (d.memory_bytes, d.speed))
    shape = (2**62, largest.speed, largest.kind)
    stages = [costs._stage_of(shape, tp, i == 0, i == pp - 1) for i in range(pp)]
    counts = partition or partition_layers(stages, profile.num_layers) or [profile.num_layers]
    return max(s.fixed_bytes + n * s.layer_bytes for s, n in zip(stages, counts, strict=False))


def explain_infeasible(profile: ModelProfile, spec: ShardedModelSpec, request: Request, inventory: Inventory,
                       tps: list[int], options: PlannerOptions, short: Shortfall,
                       offload_note: str = "") -> tuple[str, list[Suggestion]]:
    """Why not one replica fits, the binding constraint first, and what would (checked; what
    streaming layers would do, planned, in `offload_note`)."""
    weights, kv, per_device, need = short.weights, short.kv_cache, short.per_device, short.need
    usable = list(short.usable)
    par = spec.parallelism
    facts = []  # the binding constraint first: a layout given in the spec, then memory in all
    widest = max(Counter(d.node for d in inventory.devices).values())
    if par.tensor != "auto" and par.tensor > widest:
        facts.append(f"spec.parallelism.tensor={par.tensor} needs {par.tensor} devices on one node; the largest "
                     f"node in the pool has {widest}.")
    if par.tensor != "auto" and (par.pipeline != "auto" or par.layer_partition is not None):
        tp = par.tensor
        pp = len(par.layer_partition) if par.layer_partition else int(par.pipeline)
        replicas = max(request.replicas, 1)
        if tp * pp * replicas > len(usable):
            facts.append(f"{_layout_words(tp, pp, replicas)} needs {count(tp * pp * replicas, 'device')}"
                         f"{', tensor-parallel ranks on one node' if tp > 1 else ''}; the pool has {len(usable)}.")
        rank = _rank_minimum(profile, request, options, inventory, tp, pp, par.layer_partition)
        if rank > max(usable):
            split = (f"layerPartition {par.layer_partition}" if par.layer_partition
                     else f"the layers split as evenly as they go over {count(pp, 'stage')}")
            needs, offers = apart(rank, max(usable))
            facts.append(f"at tensor={tp} x pipeline={pp} ({split}) the most loaded rank needs {needs}; the largest "
                         f"device offers {offers} usable ({exactly(rank - max(usable))} short).")
    needs, has = apart(need, sum(usable))
    facts.append(
        f"one replica needs at least {needs} across {count(len(usable), 'device')} ({exactly(weights)} "
        f"of {_weights_phrase(request)} weights and {exactly(kv)} of KV cache for {request.max_len} tokens x "
        f"{count(request.batch, 'sequence')} per replica, plus ~{exactly(per_device)} per device for runtime "
        f"and activations); the pool has {has} usable ({inventory.describe()}, {request.headroom:.0%} headroom)"
        + (f": {exactly(need - sum(usable))} short." if need > sum(usable)
           else ": enough in all, but no split of the layers fits these devices."))
    # What the spec asks that cannot be (streaming int8 weights) is the cause: it comes first.
    cause = offload_note if request.quantization != "none" and offload_note else ""
    if cause:
        facts = [cause.rstrip("."), "without streaming, " + facts[0], *facts[1:]]
        offload_note = ""
    lines = [f"{profile.name} does not fit: {facts[0]}", *(f[0].upper() + f[1:] for f in facts[1:])]
    if inventory.skipped:
        lines.append("Skipped nodes: " + "; ".join(f"{s.node} ({s.reason})" for s in inventory.skipped) + ".")
    largest = max(usable) - per_device
    at_least = math.ceil((need - sum(usable)) / largest) if need > sum(usable) and largest > 0 else 1
    found = list(_suggest(_Question.of(profile, spec, inventory, options), at_least=at_least))
    if found or not offload_note.startswith(STREAMING_FITS):
        lines.append(offer(found))
    if offload_note:
        lines.append(offload_note)
    return "\n".join(lines), found
