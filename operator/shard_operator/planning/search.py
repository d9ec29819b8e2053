"""The search: for every tensor and pipeline degree worth trying, place as many replicas as fit
on the pool's blocks, and choose among the layouts that place the most; then the Plan of the one
chosen. Pure and deterministic; what the steps are is the package's docstring."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from shard_contract.plan import GroupPlan, OffloadPlan, Plan, PredictedBytes, RankPlan, StagePlan
from shard_contract.sharding import kv_pool_tokens, valid_tensor_degrees
from shard_contract.units import count

from ..api import ShardedModelSpec
from . import kvcache, offload, rowcap
from .blocks import Block, BlockPool, arrangements, make_blocks
from .costs import Costs
from .inventory import Inventory, SkippedNode
from .profile import ModelProfile
from .request import (
    AUTO_FALLBACK,
    DEFAULT_MAX_BATCH,
    PlanError,
    PlannerOptions,
    Request,
    check_parallelism,
    pool_kind,
    resolve_request,
)
from .sizing import (
    Shard,
    activation_bytes,
    kv_token_bytes,
    layer_copied_bytes,
    layer_read_bytes,
    layer_streamed_bytes,
    mask_bytes,
    mask_token_bytes,
    running_bytes,
    weight_bytes,
)


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


class NothingFits(Exception):
    """No layout places even one group: what `plan` explains."""

    def __init__(self, request: Request, inventory: Inventory, tps: list[int]):
        self.request, self.inventory, self.tps = request, inventory, tps


def search(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, options: PlannerOptions) -> Plan:
    """The Plan of the layout chosen among those that place the most groups; NothingFits when not
    one group fits anywhere (what `planner.plan` explains). With maxBatchSize left to the planner,
    the largest cap that places as many groups as one row does (`rowcap.py`)."""
    request, inventory, tps, tried = _with_cap(profile, spec, inventory, options)
    found, streaming = tried[request.batch]
    if not found:
        raise NothingFits(request, inventory, tps)
    found, best = pick(found, options.tolerance)
    request, why = _fallback_dtype(request, spec, best)
    result = to_plan(profile, spec, request, Costs(profile, request, options, streaming), best, found)
    larger = tried.get(2 * request.batch)
    note = rowcap.explain(request.batch, DEFAULT_MAX_BATCH["gpu"], request.max_len,
                          _score(larger, request) if larger else None, running_cost(profile, result)) \
        if request.rows_chosen else ""
    reason = "; ".join(filter(None, [result.reason + why, note]))
    return result.model_copy(update={"reason": reason}) if reason != result.reason else result


Tried = dict[int, tuple[list[Candidate], bool]]  # per cap: the layouts that fit, and whether they stream


def _with_cap(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
              options: PlannerOptions) -> tuple[Request, Inventory, list[int], Tried]:
    """The request with its running-row cap (as given, or chosen: `rowcap.choose`), the devices,
    the tensor degrees, and the layouts found at every cap tried (the chosen one's among them)."""
    request, inventory, tps = prepare(profile, spec, inventory)
    tried: Tried = {}

    def score(cap: int) -> rowcap.Score:
        if cap not in tried:
            tried[cap] = _layouts(profile, spec, inventory, replace(request, batch=cap), tps, options)
        return _score(tried[cap], request)

    cap = rowcap.choose(rowcap.caps(request), score, max(request.replicas, 1))
    score(cap)
    return replace(request, batch=cap), inventory, tps, tried


def _score(layouts: tuple[list[Candidate], bool], request: Request) -> rowcap.Score:
    """Groups placed, and whether without streaming layers the spec does not ask to stream."""
    found, streaming = layouts
    return max((len(c.groups) for c in found), default=0), not streaming or request.offload.policy == "always"


def _layouts(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, request: Request,
             tps: list[int], options: PlannerOptions) -> tuple[list[Candidate], bool]:
    """The layouts that fit, and whether their layers stream: offload auto streams only when
    holding every layer places fewer groups than streaming does."""
    streaming, *then = streaming_modes(request)
    found = fitting(profile, spec, inventory, request, tps, options, streaming)
    placed = max((len(c.groups) for c in found), default=0)
    if then and placed < max(request.replicas, 1):
        more = fitting(profile, spec, inventory, request, tps, options, streaming=True)
        # auto: only when streaming places more replicas than holding every layer does
        if max((len(c.groups) for c in more), default=0) > placed:
            found, streaming = more, True
    return found, streaming


def running_cost(profile: ModelProfile, plan: Plan) -> int:
    """What the plan's running rows cost its most loaded rank beyond the KV cache (the sampler,
    the captured decode steps, the block masks over its pool)."""
    return max((running_bytes(profile, Shard(tp=plan.tensor_parallel, layers=r.layers, embeds=r.embeds,
                                             has_lm_head=r.has_lm_head), plan.max_model_len, plan.max_batch_size,
                              plan.dtype, r.kind)
                + mask_bytes(plan.max_model_len, plan.max_batch_size, kv_pool_tokens(r.kv_cache_tokens), r.kind)
                for r in plan.ranks), default=0)


def streaming_modes(request: Request) -> list[bool]:
    """Whether layers may stream, in the order `search` tries: `always` streams, `never` does not,
    `auto` holds every layer first and streams only when that places too few (never int8)."""
    policy = request.offload.policy
    return [policy == "always"] + ([True] if policy == "auto" and request.quantization == "none" else [])


def pick(found: list[Candidate], tolerance: float) -> tuple[list[Candidate], Candidate]:
    """The layouts that place the most groups, and the one chosen among them."""
    most = max(len(c.groups) for c in found)
    found = [c for c in found if len(c.groups) == most]
    return found, _choose(found, tolerance)


def fitting(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, request: Request,
            tps: list[int], options: PlannerOptions, streaming: bool = False) -> list[Candidate]:
    """The layouts that place at least one group."""
    return [c.candidate for c in _tries(profile, spec, inventory, request, tps, options, streaming=streaming)
            if c.candidate is not None]


def consider(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
             options: PlannerOptions) -> tuple[Request, list[int], list[Considered]]:
    """Every layout the planner tries, in order (`plan` chooses among those that fit)."""
    request, inventory, tps, _ = _with_cap(profile, spec, inventory, options)
    streaming = streaming_modes(request)[0]
    return request, tps, list(_tries(profile, spec, inventory, request, tps, options, streaming=streaming))


def prepare(profile: ModelProfile, spec: ShardedModelSpec,
            inventory: Inventory) -> tuple[Request, Inventory, list[int]]:
    """The request, the devices that can run it and the tensor degrees to try; a PlanError for a
    spec no pool could run."""
    request = resolve_request(profile, spec, pool_kind(inventory))
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
            if room and sum(room[:groups * pp]) < groups * profile.shape.num_layers:
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
    layers = costs.profile.shape.num_layers
    return sorted((min(max(costs.stage_model(b.shape, tp, False, False).capacity(), 0), layers) for b in blocks),
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


def _tensor_candidates(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory) -> list[int]:
    per_node: dict[str, int] = {}
    for d in inventory.devices:
        per_node[d.node] = per_node.get(d.node, 0) + 1
    widest = max(per_node.values())
    tensor = spec.parallelism.tensor
    return valid_tensor_degrees(profile.shape, widest) if tensor == "auto" else [tensor]


def _pipeline_candidates(profile: ModelProfile, spec: ShardedModelSpec) -> list[int]:
    pipeline, partition = spec.parallelism.pipeline, spec.parallelism.layer_partition
    if partition is not None:
        return [len(partition)]
    if pipeline == "auto":
        return list(range(1, profile.shape.num_layers + 1))
    return [pipeline]


def _layout(costs: Costs, blocks: list[Block], tp: int, partition: list[int] | None) -> GroupLayout | None:
    counts = costs.partition(tuple(b.shape for b in blocks), tp, partition)
    if counts is None:
        return None
    last = len(blocks) - 1
    seconds = [costs.seconds(b.shape, tp, i == 0, i == last, n)
               for i, (b, n) in enumerate(zip(blocks, counts, strict=False))]
    hops = sum(costs.options.transport.hop(a.kind, a.node == b.node) for a, b in itertools.pairwise(blocks))
    return GroupLayout(blocks=blocks, counts=counts, stage_seconds=seconds, critical_path=sum(seconds) + hops)


def _place_replicas(costs: Costs, blocks: list[Block], tp: int, pp: int, replicas: int,
                    partition: list[int] | None) -> Candidate | None:
    pool = BlockPool(blocks)
    used_nodes: set[str] = set()
    groups = []
    for _ in range(replicas):
        best: GroupLayout | None = None
        for chosen in pool.selections(pp, used_nodes if costs.request.spread_replicas else set()):
            for arranged in arrangements(chosen):
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
def to_plan(profile: ModelProfile, spec: ShardedModelSpec, request: Request, costs: Costs,
            best: Candidate, found: list[Candidate]) -> Plan:
    """The Plan of the chosen layout: every rank's place, layers and predicted bytes, and why."""
    tp, pp = best.tp, best.pp
    streamed = [layer_streamed_bytes(profile, i, tp, request.dtype) for i in range(profile.shape.num_layers)]
    read = [layer_read_bytes(profile, i, tp) for i in range(profile.shape.num_layers)]
    copied = {kind: [layer_copied_bytes(profile, i, tp, request.dtype, kind) for i in range(profile.shape.num_layers)]
              for kind in ("gpu", "cpu")}
    groups, ranks = [], []
    for replica, layout in enumerate(best.groups if request.replicas else []):
        starts = list(itertools.accumulate([0, *layout.counts]))
        stages, sized = [], []
        for stage, block in enumerate(layout.blocks):
            layers = (starts[stage], starts[stage + 1])
            stages.append(StagePlan(stage=stage, layers=layers, seconds_per_token=layout.stage_seconds[stage]))
            shard = Shard(tp=tp, layers=layers, embeds=stage == 0, has_lm_head=stage == pp - 1)
            off = offload.rank_offload(costs.offload_stage(block.shape, tp, shard.embeds, shard.has_lm_head),
                                       layers, streamed, copied[block.kind], read) if costs.streaming else None
            predicted = PredictedBytes(
                weights=weight_bytes(profile, shard, request.dtype, request.quantization)
                - (sum(streamed[i] for i in off.layers) if off else 0),
                kv_cache=0,
                activations=activation_bytes(profile, shard, request.max_len, request.batch, request.dtype,
                                             block.kind),
                overhead=costs.overhead(block.kind, tp, pp > 1),
                staging=off.prefetch * max(copied[block.kind][i] for i in off.layers) if off else 0)
            sized.append((block, shard, off, predicted))
        tokens = group_kv_tokens(profile, request, costs, tp, sized)
        for stage, (block, shard, off, predicted) in enumerate(sized):
            kv = kv_token_bytes(profile, tp, shard.layers[1] - shard.layers[0], request.dtype) * kv_pool_tokens(tokens)
            masks = mask_bytes(request.max_len, request.batch, kv_pool_tokens(tokens), block.kind)
            predicted = PredictedBytes(**{**predicted.model_dump(exclude={"total"}), "kv_cache": kv,
                                          "activations": predicted.activations + masks})
            for tp_rank, device in enumerate(block.devices):
                ranks.append(RankPlan(
                    replica=replica, rank=stage * tp + tp_rank, stage=stage, tp_rank=tp_rank,
                    node=device.node, device=device.name, device_index=device.index, kind=device.kind,
                    product=device.product, layers=shard.layers, embeds=shard.embeds,
                    has_lm_head=shard.has_lm_head, capacity_bytes=device.memory_bytes,
                    usable_bytes=int(device.memory_bytes * (1 - request.headroom)),
                    predicted_bytes=predicted, offload=off, kv_cache_tokens=tokens))
        mean = sum(layout.stage_seconds) / pp
        groups.append(GroupPlan(replica=replica, stages=stages, imbalance=layout.bottleneck / mean - 1,
                                critical_path_seconds=layout.critical_path))
    return Plan(
        model=profile.name, architecture=profile.shape.architecture, profile_digest=profile.digest,
        dtype=request.dtype, quantization=request.quantization, offload=request.offload,
        num_layers=profile.shape.num_layers,
        tensor_parallel=tp, pipeline_parallel=pp,
        replicas=request.replicas, max_model_len=request.max_len, max_batch_size=request.batch,
        memory_headroom=request.headroom, nvls=request.nvls, groups=groups, ranks=ranks,
        kv_cache_memory_fraction=request.kv_fraction, kv_cache_memory=request.kv_bytes,
        max_batch_size_chosen=request.rows_chosen,
        reason="; ".join(filter(None, [_reason(spec, best, found), offload.summary(ranks, request.offload.policy)])))


def group_kv_tokens(profile: ModelProfile, request: Request, costs: Costs, tp: int,
                    sized: list[tuple[Block, Shard, OffloadPlan | None, PredictedBytes]]) -> int:
    """Tokens of KV cache a group's ranks hold: what its most constrained rank holds of what its
    device leaves free below the headroom after its weights, activations, overhead and staging
    (each token's keys and values, and its share of the block masks the passes build over it)."""
    held = []
    for block, shard, _, predicted in sized:
        usable = min(int(d.memory_bytes * (1 - request.headroom)) for d in block.devices)
        per_token = kv_token_bytes(profile, tp, shard.layers[1] - shard.layers[0], request.dtype) \
            + mask_token_bytes(request.max_len, request.batch, block.kind)
        held.append(kvcache.rank_tokens(costs.kv_policy(block.kind), usable - predicted.total, per_token, request))
    return min(held)


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


def places(profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, groups: int,
           options: PlannerOptions | None = None) -> bool:
    """Whether `plan` places at least `groups` groups (how the suggestions are checked): the same
    answer as planning and counting, sooner. Only the layouts that could place them are tried
    (enough blocks, and the roomiest of them hold the layers by the planner's own stage sizes),
    and the first that does answers yes. Each tensor degree's layouts are tried apart from the
    others', so their order does not change the answer: the widest first, which usually answers
    yes soonest (fewer stages to arrange)."""
    try:
        request, inventory, tps = prepare(profile, spec, inventory)
    except PlanError:
        return False
    request = replace(request, batch=rowcap.caps(request)[-1])  # a chosen cap places what one row does
    return any(c.candidate is not None and len(c.candidate.groups) >= groups
               for mode in streaming_modes(request)
               for c in _tries(profile, spec, inventory, request, tps[::-1], options or PlannerOptions(), groups,
                               streaming=mode))


