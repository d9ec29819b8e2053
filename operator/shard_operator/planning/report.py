"""Human-readable plan tables (pure: Plan in, text out)."""

from __future__ import annotations

from shard_contract.plan import Plan, describe_layers
from shard_contract.units import count, human, table_unit

from ..api import DEFAULT_GPU_FRACTION
from . import Considered, PlannerOptions
from .inventory import Inventory
from .profile import ModelProfile

BAR_WIDTH = 20
BAR_LEGEND = "bar: █ predicted, ░ free below the headroom, · the headroom (kept free)"


def usage_bar(used: int, usable: int, capacity: int) -> str:
    """`█` predicted bytes, `░` free below the headroom line, `·` the headroom itself."""
    filled = round(BAR_WIDTH * used / capacity)
    free = max(0, round(BAR_WIDTH * usable / capacity) - filled)
    return ("█" * filled + "░" * free).ljust(BAR_WIDTH, "·")[:BAR_WIDTH]


def _replicas(plan: Plan) -> str:
    if len(plan.groups) < plan.replicas:
        return f"{len(plan.groups)} of {count(plan.replicas, 'replica')} (the others do not fit)"
    return count(plan.replicas, "replica")


def kv_sizing(plan: Plan) -> str:
    """How the plan sized the KV cache, in the spec's words."""
    if plan.kv_cache_memory is not None:
        return f"kvCacheMemory {human(plan.kv_cache_memory)} per rank"
    if plan.kv_cache_memory_fraction is not None:
        return f"kvCacheMemoryFraction {plan.kv_cache_memory_fraction:g} of the memory left free"
    if any(r.kind == "gpu" for r in plan.ranks):
        return f"{DEFAULT_GPU_FRACTION:g} of the memory left free (the GPU default)"
    return "maxBatchSize x maxModelLen (the CPU default)"


def kv_line(plan: Plan) -> str:
    """'65536 tokens per group (16 sequences of maxModelLen; 0.9 of the memory left free ...)'."""
    held = sorted({plan.group_kv_cache_tokens(g.replica) for g in plan.groups})
    tokens = " to ".join(str(t) for t in (held[:1] + held[-1:] if len(held) > 1 else held)) or str(plan.kv_cache_tokens)
    whole = min(held, default=plan.kv_cache_tokens) // plan.max_model_len
    return (f"{tokens} tokens per group ({count(whole, 'whole sequence')} of maxModelLen; {kv_sizing(plan)})")


def render_plan(plan: Plan, profile: ModelProfile | None = None, inventory: Inventory | None = None) -> str:
    lines = []
    if profile is not None:
        shape = profile.shape
        lines.append(f"model    {profile.name}: {shape.architecture}, {profile.total_numel / 1e9:.2f}B parameters, "
                     f"{count(shape.num_layers, 'layer')}, {shape.num_heads} heads / {shape.num_kv_heads} "
                     f"KV heads (profiled from {profile.source})")
    lines.append(f"decision {plan.reason}")
    weights = plan.dtype if plan.quantization == "none" else f"{plan.dtype} with {plan.quantization} weights"
    lines.append(f"serving  up to {count(plan.max_batch_size, 'sequence')} of up to {plan.max_model_len} tokens in "
                 f"{weights}, {plan.memory_headroom:.0%} headroom per device, {_replicas(plan)}, plan {plan.hash}")
    lines.append(f"KV cache {kv_line(plan)}")
    if inventory is not None:
        lines.append(f"pool     {inventory.describe()}")
        for skipped in inventory.skipped:
            lines.append(f"         skipped {skipped.node}: {skipped.reason}")
    unit, size = table_unit(max((r.capacity_bytes for r in plan.ranks), default=0))
    width = max((len(describe_layers(r.layers)) for r in plan.ranks), default=6)
    staging = f" {'stg':>6}" if plan.streams else ""  # offload's staging slots
    header = (f"{'rank':>4}  {'node':<14} {'device':<7} {'stage':>5} {'tp':>3} {'layers':<{width}} "
              f"{'weights':>8} {'kv':>7} {'act':>7} {'ovh':>6}{staging} {'total':>8} {'capacity':>8} {'use':>5}"
              f"  {unit}")
    for group in plan.groups:
        lines.append("")
        lines.append(f"group {group.replica}: critical path est. {group.critical_path_seconds * 1e3:.2f} ms per "
                     f"decode step, stage imbalance {group.imbalance:.3f}")
        lines.append(header)
        for r in plan.group(group.replica):
            p = r.predicted_bytes
            stg = f" {p.staging / size:>6.2f}" if plan.streams else ""
            lines.append(
                f"{r.rank:>4}  {r.node[:14]:<14} {r.device:<7} {r.stage:>5} {r.tp_rank:>3} "
                f"{describe_layers(r.layers):<{width}} {p.weights / size:>8.2f} {p.kv_cache / size:>7.2f} "
                f"{p.activations / size:>7.2f} {p.overhead / size:>6.2f}{stg} {p.total / size:>8.2f} "
                f"{r.capacity_bytes / size:>8.2f} {p.total / r.capacity_bytes:>5.0%}  "
                f"{usage_bar(p.total, r.usable_bytes, r.capacity_bytes)}")
        lines += _offload_lines(plan, group.replica)
    if plan.groups:
        lines.append(BAR_LEGEND)
    else:
        lines.append("")
        lines.append("no groups: spec.replicas is 0")
    return "\n".join(lines)


