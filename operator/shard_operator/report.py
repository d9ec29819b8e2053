"""Human-readable plan tables (pure: Plan in, text out)."""

from __future__ import annotations

from shard_contract.plan import Plan
from shard_contract.units import gib, human

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
    staging = f" {'stg':>6}" if plan.streams else ""  # offload's staging slots
    header = (f"{'rank':>4}  {'node':<14} {'device':<7} {'stage':>5} {'tp':>3} {'layers':<10} "
              f"{'weights':>8} {'kv':>7} {'act':>7} {'ovh':>6}{staging} {'total':>8} {'capacity':>8} {'use':>5}  GiB")
    for group in plan.groups:
        lines.append("")
        lines.append(f"group {group.replica}: critical path est. {group.critical_path_seconds * 1e3:.2f} ms per "
                     f"decode step, stage imbalance {group.imbalance:.3f}")
        lines.append(header)
        for r in plan.group(group.replica):
            p = r.predicted_bytes
            layers = f"[{r.layers[0]}, {r.layers[1]})"
            stg = f" {gib(p.staging):>6}" if plan.streams else ""
            lines.append(
                f"{r.rank:>4}  {r.node[:14]:<14} {r.device:<7} {r.stage:>5} {r.tp_rank:>3} {layers:<10} "
                f"{gib(p.weights):>8} {gib(p.kv_cache):>7} {gib(p.activations):>7} {gib(p.overhead):>6}{stg} "
                f"{gib(p.total):>8} {gib(r.capacity_bytes):>8} {p.total / r.capacity_bytes:>5.0%}  "
                f"{usage_bar(p.total, r.usable_bytes, r.capacity_bytes)}")
        lines += _offload_lines(plan, group.replica)
    if not plan.groups:
        lines.append("")
        lines.append("no groups: spec.replicas is 0")
    return "\n".join(lines)


def _offload_lines(plan: Plan, replica: int) -> list[str]:
    """The streaming ranks of a group: what they stream per decode step, from where, and the
    step time it predicts, max(compute, streaming), with the rates it assumed."""
    ranks = [r for r in plan.group(replica) if r.offload is not None]
    if not ranks:
        return []
    lines = ["offload: the layers each rank streams per decode step (their projections), from where, at what "
             "rate (GB/s), and the predicted step: max(compute, stream) in ms",
             f"{'rank':>4}  {'streamed layers':<24} {'slots':>5} {'per step':>10} {'from':<10} {'GB/s':>9} "
             f"{'compute':>8} {'stream':>8} {'step':>8}"]
    for r in ranks:
        o = r.offload
        rate = "+".join(f"{x / 1e9:.1f}" for x in (o.host_bandwidth, o.file_bandwidth) if x)
        lines.append(f"{r.rank:>4}  {_layer_list(o.layers):<24} {o.prefetch:>5} {human(o.streamed_bytes):>10} "
                     f"{o.tier:<10} {rate:>9} {o.compute_seconds * 1e3:>8.2f} {o.stream_seconds * 1e3:>8.2f} "
                     f"{max(o.compute_seconds, o.stream_seconds) * 1e3:>8.2f}")
    return lines


def _layer_list(layers: list[int]) -> str:
    text = ",".join(map(str, layers))
    return text if len(text) <= 24 else f"{len(layers)} of them"
