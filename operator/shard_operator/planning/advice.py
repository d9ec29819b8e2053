"""What would make a model fit: changes to the spec or the pool that the planner has checked. Pure.

The planner's message says what is missing; these say what to do about it. A suggestion is a
change to the spec (a patch in the YAML's own terms), devices added to the pool, or both, and it
is offered only when planning again with it applied places every replica the spec asks for. The
planning is handed in (`Fits`), so this module decides what to try and the planner alone decides
what fits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shard_contract.units import count, gib, human

from ..api import ShardedModelSpec, parse_spec
from .inventory import Device, Inventory

# Whether planning `spec` on `inventory` places at least this many groups (replicas).
Fits = Callable[[ShardedModelSpec, Inventory, int], bool]

# The most devices an "add devices" suggestion may add: beyond this the answer is another pool.
MAX_ADDED_DEVICES = 256
SHORTEST_CONTEXT = 128  # maxModelLen is not lowered below this: such a model serves little


@dataclass(frozen=True)
class Suggestion:
    text: str
    patch: dict[str, Any] = field(default_factory=dict)  # merged into the spec (camelCase keys)
    add: tuple[Device, ...] = ()  # devices added to the pool
    memory_factor: int = 1  # every device of the pool with this many times its memory

    def apply(self, spec: ShardedModelSpec, inventory: Inventory) -> tuple[ShardedModelSpec, Inventory]:
        devices = [d.model_copy(update={"memory_bytes": d.memory_bytes * self.memory_factor})
                   for d in inventory.devices] if self.memory_factor != 1 else inventory.devices
        return patched(spec, self.patch), Inventory(devices=[*devices, *self.add], skipped=inventory.skipped)


def patched(spec: ShardedModelSpec, patch: dict[str, Any]) -> ShardedModelSpec:
    """`spec` with `patch` merged in (a JSON merge patch: None removes a field)."""
    def merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in change.items():
            if value is None:
                out.pop(key, None)
            elif isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out
    return parse_spec(merge(spec.dump(), patch)) if patch else spec


def works(fits: Fits, spec: ShardedModelSpec, inventory: Inventory, suggestion: Suggestion) -> bool:
    """Planning again with `suggestion` applied places every replica of the spec."""
    new_spec, new_inventory = suggestion.apply(spec, inventory)
    return fits(new_spec, new_inventory, max(new_spec.replicas, 1))


@dataclass(frozen=True)
class Asked:
    """What the spec asks for, as the planner resolved it (dtype "auto" and maxModelLen unset
    become the checkpoint's), and the bytes of the model's weights by (dtype, quantization)."""

    dtype: str
    quantization: str
    max_len: int
    batch: int
    weights: dict[tuple[str, str], int] = field(default_factory=dict, hash=False, compare=False)


Change = tuple[str, dict[str, Any]]  # words and a spec patch


def spec_changes(spec: ShardedModelSpec, asked: Asked) -> list[list[Change]]:
    """Changes to the spec alone worth trying: one list per kind of change, mildest first, each
    one asking no more than the next (a shorter maxModelLen fits wherever a longer one does)."""
    par = spec.parallelism
    fixed_tp, fixed_pp = par.tensor != "auto", par.pipeline != "auto" or par.layer_partition is not None
    parallelism: list[Change] = []
    if par.layer_partition is not None:
        parallelism.append(("drop layerPartition, so the planner splits the layers by memory and speed",
                            {"parallelism": {"layerPartition": None}}))
    if fixed_pp:
        parallelism.append(("set pipeline: auto", {"parallelism": {"pipeline": "auto", "layerPartition": None}}))
    if fixed_tp:
        parallelism.append(("set tensor: auto", {"parallelism": {"tensor": "auto"}}))
    if fixed_tp and fixed_pp:
        parallelism.append(("set tensor: auto and pipeline: auto",
                            {"parallelism": {"tensor": "auto", "pipeline": "auto", "layerPartition": None}}))
    lengths = [asked.max_len // 2**k for k in range(1, 7) if asked.max_len // 2**k >= SHORTEST_CONTEXT]
    batches = [asked.batch // 2**k for k in range(1, asked.batch.bit_length())]  # halved down to 1
    kinds = [parallelism,
             [(f"lower maxModelLen to {n} (from {asked.max_len}; the KV cache shrinks with it)",
               {"model": {"maxModelLen": n}}) for n in lengths],
             [(f"lower maxBatchSize to {n} (from {asked.batch})", {"model": {"maxBatchSize": n}}) for n in batches],
             [(f"set dtype: bfloat16 (weights {gib(asked.weights[('bfloat16', asked.quantization)])} GiB)",
               {"model": {"dtype": "bfloat16"}})] if asked.dtype == "float32" else [],
             [(f"set quantization: int8 (weights {gib(asked.weights[(asked.dtype, 'int8')])} GiB)",
               {"model": {"quantization": "int8"}})]
             # int8 weights are never streamed: no int8 where the spec asks to stream always
             if asked.quantization == "none" and spec.placement.offload.policy != "always" else []]
    return [kind for kind in kinds if kind]


def _mildest(changes: list[Change], good: Callable[[Change], bool]) -> Change | None:
    """The mildest change of a kind that works: none when the most far-reaching does not (so a
    kind that cannot help costs one plan), else the first that works by bisection (only a checked
    change is returned)."""
    if not good(changes[-1]):
        return None
    lo, hi = 0, len(changes) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if good(changes[mid]):
            hi = mid
        else:
            lo = mid + 1
    return changes[hi]


def suggestions(spec: ShardedModelSpec, inventory: Inventory, asked: Asked, fits: Fits,
                at_least: int = 1, fitting: int = 0) -> list[Suggestion]:
    """Every change tried that places all of the spec's replicas: more devices first (or bigger
    ones), then the mildest change of each kind of the spec that does (the largest maxModelLen
    that fits, not every smaller one too), and with `fitting` groups placed already, fewer
    replicas. `at_least`: devices the pool lacks by its bytes alone, where the search starts."""
    kinds = spec_changes(spec, asked)
    relax = next((kind[-1] for kind in kinds if "parallelism" in kind[-1][1]), None)
    out = device_suggestions(spec, inventory, fits, at_least, relax, fitting)
    for kind in kinds:
        change = _mildest(kind, lambda c: works(fits, spec, inventory, Suggestion(*c)))
        if change is not None:
            out.append(Suggestion(*change))
    fewer = Suggestion(f"lower spec.replicas to {fitting}", {"replicas": fitting})
    if fitting and works(fits, spec, inventory, fewer):
        out.append(fewer)
    return out


def offer(found: list[Suggestion], goal: str = "make it fit") -> str:
    """The sentence that offers them (each was checked by planning again)."""
    if not found:
        return (f"Nothing tried would {goal} (more or bigger devices, auto parallelism, a shorter maxModelLen, "
                "a smaller batch, bfloat16, int8 weights).")
    return f"To {goal} (each checked by planning again): " + "; or ".join(s.text for s in found) + "."


def _like(device: Device, node: str, index: int) -> Device:
    return device.model_copy(update={"node": node, "index": index})


def more_devices(inventory: Inventory, n: int) -> tuple[tuple[Device, ...], str, str]:
    """`n` devices like the pool's largest, how many (words) and what and where: on its node when
    the pool is one node (a machine or a server grows), else as whole nodes like that node (a
    cluster grows by nodes; `n` is then rounded up to whole nodes)."""
    # Ties go to the first node by name, so the answer does not depend on the pool's order.
    largest = min(inventory.devices, key=lambda d: (-d.memory_bytes, -d.speed, d.node, d.index))
    like = f"{human(largest.memory_bytes)} ({largest.product or largest.kind})"
    if len({d.node for d in inventory.devices}) == 1:
        start = max(d.index for d in inventory.devices) + 1
        added = tuple(_like(largest, largest.node, start + i) for i in range(n))
        return added, count(n, "more device"), f"of {like} to node {largest.node}"
    per_node = sum(1 for d in inventory.devices if d.node == largest.node)
    new_nodes = math.ceil(n / per_node)
    added = tuple(_like(largest, f"{largest.node}-like-{k}", i) for k in range(new_nodes) for i in range(per_node))
    return added, count(new_nodes, "more node"), f"like {largest.node} ({per_node} x {like} each)"


def _fewest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The smallest n in [lo, hi] that fits, assuming more never hurts (only checked values are
    returned, so where that assumption fails the answer is larger than needed, never wrong)."""
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def device_suggestions(spec: ShardedModelSpec, inventory: Inventory, fits: Fits, at_least: int,
                       relax: Change | None, fitting: int = 0) -> list[Suggestion]:
    """The fewest devices like the largest that run every replica (with the `relax` change to the
    spec when the spec as given cannot use more devices and the change alone does not do); failing
    that, bigger devices. When no group fits yet and several are asked, also how many would run
    the first."""
    wanted = max(spec.replicas, 1)

    def placed(patch: dict[str, Any], n: int, groups: int) -> bool:
        """`groups` fit with `n` more devices and `patch` applied."""
        added = Inventory(devices=[*inventory.devices, *more_devices(inventory, n)[0]])
        return fits(patched(spec, patch), added, groups)

    lo = max(1, at_least)
    # The spec as given, and relaxed unless that alone places them (a suggestion of its own then).
    ways = [("", {}), *([relax] if relax and not placed(relax[1], 0, wanted) else [])]
    for words, patch in ways if lo <= MAX_ADDED_DEVICES else []:
        near = min(max(2 * lo, lo + 16), MAX_ADDED_DEVICES)  # the bytes' estimate is often close
        every = functools.partial(placed, patch, groups=wanted)
        n = _fewest(lo, near, every) or _fewest(near + 1, MAX_ADDED_DEVICES, every)
        if n is None:
            continue
        added, amount, what = more_devices(inventory, n)
        text = f"add {amount} {what}"
        one = _fewest(1, n, functools.partial(placed, patch, groups=1)) if wanted > 1 and not fitting else None
        if one is not None and one < n:
            text += f" ({more_devices(inventory, one)[1]} would run 1 of the {wanted} replicas)"
        return [Suggestion(f"{words}, and {text}" if words else text, patch, added)]
    smallest = min(d.memory_bytes for d in inventory.devices)
    for factor in (2, 4, 8):
        for words, patch in ways:
            text = f"devices with {factor} times the memory (at least {human(smallest * factor)} each; as many)"
            bigger = Suggestion(f"{words}, and {text}" if words else text, patch, memory_factor=factor)
            if works(fits, spec, inventory, bigger):
                return [bigger]
    return []
