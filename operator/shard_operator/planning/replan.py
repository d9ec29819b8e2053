"""When to plan again, and how little to move. Pure.

The current plan is kept while it is valid: the spec and checkpoint still ask for it, and every
group's devices are still in the pool. Scaling adds or drops whole groups and leaves the others
where they are. A group whose devices left the pool is re-planned on what the others leave, with
the same tensor and pipeline degrees; only if that fails are all groups planned afresh. When not
every replica fits, as many groups run as fit, whatever the history (scaling 3 -> 0 -> 2 and 1 -> 2
on a pool of one group both run one), and `PlanChoice.shortfall` says what the others lack; they
are placed as soon as the pool has room. A pool that merely grew replaces running groups only when
the decode step gets clearly faster.

A group that replaces a serving one (a new revision: the spec, the template or the pool changed)
is placed where it can start at once when the pool has room beside the serving groups
(`make_room`), so a rollout surges onto free nodes; on a full pool it is placed where its own
serving group is, to replace it in place when maxUnavailable allows.

Inventory-driven changes wait until the inventory has settled (the caller's settle window), so a
flapping node causes no churn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from shard_contract.plan import Plan
from shard_contract.units import gib

from ..api import Parallelism, ShardedModelSpec
from . import AUTO_FALLBACK, PlanError, PlannerOptions, places, plan, resolve_request, shortfall
from .inventory import Device, Inventory, SkippedNode
from .profile import ModelProfile


@dataclass(frozen=True)
class PlanChoice:
    plan: Plan
    kind: str  # initial | unchanged | respec | scaled | repaired | improved | replanned | moved (make_room)
    message: str = ""
    waiting: bool = False  # an inventory change is seen but not acted on yet (settle window)
    shortfall: str = ""  # what the replicas that do not fit lack ("" when all fit)


def critical_path(p: Plan) -> float:
    return max((g.critical_path_seconds for g in p.groups), default=0.0)


def without_devices(inventory: Inventory, taken: Mapping[Any, int],
                    key: Callable[[Device], Hashable] = lambda d: d.node) -> Inventory:
    """The pool minus `taken[key(device)]` devices of each key (highest indices first): per node
    for GPUs other workloads hold, per (node, memory) for the devices of groups that stay."""
    left = Counter(taken)
    devices: list[Device] = []
    for d in sorted(inventory.devices, key=lambda d: (d.node, -d.index)):
        if left[key(d)] > 0:
            left[key(d)] -= 1
        else:
            devices.append(d)
    return Inventory(devices=sorted(devices, key=lambda d: (d.node, d.index)), skipped=inventory.skipped)


def without_held(inventory: Inventory, held: Mapping[str, int]) -> Inventory:
    """The pool minus the GPUs other workloads hold on each node; a node left with none is listed
    as skipped, so "no usable devices" says why."""
    left = without_devices(inventory, held)
    emptied = sorted({d.node for d in inventory.devices} - {d.node for d in left.devices})
    return left.model_copy(update={"skipped": [*left.skipped, *(
        SkippedNode(node=node, reason=f"other workloads hold its {held[node]} GPUs") for node in emptied)]})


def incompatibility(current: Plan, profile: ModelProfile, spec: ShardedModelSpec) -> str | None:
    """Why the spec or checkpoint no longer allows the current plan (None: it still does)."""
    if current.profile_digest != profile.digest or current.model != profile.name:
        return "the checkpoint changed"
    request = resolve_request(profile, spec, "gpu" if any(r.kind == "gpu" for r in current.ranks) else "cpu")
    # an unset maxBatchSize on GPUs allows whatever cap the planner chose (rowcap.py), and no other
    rows: int | str = request.batch
    if request.rows_chosen:
        rows = current.max_batch_size if current.max_batch_size_chosen else "the planner's choice"
    for what, old, new in (("dtype", current.dtype, request.dtype),
                           ("quantization", current.quantization, request.quantization),
                           ("maxModelLen", current.max_model_len, request.max_len),
                           ("maxBatchSize", current.max_batch_size, rows),
                           ("memoryHeadroom", current.memory_headroom, request.headroom),
                           ("nccl.nvls", current.nvls, request.nvls),
                           ("serving.kvCacheMemoryFraction", current.kv_cache_memory_fraction, request.kv_fraction),
                           ("serving.kvCacheMemory", current.kv_cache_memory, request.kv_bytes)):
        fell_back = what == "dtype" and spec.model.dtype == "auto" and AUTO_FALLBACK.get(str(new)) == old
        if old != new and not fell_back:
            return f"{what} changed from {old} to {new}"
    if current.offload != request.offload:
        return "placement.offload changed"
    par = spec.parallelism
    if par.tensor != "auto" and par.tensor != current.tensor_parallel:
        return f"tensor changed from {current.tensor_parallel} to {par.tensor}"
    if par.pipeline != "auto" and par.pipeline != current.pipeline_parallel:
        return f"pipeline changed from {current.pipeline_parallel} to {par.pipeline}"
    if par.layer_partition is not None:
        for g in current.groups:
            counts = [s.layers[1] - s.layers[0] for s in g.stages]
            if counts != list(par.layer_partition):
                return f"layerPartition changed to {par.layer_partition}"
    return None


def _group_needs(p: Plan, replica: int) -> Counter:
    return Counter((r.node, r.capacity_bytes) for r in p.group(replica))


def _fits(needs: Counter, inventory: Inventory, used: Counter) -> bool:
    have = Counter((d.node, d.memory_bytes) for d in inventory.devices)
    return all(have[k] - used[k] >= n for k, n in needs.items())


def _subset(current: Plan, keep: list[int], replicas: int) -> Plan:
    kept = set(keep)
    return current.model_copy(update={
        "replicas": replicas,
        "groups": [g for g in current.groups if g.replica in kept],
        "ranks": [r for r in current.ranks if r.replica in kept]})


def _merge(base: Plan, extra: Plan, slots: list[int], replicas: int) -> Plan:
    """`base` plus the groups of `extra`, renumbered into the free replica `slots`."""
    renumber = {g.replica: slot for g, slot in zip(extra.groups, slots, strict=False)}
    groups = base.groups + [g.model_copy(update={"replica": renumber[g.replica]}) for g in extra.groups]
    ranks = base.ranks + [r.model_copy(update={"replica": renumber[r.replica]}) for r in extra.ranks]
    return base.model_copy(update={"replicas": replicas, "groups": sorted(groups, key=lambda g: g.replica),
                                   "ranks": sorted(ranks, key=lambda r: (r.replica, r.rank))})


def choose_plan(current: Plan | None, profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory, *,
                settled: bool = True, reconsider: bool = False, improvement: float = 0.10,
                options: PlannerOptions | None = None) -> PlanChoice:
    """The plan to run now: as many of the spec's replicas as fit (`shortfall` says what the others
    lack). Raises PlanError when not even one fits.

    settled: inventory-driven changes may be acted on. reconsider: look for a clearly faster plan
    on the current pool (the caller asks once per settled inventory).
    """
    choice = _choose(current, profile, spec, inventory, settled, reconsider, improvement, options)
    shortage = shortfall(choice.plan, profile, spec, inventory, options)
    return replace(choice, shortfall=shortage.message if shortage else "")


def _choose(current: Plan | None, profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
            settled: bool, reconsider: bool, improvement: float, options: PlannerOptions | None) -> PlanChoice:
    if current is None:
        first = plan(profile, spec, inventory, options)
        return PlanChoice(first, "initial", f"planned {_shape(first)}: {first.reason}")
    why = incompatibility(current, profile, spec)
    if why is not None:
        respec = plan(profile, spec, inventory, options)
        return PlanChoice(respec, "respec", f"re-planned because {why}: {_shape(respec)}")

    replicas = spec.replicas
    used: Counter = Counter()
    keep, lost = [], []
    for g in current.groups:
        if g.replica >= replicas:
            continue
        needs = _group_needs(current, g.replica)
        if _fits(needs, inventory, used):
            keep.append(g.replica)
            used.update(needs)
        else:
            lost.append(g.replica)
    waiting = bool(lost) and not settled
    if waiting:
        keep = sorted(keep + lost)
        lost = []
    missing = [r for r in range(replicas) if r not in keep]
    kept = _subset(current, keep, replicas)

    if not missing:
        if reconsider and settled:
            fresh: Plan | None
            try:
                fresh = plan(profile, spec, inventory, options)
            except PlanError:
                fresh = None
            if fresh is not None and len(fresh.groups) == replicas and \
                    critical_path(fresh) < critical_path(kept) * (1 - improvement):
                return PlanChoice(fresh, "improved", f"the pool changed: {_shape(fresh)} takes "
                                  f"{critical_path(fresh) * 1e3:.2f} ms per decode step instead of "
                                  f"{critical_path(kept) * 1e3:.2f} ms{_streaming_change(kept, fresh)}")
            # offload: a pool that now holds more of the model streams less, at no cost in speed
            if fresh is not None and len(fresh.groups) == replicas and streamed(fresh) < streamed(kept) \
                    and critical_path(fresh) <= critical_path(kept):
                return PlanChoice(fresh, "improved", f"the pool changed: {_shape(fresh)}"
                                  f"{_streaming_change(kept, fresh)}")
        if replicas != current.replicas:
            return PlanChoice(kept, "scaled", f"scaled from {current.replicas} to {replicas} groups", waiting)
        return PlanChoice(kept, "unchanged", "", waiting)

    # Place the missing groups on what the kept ones leave, with the same degrees; if not all of
    # them fit there, a plan made afresh wins when it runs more groups.
    pinned = spec.model_copy(update={"replicas": len(missing), "parallelism": Parallelism(
        tensor=current.tensor_parallel, pipeline=current.pipeline_parallel,
        layer_partition=spec.parallelism.layer_partition)})
    try:
        left = without_devices(inventory, used, key=lambda d: (d.node, d.memory_bytes))
        merged = _merge(kept, plan(profile, pinned, left, options), missing, replicas)
    except PlanError:
        merged = kept
    if lost:
        what = f"group {', '.join(map(str, lost))} lost {'its' if len(lost) == 1 else 'their'} devices"
    elif replicas != current.replicas:
        what = f"scaled from {current.replicas} to {replicas} groups"
    else:
        what = f"{len(kept.groups)} of {replicas} groups ran for want of room"
    if len(merged.groups) < replicas:
        try:
            fresh = plan(profile, spec, inventory, options)
        except PlanError:
            if not merged.groups:
                raise
            fresh = merged
        if len(fresh.groups) > len(merged.groups):
            return PlanChoice(fresh, "replanned", f"{what}; they do not fit beside the others, so every "
                              f"group was planned again: {_shape(fresh)}")
    if merged.hash == current.hash and merged.replicas == current.replicas:
        return PlanChoice(merged, "unchanged", "", waiting)
    added = [r for r in missing if merged.group(r)]
    placed = "; ".join(f"group {r} on {', '.join(sorted({x.node for x in merged.group(r)}))}" for r in added)
    return PlanChoice(merged, "repaired" if lost else "scaled",
                      f"{what}: {placed}" if added else f"{what}; the pool has no room for more groups", waiting)


# ---------------------------------------------------------------- room for replacements
@dataclass(frozen=True)
class Room:
    plan: Plan
    moved: list[str]  # what moved, e.g. "group 0 starts on c, d, beside the serving group"


def make_room(p: Plan, profile: ModelProfile, spec: ShardedModelSpec, inventory: Inventory,
              free: Mapping[str, int], replacing: Mapping[int, Mapping[str, int]], started: set[int],
              options: PlannerOptions | None = None) -> Room:
    """`p` with each replacement group placed where it can start: beside the serving groups when
    the pool has room (a surge), else on its own serving group's devices (in place).

    `free`: GPUs nobody holds on each node; `replacing`: replica -> GPUs its older groups hold on
    each node (they go once the new group is ready, or first, in place); `started`: replicas whose
    new group has pods already (never moved). Groups are taken in replica order, each leaving what
    it takes to the next; a group that fits where `p` put it stays there.
    """
    left: Counter = Counter({node: n for node, n in free.items() if n > 0})
    moved: list[str] = []
    for replica in [g.replica for g in p.groups]:
        needs = Counter(r.node for r in p.group(replica))
        if replica in started:
            continue
        if replica not in replacing or _within(needs, left):
            left.subtract(needs)
            continue
        beside = _place_one(p, replica, profile, spec, _devices_on(inventory, left), options)
        if beside is not None:
            p = beside
            left.subtract(Counter(r.node for r in p.group(replica)))
            moved.append(f"group {replica} starts on {_nodes(p, replica)}, where the pool has room beside the "
                         "serving group")
            continue
        own = left + Counter(replacing[replica])
        if _within(needs, own):
            continue  # in place, where it is planned
        in_place = _place_one(p, replica, profile, spec, _devices_on(inventory, own), options)
        if in_place is not None:
            p = in_place
            moved.append(f"group {replica} is planned on {_nodes(p, replica)}, to replace its serving group in "
                         "place (the pool has no room beside it)")
    return Room(p, moved)


def _within(needs: Counter, have: Counter) -> bool:
    return all(have[node] >= n for node, n in needs.items())


def _devices_on(inventory: Inventory, counts: Mapping[str, int]) -> Inventory:
    """At most `counts[node]` devices of each node of the pool."""
    taken: Counter = Counter()
    devices = []
    for d in inventory.devices:
        if taken[d.node] < counts.get(d.node, 0):
            taken[d.node] += 1
            devices.append(d)
    return Inventory(devices=devices)


def _place_one(p: Plan, replica: int, profile: ModelProfile, spec: ShardedModelSpec, devices: Inventory,
               options: PlannerOptions | None) -> Plan | None:
    """`p` with group `replica` planned afresh on `devices`, at the plan's degrees; None if it fits nowhere there."""
    pinned = spec.model_copy(update={"replicas": 1, "parallelism": Parallelism(
        tensor=p.tensor_parallel, pipeline=p.pipeline_parallel, layer_partition=spec.parallelism.layer_partition)})
    if not devices.devices or not places(profile, pinned, devices, 1, options):
        return None
    try:
        one = plan(profile, pinned, devices, options)
    except PlanError:
        return None
    if (one.dtype, one.quantization) != (p.dtype, p.quantization):
        return None  # devices without native bfloat16 would run another dtype than the plan's
    others = [g.replica for g in p.groups if g.replica != replica]
    return _merge(_subset(p, others, p.replicas), one, [replica], p.replicas)


def _nodes(p: Plan, replica: int) -> str:
    return ", ".join(sorted({r.node for r in p.group(replica)}))


def streamed(p: Plan) -> int:
    """Bytes a decode step streams in, over every rank of the plan (offload)."""
    return sum(r.offload.streamed_bytes for r in p.ranks if r.offload is not None)


def _streaming_change(kept: Plan, fresh: Plan) -> str:
    if streamed(fresh) == streamed(kept):
        return ""
    if not fresh.streams:
        return f"; it holds every layer (streaming {gib(streamed(kept))} GiB per step before)"
    return f"; it streams {gib(streamed(fresh))} GiB per decode step instead of {gib(streamed(kept))} GiB"


def _shape(p: Plan) -> str:
    of = f" of {p.replicas}" if len(p.groups) < p.replicas else ""
    return (f"tensor={p.tensor_parallel} x pipeline={p.pipeline_parallel}, {len(p.groups)}{of} "
            f"group{'s' if p.replicas != 1 else ''}")
