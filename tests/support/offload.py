"""Plans that stream a given share of a model's layers, from the real planner."""

from __future__ import annotations

from pathlib import Path

from shard_contract.plan import Plan
from shard_contract.units import GiB
from shard_operator.api import ModelSpec, Offload, Parallelism, Placement, ShardedModelSpec
from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import parse_devices
from shard_operator.planning.profile import profile_model


def streamed_layers(p: Plan) -> int:
    """Layers the group streams (each stage's, counted once for its TP ranks)."""
    return sum(len(r.offload.layers) for r in p.group(0) if r.offload and r.tp_rank == 0)


def streaming_plan(model_dir: Path, tp: int, pp: int, fraction: float, *, max_len: int = 64, batch: int = 1,
                   dtype: str = "auto", prefetch: int | str = "auto", kind: str = "cpu",
                   host_memory: str | None = None) -> Plan:
    """A plan of TP x PP ranks (`kind` cpu or gpu) that streams `fraction` of the layers: none
    (policy never), all (policy always), or else policy auto on the largest uniform device budget
    at which the planner streams exactly that many (bisection: the less memory, the more layers
    stream). `host_memory`: the offload's hostMemory (GPU ranks: what does not fit it is read from
    the files)."""
    profile = profile_model(model_dir)

    def plan_at(budget: int, policy: str) -> Plan:
        spec = ShardedModelSpec(
            model=ModelSpec(path=str(model_dir), dtype=dtype, max_model_len=max_len, max_batch_size=batch),
            parallelism=Parallelism(tensor=tp, pipeline=pp),
            placement=Placement(offload=Offload(policy=policy, prefetch=prefetch, host_memory=host_memory)))
        return plan(profile, spec, parse_devices(f"local:{budget}B*{tp * pp}", kind=kind))

    if fraction in (0, 1):
        return plan_at(4 * GiB, "always" if fraction else "never")
    target = round(fraction * profile.shape.num_layers)

    def streams_at_most_target(budget: int) -> bool:
        try:
            return streamed_layers(plan_at(budget, "auto")) <= target
        except PlanError:
            return False

    lo, hi = 0, 4 * GiB  # streams too many (or does not fit) at lo; at most the target at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if streams_at_most_target(mid) else (mid, hi)
    found = plan_at(hi, "auto")
    assert streamed_layers(found) == target, f"no budget streams exactly {target} layers at {tp}x{pp}"
    return found
