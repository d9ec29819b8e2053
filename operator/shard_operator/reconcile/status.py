"""The ShardedModel's status, computed from what the reconcile saw and decided. Pure.

The status is a function of the observed state: the same world gives the same status, so a
steady state writes nothing. Conditions keep their lastTransitionTime until their status flips,
and measured memory is reported again only when it moves by more than `MEASURE_TOLERANCE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shard_contract.plan import Plan, RankPlan
from shard_contract.units import count
from shard_contract.wire import Measured

from ..api import (
    Condition,
    GroupStatus,
    PlanSummary,
    ShardedModelSpec,
    ShardedModelStatus,
    ShardOffload,
    ShardStatus,
    StageStatus,
)
from ..objects.manifests import MODEL_LABEL, ROLE_LABEL, endpoint_name, model_label
from .rollout import Decision, GroupKey, ObservedGroup, Want, group_state

SEE_DEGRADED = "the Degraded condition says why"  # a problem's message is written once, there
MEASURE_TOLERANCE = 0.01  # resident bytes within 1% of the reported value are not re-reported
# Streaming counters grow while a rank serves: re-reported once they grew by 10%, so a steady
# state writes the status a number of times that grows with the log of its uptime, not with it.
COUNTER_GROWTH = 0.10


@dataclass(frozen=True)
class Problem:
    """Why the model cannot run as asked: a condition reason and a message for people."""

    reason: str
    message: str
    fatal: bool = True  # nothing can run until the spec or the pool changes


@dataclass(frozen=True)
class Observation:
    """Everything the status is computed from: what the reconcile's steps saw and decided."""

    name: str
    generation: int
    spec: ShardedModelSpec | None
    namespace: str = "default"
    plan: Plan | None = None
    problem: Problem | None = None
    planning: str = ""  # non-empty while the profile or plan is being worked out
    wants: list[Want] = field(default_factory=list)
    groups: list[ObservedGroup] = field(default_factory=list)
    group_plans: dict[GroupKey, Plan] = field(default_factory=dict)
    decision: Decision | None = None
    restarts: dict[GroupKey, int] = field(default_factory=dict)
    measured: dict[tuple[str, int], Measured] = field(default_factory=dict)  # (pod, rank) -> what it measured


def plan_summary(plan: Plan) -> PlanSummary:
    return PlanSummary(
        tensor_parallel=plan.tensor_parallel, pipeline_parallel=plan.pipeline_parallel,
        quantization=plan.quantization, stages=[StageStatus(stage=s.stage, layers=list(s.layers)) for s in plan.stages],
        imbalance=round(plan.imbalance, 4), hash=plan.hash, reason=plan.reason,
        max_predicted_bytes=max((r.predicted_bytes.total for r in plan.ranks), default=0),
        predicted_step_seconds=round(max((g.critical_path_seconds for g in plan.groups), default=0.0), 6),
        kv_cache_tokens=plan.kv_cache_tokens)


def _stable(previous: int | None, measured: int | None) -> int | None:
    if measured is None:
        return previous
    if previous is not None and abs(measured - previous) <= MEASURE_TOLERANCE * previous:
        return previous
    return measured


def _grown(previous: float | None, measured: float | None) -> float | None:
    if measured is None or (previous is not None and measured <= previous * (1 + COUNTER_GROWTH)):
        return previous
    return measured


def _offload(rp: RankPlan | None, measured: Measured | None, before: dict[str, Any]) -> ShardOffload | None:
    """A streaming rank's offload status: the plan's, and its counters as they grew."""
    if rp is None or rp.offload is None:
        return None
    o = rp.offload
    counters = {key: _grown(before.get(key), getattr(measured, field, None) if measured else None)
                for key, field in (("streamedBytes", "streamed_bytes"), ("streamSeconds", "stream_seconds"),
                                   ("stallSeconds", "stall_seconds"),
                                   ("deviceStallSeconds", "device_stall_seconds"))}
    return ShardOffload(layers=o.layers, tier=o.tier, bytes_per_step=o.streamed_bytes,
                        step_seconds=round(max(o.compute_seconds, o.stream_seconds), 6),
                        streamed_bytes=counters["streamedBytes"], stream_seconds=counters["streamSeconds"],
                        stall_seconds=counters["stallSeconds"], device_stall_seconds=counters["deviceStallSeconds"])


