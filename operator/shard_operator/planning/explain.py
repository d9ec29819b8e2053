"""When not everything fits: what one replica needs against what the pool has (`Shortfall`), why
not one fits, the binding constraint first (`explain_infeasible`), what the replicas that do not
fit lack (`shortfall`), and what would fit, every suggestion checked by planning again
(`advice.py` decides what to try; `search.places` answers). Pure."""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

from shard_contract.plan import Plan
from shard_contract.units import apart, count, exactly, human

from ..api import OFFLOAD_INT8, ShardedModelSpec
from . import kvcache, offload
from .advice import Asked, Fits, Suggestion, offer, patched, suggestions
from .costs import Costs, partition_layers
from .inventory import Inventory
from .profile import ModelProfile
from .request import PlanError, PlannerOptions, Request, Shortfall, pool_kind, resolve_request
from .search import NothingFits, places, search
from .sizing import Shard, activation_bytes, kv_token_bytes, mask_bytes, nvls_bytes, running_bytes, weight_bytes

STREAMING_FITS = "Streaming layers would fit it (planned): "


def offload_note(profile: ModelProfile, spec: ShardedModelSpec, request: Request, inventory: Inventory,
                  tps: list[int], options: PlannerOptions) -> str:
    """What offload would do for a model that does not fit: fit it (at what speed), or why not."""
    if request.quantization != "none":
        return "" if request.offload.policy == "never" else OFFLOAD_INT8.replace("always", request.offload.policy) + "."
    if request.offload.policy != "never":
        return ("Offload streams the decoder layers' projections only: each rank keeps its KV cache, "
                "activations, runtime, embeddings or LM head and its staging slots resident.")
    # what planning with auto would give (the running-row cap chosen as it would be)
    try:
        fitted = search(profile, patched(spec, {"placement": {"offload": {"policy": "auto"}}}), inventory, options)
    except (NothingFits, PlanError):
        return ""
    per_step = sum(r.offload.streamed_bytes for r in fitted.group(0) if r.offload)
    step = fitted.groups[0].critical_path_seconds
    return (f"{STREAMING_FITS}set spec.placement.offload.policy auto: streaming {offload.layer_count(fitted)} "
            f"({human(per_step)} per decode step over the group) fits it at tensor={fitted.tensor_parallel} x "
            f"pipeline={fitted.pipeline_parallel}, est. {step * 1e3:.2f} ms per decode step ({1 / step:.1f} "
            f"tokens/s per sequence).")


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
    request = resolve_request(q.profile, q.spec, pool_kind(q.inventory))
    whole = Shard(tp=1, layers=(0, q.profile.shape.num_layers), embeds=True, has_lm_head=True)
    weights = {(d, k): weight_bytes(q.profile, whole, d, k)
               for d in ("bfloat16", request.dtype) for k in ("int8", request.quantization)}
    # a cap left to the planner is tried down to one row already: no smaller one to suggest
    asked = Asked(dtype=request.dtype, quantization=request.quantization, max_len=request.max_len,
                  batch=1 if request.rows_chosen else request.batch, weights=weights)
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


def capacity_needed(profile: ModelProfile, request: Request, inventory: Inventory, tps: list[int],
                     options: PlannerOptions) -> Shortfall:
    whole = Shard(tp=1, layers=(0, profile.shape.num_layers), embeds=True, has_lm_head=True)
    kind = inventory.devices[0].kind
    policy = kvcache.kv_policy(request, kind)
    per_device = options.runtime_overhead[kind] + nvls_bytes(request.nvls, kind, max(tps), False) + \
        activation_bytes(profile, Shard(tp=max(tps), layers=(0, 0), embeds=False, has_lm_head=False),
                         request.max_len, request.batch, request.dtype, kind) + kvcache.fixed_bytes(policy) + \
        mask_bytes(request.max_len, request.batch, kvcache.fit_tokens(policy, request), kind)
    kv = kv_token_bytes(profile, 1, profile.shape.num_layers, request.dtype) * kvcache.fit_tokens(policy, request)
    return Shortfall(weights=weight_bytes(profile, whole, request.dtype, request.quantization), kv_cache=kv,
                     per_device=per_device, devices=tuple(inventory.devices),
                     usable=tuple(int(d.memory_bytes * (1 - request.headroom)) for d in inventory.devices))


def _rank_minimum(profile: ModelProfile, request: Request, options: PlannerOptions, inventory: Inventory,
                  tp: int, pp: int, partition: list[int] | None) -> int:
    """The most loaded rank's bytes at tensor=tp x pipeline=pp with the layers split as evenly as
    they go (or as `partition` says), on devices of unbounded memory like the pool's largest."""
    costs = Costs(profile, request, options)
    largest = max(inventory.devices, key=lambda d: (d.memory_bytes, d.speed))
    shape = (2**62, largest.speed, largest.kind)
    stages = [costs.stage_model(shape, tp, i == 0, i == pp - 1) for i in range(pp)]
    counts = partition or partition_layers(stages, profile.shape.num_layers) or [profile.shape.num_layers]
    return max(s.fixed_bytes + n * s.layer_bytes for s, n in zip(stages, counts, strict=False))


def _fixed_kv(request: Request, inventory: Inventory) -> str:
    fixed = kvcache.fixed_bytes(kvcache.kv_policy(request, inventory.devices[0].kind))
    return f" and its KV cache ({exactly(fixed)}, kvCacheMemory)" if fixed else ""


def _rows_fact(profile: ModelProfile, request: Request, inventory: Inventory, tps: list[int],
               found: list[Suggestion]) -> list[str]:
    """What the running-row cap costs, when the spec gives one and a smaller one would fit (a
    suggestion says which); or that the planner tried one row, when it chooses the cap."""
    if request.rows_chosen:
        return ["With maxBatchSize unset it was planned at 1 running row, the least the planner chooses on GPUs."]
    if not any("maxBatchSize" in s.patch.get("model", {}) for s in found):
        return []
    kind = inventory.devices[0].kind
    last = Shard(tp=max(tps), layers=(0, 0), embeds=False, has_lm_head=True)
    rows = running_bytes(profile, last, request.max_len, request.batch, request.dtype, kind) + mask_bytes(
        request.max_len, request.batch, kvcache.fit_tokens(kvcache.kv_policy(request, kind), request), kind)
    return [f"The spec's maxBatchSize {request.batch}: its running rows cost a last-stage rank ~{exactly(rows)} "
            f"beside the KV cache (the sampler's logits, the captured decode steps, the block masks)."]


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
        f"of {_weights_phrase(request)} weights and {exactly(kv)} of KV cache for "
        f"{kvcache.describe_need(kvcache.kv_policy(request, inventory.devices[0].kind), request)} per replica, "
        f"plus ~{exactly(per_device)} per device for runtime and activations"
        f"{_fixed_kv(request, inventory)}); the pool has {has} usable ({inventory.describe()}, "
        f"{request.headroom:.0%} headroom)"
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
    lines += _rows_fact(profile, request, inventory, tps, found)
    if found or not offload_note.startswith(STREAMING_FITS):
        lines.append(offer(found))
    if offload_note:
        lines.append(offload_note)
    return "\n".join(lines), found