def _offload_lines(plan: Plan, replica: int) -> list[str]:
    """The streaming ranks of a group: what they stream per decode step, from where, and the
    step time it predicts, max(compute, streaming), with the rates it assumed."""
    ranks = [r for r in plan.group(replica) if r.offload is not None]
    if not ranks:
        return []
    lines = ["offload: the layers each rank streams per decode step (their projections), of which the bytes it "
             "copies (a CPU rank computes on the mapped files in place), from where, at what rate (GB/s), and the "
             "predicted step: max(compute, stream) in ms",
             f"{'rank':>4}  {'streamed layers':<24} {'slots':>5} {'per step':>10} {'copied':>10} {'from':<10} "
             f"{'GB/s':>9} {'compute':>8} {'stream':>8} {'step':>8}"]
    for r in ranks:
        o = r.offload
        assert o is not None
        rate = "+".join(f"{x / 1e9:.1f}" for x in (o.host_bandwidth, o.file_bandwidth) if x)
        lines.append(f"{r.rank:>4}  {_layer_list(o.layers):<24} {o.prefetch:>5} {human(o.streamed_bytes):>10} "
                     f"{human(o.copied_bytes):>10} {o.tier:<10} {rate:>9} {o.compute_seconds * 1e3:>8.2f} "
                     f"{o.stream_seconds * 1e3:>8.2f} {max(o.compute_seconds, o.stream_seconds) * 1e3:>8.2f}")
    return lines


def _layer_list(layers: list[int]) -> str:
    text = ",".join(map(str, layers))
    return text if len(text) <= 24 else f"{len(layers)} of them"


def render_considered(considered: list[Considered], chosen: Plan | None,
                      tolerance: float = PlannerOptions().tolerance) -> str:
    """`shardctl plan --explain`: every layout the planner tried, and why each lost (or won)."""
    fitting = [c.candidate for c in considered if c.candidate is not None]
    most = max((len(c.groups) for c in fitting), default=0)
    fastest = min((c.critical_path for c in fitting if len(c.groups) == most), default=0.0)
    winner = next((c.candidate for c in considered if chosen is not None and c.candidate is not None
                   and (c.tp, c.pp) == (chosen.tensor_parallel, chosen.pipeline_parallel)), None)
    lines = [f"{count(len(considered), 'layout')} compared (the most replicas first, then the shortest decode "
             f"step; within {tolerance:.0%} of the fastest, fewer devices win):"]
    for c in considered:
        name = f"tensor={c.tp} x pipeline={c.pp}{' and more' if c.onwards else ''}"
        if c.candidate is None:
            lines.append(f"  {name}: {c.why}")
            continue
        cand = c.candidate
        ms, groups = cand.critical_path * 1e3, len(cand.groups)
        what = f"{groups} group{'s' if groups != 1 else ''} on {count(cand.devices, 'device')}, est. {ms:.2f} ms"
        if cand is winner:
            verdict = "chosen"
        elif groups < most:
            verdict = f"fits fewer replicas ({groups} of {most})"
        elif cand.critical_path > fastest * (1 + tolerance):
            verdict = f"slower than {fastest * 1e3:.2f} ms by more than {tolerance:.0%}"
        elif winner is not None and cand.devices > winner.devices:
            verdict = f"as fast within {tolerance:.0%}, on more devices than the chosen"
        else:
            verdict = "as fast within the tolerance and as few devices, but the chosen is faster"
        lines.append(f"  {name}: {what}: {verdict}")
    return "\n".join(lines)