def _shards(obs: Observation, previous: dict[str, Any]) -> list[ShardStatus]:
    shown = {(s.get("pod"), s.get("rank")): s for s in previous.get("shards") or []}
    before = {key: s.get("residentBytes") for key, s in shown.items()}
    observed = {g.key: g for g in obs.groups}
    keys = sorted(set(observed) | {w.key for w in obs.wants})
    shards = []
    for key in keys:
        plan = obs.group_plans.get(key)
        ranks = {r.rank: r for r in observed[key].ranks} if key in observed else {}
        planned = {r.rank: r for r in plan.group(key[0])} if plan else {}
        for rank in sorted(set(ranks) | set(planned)):
            rs, rp = ranks.get(rank), planned.get(rank)
            pod = rs.pod if rs else ""
            measured = obs.measured.get((pod, rank)) if pod else None
            shards.append(ShardStatus(
                group=key[0], rank=rank, pod=pod, node=(rs.node if rs and rs.node else rp.node if rp else ""),
                device=rp.device if rp else "", stage=rp.stage if rp else 0, tp_rank=rp.tp_rank if rp else 0,
                layers=list(rp.layers) if rp else [], predicted_bytes=rp.predicted_bytes.total if rp else 0,
                quantization=plan.quantization if plan else "none",
                resident_bytes=_stable(before.get((pod, rank)),
                                       measured.resident if measured else None) if pod else None,
                kv_cache_tokens=rp.kv_cache_tokens if rp else 0,
                offload=_offload(rp, measured, (shown.get((pod, rank)) or {}).get("offload") or {}),
                state=rs.state if rs else "Missing"))
    return shards


def _groups(obs: Observation) -> list[GroupStatus]:
    observed = {g.key: g for g in obs.groups}
    out = []
    for key in sorted(set(observed) | {w.key for w in obs.wants}):
        g = observed.get(key)
        state, message = group_state(g)
        plan = obs.group_plans.get(key)
        world = plan.world_size if plan else (g.world_size if g else 0)
        if obs.decision and key[0] in obs.decision.exhausted and any(w.key == key for w in obs.wants):
            state, message = "Failed", obs.decision.exhausted[key[0]]
        out.append(GroupStatus(
            replica=key[0], revision=key[1], plan_hash=(plan.group_hash(key[0]) if plan else g.plan_hash if g else ""),
            state=state, ready_ranks=sum(1 for r in (g.ranks if g else ()) if r.state == "Ready"),
            ranks=world, restarts=obs.restarts.get(key, 0), message=message))
    return out


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int,
               previous: dict[str, Any], now: str) -> Condition:
    status = "True" if ok else "False"
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else now
    return Condition(type=type_, status=status, reason=reason, message=message,
                     last_transition_time=since, observed_generation=generation)


