"""Human-readable plan tables (pure: Plan in, text out)."""

from __future__ import annotations

from shard_contract.plan import Plan
from shard_contract.units import gib

from .inventory import Inventory
from .profile import ModelProfile

BAR_WIDTH = 20


def usage_bar(used: int, usable: int, capacity: int) -> str:
    """`█` predicted bytes, `░` free below the headroom line, `·` the headroom itself."""
    filled = round(BAR_WIDTH * used / capacity)
    free = max(0, round(BAR_WIDTH * usable / capacity) - filled)
    return ("█" * filled + "░" * free).ljust(BAR_WIDTH, "·")[:BAR_WIDTH]


def _replicas(plan: Plan) -> str:
    if len(plan.groups) < plan.replicas:
        return f"{len(plan.groups)} of {plan.replicas} replicas (the others do not fit)"
    return f"{plan.replicas} replica(s)"


def render_plan(plan: Plan, profile: ModelProfile | None = None, inventory: Inventory | None = None) -> str:
    lines = []
    if profile is not None:
        lines.append(f"model    {profile.name}: {profile.architecture}, {profile.total_numel / 1e9:.2f}B parameters, "
                     f"{profile.num_layers} layers, {profile.num_heads} heads / {profile.num_kv_heads} KV heads "
                     f"(profiled from {profile.source})")
    lines.append(f"decision {plan.reason}")
    weights = plan.dtype if plan.quantization == "none" else f"{plan.dtype} with {plan.quantization} weights"
    lines.append(f"serving  {plan.max_model_len} tokens x {plan.max_batch_size} sequences in {weights}, "
                 f"{plan.memory_headroom:.0%} headroom per device, {_replicas(plan)}, plan {plan.hash}")
    if inventory is not None:
        lines.append(f"pool     {inventory.describe()}")
        for skipped in inventory.skipped:
            lines.append(f"         skipped {skipped.node}: {skipped.reason}")
    header = (f"{'rank':>4}  {'node':<14} {'device':<7} {'stage':>5} {'tp':>3} {'layers':<10} "
              f"{'weights':>8} {'kv':>7} {'act':>7} {'ovh':>6} {'total':>8} {'capacity':>8} {'use':>5}  GiB")
    for group in plan.groups:
        lines.append("")
        lines.append(f"group {group.replica}: critical path est. {group.critical_path_seconds * 1e3:.2f} ms per "
                     f"decode step, stage imbalance {group.imbalance:.3f}")
        lines.append(header)
        for r in plan.group(group.replica):
            p = r.predicted_bytes
            layers = f"[{r.layers[0]}, {r.layers[1]})"
            lines.append(
                f"{r.rank:>4}  {r.node[:14]:<14} {r.device:<7} {r.stage:>5} {r.tp_rank:>3} {layers:<10} "
                f"{gib(p.weights):>8} {gib(p.kv_cache):>7} {gib(p.activations):>7} {gib(p.overhead):>6} "
                f"{gib(p.total):>8} {gib(r.capacity_bytes):>8} {p.total / r.capacity_bytes:>5.0%}  "
                f"{usage_bar(p.total, r.usable_bytes, r.capacity_bytes)}")
    if not plan.groups:
        lines.append("")
        lines.append("no groups: spec.replicas is 0")
    return "\n".join(lines)