def build_status(obs: Observation, previous: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """The whole status as it goes on the wire (camelCase)."""
    previous = previous or {}
    spec, decision = obs.spec, obs.decision or Decision()
    wanted = {w.replica: w for w in obs.wants}
    states = {g.key: group_state(g)[0] for g in obs.groups}
    replicas = spec.replicas if spec else 0
    # Ready groups serve whether wanted or not; an unreadable spec wants none but still has them.
    serving = {g.replica for g in obs.groups if states[g.key] == "Ready" and (spec is None or g.replica < replicas)}
    current_ready = sum(1 for w in obs.wants if states.get(w.key) == "Ready")
    replacing = [g for g in obs.groups if g.replica in wanted and g.revision != wanted[g.replica].revision]
    extra = [g for g in obs.groups if g.replica not in wanted]
    broken = sorted({g.replica for g in obs.groups if g.replica in wanted and g.revision == wanted[g.replica].revision
                     and states[g.key] in ("Failed", "Lost")})
    ready = len(serving)

    # ---- degraded
    if obs.problem is not None:
        degraded = (True, obs.problem.reason, obs.problem.message)
    elif decision.exhausted:
        reason = ("RankFailedForGood" if decision.unrecoverable >= decision.exhausted.keys()
                  else "RestartBudgetExhausted")
        degraded = (True, reason, " ".join(decision.exhausted[r] for r in sorted(decision.exhausted)))
    elif broken:
        lost = any(states.get(wanted[r].key) == "Lost" or r in decision.lost for r in broken)
        degraded = (True, "NodeLost" if lost else "GroupFailed",
                    f"group {', '.join(map(str, broken))} is {'lost' if lost else 'failing'}; "
                    f"{'waiting for the node or a new plan' if lost else 'recreating it'}")
    else:
        degraded = (False, "AsExpected", "")

    # ---- progressing
    if obs.planning:
        progressing = (True, "Planning", obs.planning)
    elif decision.exhausted:
        progressing = (False, "Failed", "a group failed for good" if decision.unrecoverable
                       else "a group is over its restart budget")
    elif decision.waiting:
        progressing = (False, "Blocked", " ".join(decision.waiting))
    elif replacing:
        queued = "".join(f"; {why}" for why in decision.queued)
        progressing = (True, "Rebalancing",
                       f"replacing group {', '.join(sorted({str(g.replica) for g in replacing}))}{queued}")
    elif extra:
        progressing = (True, "Scaling", f"removing group {', '.join(str(g.replica) for g in extra)}")
    elif decision.restart:
        progressing = (True, "Recreating", f"recreating group {', '.join(str(k[0]) for k in decision.restart)}")
    elif obs.plan is not None and current_ready < len(obs.wants):
        progressing = (True, "Creating", f"{current_ready} of {len(obs.wants)} groups ready")
    elif obs.problem is not None:  # its message is Degraded's: said once
        progressing = (False, obs.problem.reason, SEE_DEGRADED)
    else:
        progressing = (False, "Complete", f"{ready} of {replicas} groups ready")

    # ---- available
    need = max(1, replicas - (spec.rollout.max_unavailable if spec else 0))
    fitting = len(obs.plan.groups) if obs.plan is not None else replicas
    if obs.problem is not None and obs.problem.fatal:  # no plan can be made: that is why
        still = f"{count(ready, 'group')} of an earlier plan still ready" if ready else "no group ready"
        available = (ready > 0, obs.problem.reason, f"{still}; {SEE_DEGRADED}")
    elif replicas == 0:
        available = (False, "ScaledToZero", "spec.replicas is 0")
    elif ready >= need:
        available = (True, "MinimumGroupsReady", f"{ready} of {replicas} groups ready")
    else:
        fits = f"; only {fitting} fit{'s' if fitting == 1 else ''} the pool" if fitting < replicas else ""
        available = (False, "TooFewGroupsReady", f"{ready} of {replicas} groups ready, {need} needed{fits}")

    # ---- phase
    if obs.problem is not None and (obs.problem.fatal or not ready):
        phase = "Failed" if obs.problem.fatal and not ready else "Degraded"
    elif obs.planning:
        phase = "Planning"
    elif decision.exhausted:
        phase = "Failed" if not ready else "Degraded"
    elif obs.problem is not None or broken:
        phase = "Degraded"
    elif replacing:
        phase = "Rebalancing"
    elif obs.plan is not None and current_ready == len(obs.wants) and not extra:
        phase = "Ready"
    elif obs.plan is not None:
        phase = "Loading"
    else:
        phase = "Pending"

    gen = obs.generation
    status = ShardedModelStatus(
        phase=phase, observed_generation=gen,
        replicas=len({g.replica for g in obs.groups if g.ranks}), ready_replicas=ready,
        selector=f"{MODEL_LABEL}={model_label(obs.name)},{ROLE_LABEL}=leader",
        ready=f"{ready}/{replicas}", reason=degraded[1] if degraded[0] else "",
        url=f"http://{endpoint_name(obs.name)}.{obs.namespace}.svc:{spec.worker.port}" if spec else "",
        plan=plan_summary(obs.plan) if obs.plan is not None else None,
        shards=_shards(obs, previous), groups=_groups(obs),
        conditions=[_condition("Available", *available, gen, previous, now),
                    _condition("Progressing", *progressing, gen, previous, now),
                    _condition("Degraded", *degraded, gen, previous, now)])
    wire = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    wire.setdefault("plan", None)  # a merge patch must clear a plan that no longer exists
    return wire


def newly_ready(previous: dict[str, Any] | None, status: dict[str, Any]) -> list[dict[str, Any]]:
    """The groups `status` has Ready that `previous` did not: each is worth an Event."""
    before = {(g.get("replica"), g.get("revision")): g.get("state") for g in (previous or {}).get("groups") or []}
    return [g for g in status.get("groups") or []
            if g.get("state") == "Ready" and before.get((g.get("replica"), g.get("revision"))) != "Ready"]


def failed_status(previous: dict[str, Any] | None, message: str, generation: int, now: str) -> dict[str, Any]:
    """The status after a reconcile raised what nothing expected: Degraded says so (ReconcileError,
    with the message) and the rest stays as last seen, since that reconcile saw nothing new."""
    previous = previous or {}
    degraded = _condition("Degraded", True, "ReconcileError", message, generation, previous, now).model_dump(
        by_alias=True, mode="json", exclude_none=True)
    conditions = [c for c in previous.get("conditions") or [] if c.get("type") != "Degraded"]
    return {**previous, "phase": previous.get("phase") or "Pending", "reason": "ReconcileError",
            "conditions": [*conditions, degraded]}


def status_patch(previous: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch from `previous` to `new`, or None when nothing changed."""
    previous = previous or {}
    patch = {k: v for k, v in new.items() if previous.get(k) != v}
    if patch.get("plan", 0) is None and "plan" not in previous:
        patch.pop("plan")
    return patch or None
