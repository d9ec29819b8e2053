"""One reconcile of one ShardedModel, read top to bottom: values in, a Result out.

    observe (pods, Services, ConfigMaps -> groups) -> plan (spec, profile, inventory, settle
    window, keep or re-plan) -> make room (replacement groups where they can start) -> roll out
    (which groups to create, keep, recreate or delete, and the writes that do it) -> poll (the
    leaders' measured bytes) -> report (status, Events)

Each step takes values and returns a small result. Nothing is written here: the Result says what
to write, which Events to post and when to run again (controller-runtime's `Result{RequeueAfter}`),
and the model's loop (handlers.py) carries it out. The reconcile reads through `Reads`: the model's
objects, a profiling pod's log, the leaders' `/v1/shards` and checkpoint files the operator can
see, so a table test runs it against an in-memory store.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shard_contract.checkpoint import CheckpointError
from shard_contract.plan import Plan
from shard_contract.wire import Measured, ShardsResponse

from ..api import ShardedModelSpec, SpecError, parse_spec
from ..kube import KINDS, NETWORK_POLICY
from ..objects.manifests import (
    COMPONENT_LABEL,
    GROUP_LABEL,
    MODEL_LABEL,
    PLAN_KEY,
    REVISION_LABEL,
    SPEC_KEY,
    Context,
    Owner,
    check,
    group_plan,
    group_revision,
    model_label,
    plan_record_name,
)
from ..planning import PlanError, offload
from ..planning.inventory import Inventory, inventory_from_nodes
from ..planning.profile import ModelProfile
from ..planning.replan import PlanChoice, choose_plan, make_room, without_held
from ..policy import NotAllowed, admit
from ..settings import Settings
from .capacity import GpuUse, fingerprint, free_gpus, healthy_nodes, node_names, used_per_node
from .profiles import LocalProfiles, ModelNotFound, local_model_dir, remote_profile
from .rollout import Decision, GroupKey, ObservedGroup, Want, decide, group_state, observe_groups
from .status import Observation, Problem, build_status, failed_status, newly_ready, status_patch
from .timing import RECHECK_SECONDS, Pool, poll_in, requeue_after, settle
from .writes import Write, changes


# ---------------------------------------------------------------- values in
@dataclass(frozen=True)
class World:
    """The cluster as the operator's indexes saw it when a reconcile started."""

    nodes: list[dict[str, Any]]
    gpu_uses: list[GpuUse]


class Reader(Protocol):
    """The read half of kube.Kube."""

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...
    def pod_log(self, namespace: str, name: str, tail_lines: int = 200) -> str: ...


@dataclass(frozen=True)
class Reads:
    """Where a reconcile reads what the indexes do not hold."""

    kube: Reader
    fetch: Callable[[str, float], ShardsResponse | None]  # a leader's /v1/shards (leaders.fetch)
    profiles: LocalProfiles = field(default_factory=LocalProfiles)  # checkpoints the operator can see


@dataclass(frozen=True)
class Memory:
    """What one model's loop carries from one reconcile to the next (lost on restart: harmless)."""

    pool: Pool = Pool()
    last_poll: float = -math.inf
    # (pod, rank) -> what it measured, as last polled
    measured: dict[tuple[str, int], Measured] = field(default_factory=dict)
    # The status this loop last wrote: kopf's copy of the object may not show it yet, and a stale
    # status would undo restart counts and transition times.
    status: dict[str, Any] | None = None
    # A status write failed: it may have landed or not (a timeout), so the server's status is
    # unknown and the next write sends all of it, not the difference from `status`.
    status_unknown: bool = False

    def previous(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.status if self.status is not None else body.get("status") or {}

    def patch_for(self, previous: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
        """The status write from `previous` (the last written, or the server's) to `status`: all of
        it while the fate of an earlier write is unknown."""
        return status if self.status_unknown else status_patch(previous, status)


# ---------------------------------------------------------------- values out
@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Result:
    writes: list[Write]                 # in order
    events: list[Event]                 # posted once the writes are done
    status: dict[str, Any]              # the whole status ...
    status_patch: dict[str, Any] | None  # ... and the write that gets it there (None: none needed)
    requeue_after: float                # seconds until the next reconcile is due anyway
    memory: Memory                      # for the next reconcile (the status fields: once written)


# ---------------------------------------------------------------- the reconcile
def reconcile(body: dict[str, Any], world: World, memory: Memory, now: float, stamp: str,
              settings: Settings, reads: Reads) -> Result:
    """`now`: the loop's clock (settle windows, polls); `stamp`: the time for conditions."""
    owner = Owner.of(body)
    generation = body["metadata"].get("generation") or 0
    previous = memory.previous(body)
    selector = f"{MODEL_LABEL}={model_label(owner.name)}"
    kinds = (*KINDS, NETWORK_POLICY) if settings.network_policies else KINDS
    listing = {kind: reads.kube.list(kind, owner.namespace, selector) for kind in kinds}

    seen = observe(owner, listing, world)
    planned = room_for_replacements(plan_for(body, generation, seen, listing, world, memory.pool, now, settings,
                                             reads), seen, world, settings)
    rolled = RolledOut()
    if planned.ctx is not None and planned.plan is not None:
        rolled = roll_out(planned.ctx, planned.plan, planned.choice, seen, previous, listing, world,
                          settings.restart_budget)
    polled = poll(owner, planned.spec, seen.groups, memory, now, settings, reads.fetch)
    status = build_status(Observation(
        name=owner.name, namespace=owner.namespace, generation=generation, spec=planned.spec, plan=planned.plan,
        problem=planned.problem,
        planning=planned.planning, wants=rolled.wants, groups=seen.groups,
        group_plans={**seen.group_plans, **rolled.group_plans}, decision=rolled.decision, restarts=rolled.restarts,
        measured=polled.measured), previous, stamp)
    changing = any(group_state(g)[0] in ("Starting", "Terminating") for g in seen.groups)
    return Result(
        writes=planned.writes + rolled.writes,
        events=rolled.events + problem_events(previous, status) + ready_events(previous, status),
        status=status, status_patch=memory.patch_for(previous, status),
        requeue_after=requeue_after(settings.resync_seconds, planned.wake_in, polled.wake_in,
                                    RECHECK_SECONDS if changing else None),
        memory=dataclasses.replace(memory, pool=planned.pool, last_poll=polled.last_poll, measured=polled.measured))


def failed(body: dict[str, Any], memory: Memory, err: Exception, stamp: str, requeue_after: float) -> Result:
    """A reconcile raised what nothing expected: the Degraded condition (ReconcileError, with the
    exception) and a Warning Event say so; the rest of the status stays as last seen."""
    previous = memory.previous(body)
    message = " ".join(f"{type(err).__name__}: {err}".split())[:1000]
    status = failed_status(previous, message, body["metadata"].get("generation") or 0, stamp)
    return Result(writes=[], events=problem_events(previous, status), status=status,
                  status_patch=memory.patch_for(previous, status), requeue_after=requeue_after, memory=memory)


# ---------------------------------------------------------------- observe
@dataclass(frozen=True)
class Seen:
    groups: list[ObservedGroup]
    group_plans: dict[GroupKey, Plan]  # the Plan each group's ConfigMap holds
    current: Plan | None               # the plan record ...
    accepted: ShardedModelSpec | None = None  # ... and the spec it was made for


def observe(owner: Owner, listing: dict[str, list[dict[str, Any]]], world: World) -> Seen:
    """The model's groups as its pods, Services and ConfigMaps show them."""
    group_objs = [o for o in listing["Service"] + listing["ConfigMap"]
                  if (o["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == "group"]
    plans: dict[GroupKey, Plan] = {}
    for cm in listing["ConfigMap"]:
        labels = cm["metadata"].get("labels") or {}
        if labels.get(COMPONENT_LABEL) == "group":
            try:
                plans[(int(labels[GROUP_LABEL]), labels[REVISION_LABEL])] = Plan.from_json(cm["data"][PLAN_KEY])
            except (KeyError, ValueError):
                continue
    record = next((c for c in listing["ConfigMap"] if c["metadata"]["name"] == plan_record_name(owner.name)), None)
    return Seen(groups=observe_groups(listing["Pod"], group_objs, healthy_nodes(world.nodes), node_names(world.nodes)),
                group_plans=plans, current=_plan_record(record) if record is not None else None,
                accepted=_accepted_spec(record) if record is not None else None)


def _plan_record(cm: dict[str, Any]) -> Plan | None:
    try:
        return Plan.from_json((cm.get("data") or {}).get(PLAN_KEY, ""))
    except ValueError:
        return None  # unreadable: plan afresh


def _accepted_spec(cm: dict[str, Any]) -> ShardedModelSpec | None:
    try:
        return parse_spec(json.loads((cm.get("data") or {}).get(SPEC_KEY, "")))
    except (ValueError, SpecError):
        return None  # none (an older record) or unreadable: the groups follow the current spec


# ---------------------------------------------------------------- plan
@dataclass(frozen=True)
class Planned:
    pool: Pool                            # the settle window, to remember
    spec: ShardedModelSpec | None = None
    ctx: Context | None = None            # None: no pod can be built from the spec
    choice: PlanChoice | None = None      # None: nothing new was chosen
    plan: Plan | None = None              # the plan to run (an earlier one when nothing new fits)
    problem: Problem | None = None
    planning: str = ""                    # why there is no plan yet, while one is being worked out
    writes: list[Write] = field(default_factory=list)  # the profiling pod's
    wake_in: float | None = None
    profile: ModelProfile | None = None   # what the plan was made of (to place replacements)
    inventory: Inventory | None = None


def plan_for(body: dict[str, Any], generation: int, seen: Seen, listing: dict[str, list[dict[str, Any]]],
             world: World, pool: Pool, now: float, settings: Settings, reads: Reads) -> Planned:
    """Spec, profile and plan; what stops them is a Problem (a condition, not a crash)."""
    current = seen.current
    spec = ctx = None
    writes: list[Write] = []
    wake_in = None
    try:
        spec = parse_spec(body.get("spec") or {})
        ctx = Context(owner=Owner.of(body), spec=spec, default_image=settings.worker_image,
                      network_policy=settings.network_policies)
        check(ctx)
        admit(spec, ctx.image, settings.allowed_images, settings.allowed_host_paths,
              settings.allowed_api_key_secrets)
        profile, writes = _profile(ctx, listing, settings, reads)
        if profile is None:
            return Planned(pool, spec, ctx, planning="profiling the checkpoint in a pod (the operator cannot read "
                           "its volume)", writes=writes, wake_in=RECHECK_SECONDS)
        resource = spec.placement.gpu_resource
        others = used_per_node(world.gpu_uses, resource, exclude=(ctx.owner.namespace, model_label(ctx.owner.name)))
        inventory = without_held(inventory_from_nodes(world.nodes, spec.placement), others)
        timing = settle(pool, fingerprint(inventory), generation, now, settings.settle_seconds)
        pool, wake_in = timing.pool, timing.wake_in
        choice = choose_plan(current, profile, spec, inventory, settled=timing.settled, reconsider=timing.reconsider,
                             improvement=settings.improvement_threshold, options=settings.planner_options)
        # Run the groups that fit, and say what the others lack.
        problem = Problem("InsufficientCapacity", choice.shortfall, fatal=False) if choice.shortfall else None
        return Planned(timing.considered(), spec, ctx, choice, choice.plan, problem, writes=writes, wake_in=wake_in,
                       profile=profile, inventory=inventory)
    except NotAllowed as err:
        return Planned(pool, spec, problem=Problem("NotAllowed", str(err)))
    except SpecError as err:
        return Planned(pool, spec, problem=Problem("InvalidSpec", str(err)))
    except ModelNotFound as err:
        return Planned(pool, spec, ctx, problem=Problem("ModelNotFound", str(err)))
    except CheckpointError as err:
        return Planned(pool, spec, ctx, problem=Problem("InvalidModel", str(err)))
    except PlanError as err:  # nothing new fits: keep serving with what still runs, as the accepted spec made it
        if current is not None and seen.accepted is not None and ctx is not None:
            ctx = dataclasses.replace(ctx, spec=seen.accepted)
        return Planned(pool, spec, ctx, plan=current, problem=Problem(err.reason, err.message, fatal=current is None),
                       writes=writes, wake_in=wake_in)


def _profile(ctx: Context, listing: dict[str, list[dict[str, Any]]], settings: Settings,
             reads: Reads) -> tuple[ModelProfile | None, list[Write]]:
    model_dir = local_model_dir(ctx.spec, settings)
    if model_dir is not None:
        return reads.profiles.get(model_dir), []
    return remote_profile(ctx, reads.kube, listing["Pod"], listing["ConfigMap"], settings.profile_timeout_seconds)


# ---------------------------------------------------------------- make room
def room_for_replacements(planned: Planned, seen: Seen, world: World, settings: Settings) -> Planned:
    """The plan with each group that replaces a serving one placed where it can start: beside the
    serving groups where the pool has room (surge), else in place (`replan.make_room`)."""
    ctx, plan, choice = planned.ctx, planned.plan, planned.choice
    if ctx is None or plan is None or choice is None or planned.profile is None or planned.inventory is None:
        return planned
    revisions = {g.replica: group_revision(ctx, plan, g.replica) for g in plan.groups}
    started = {g.replica for g in seen.groups if revisions.get(g.replica) == g.revision and g.ranks}
    replacing: dict[int, Counter] = {}
    for g in seen.groups:
        if g.replica in revisions and g.revision != revisions[g.replica]:
            held = Counter(r.node for r in g.ranks if r.state not in ("Failed", "Lost"))
            replacing[g.replica] = replacing.get(g.replica, Counter()) + held
    if not replacing:
        return planned
    room = make_room(plan, planned.profile, ctx.spec, planned.inventory,
                     free_gpus(world.nodes, world.gpu_uses, ctx.spec.placement.gpu_resource), replacing, started,
                     settings.planner_options)
    if not room.moved:
        return planned
    moved = "; ".join(room.moved)
    kind = "moved" if choice.kind == "unchanged" else choice.kind
    message = f"{choice.message}; {moved}" if choice.message else moved
    return dataclasses.replace(planned, plan=room.plan, choice=dataclasses.replace(
        choice, plan=room.plan, kind=kind, message=message))


# ---------------------------------------------------------------- roll out
@dataclass(frozen=True)
class RolledOut:
    """The rollout's decision and the writes that carry it out (none while there is no plan)."""

    wants: list[Want] = field(default_factory=list)
    decision: Decision = field(default_factory=Decision)
    restarts: dict[GroupKey, int] = field(default_factory=dict)      # recreations of each group still around
    group_plans: dict[GroupKey, Plan] = field(default_factory=dict)  # the Plan each wanted group mounts
    writes: list[Write] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def roll_out(ctx: Context, plan: Plan, choice: PlanChoice | None, seen: Seen, previous: dict[str, Any],
             listing: dict[str, list[dict[str, Any]]], world: World, budget: int) -> RolledOut:
    """Which groups to create, keep, recreate or delete, and the writes that do it."""
    wants = [Want(g.replica, group_revision(ctx, plan, g.replica),
                  dict(Counter(r.node for r in plan.group(g.replica)))) for g in plan.groups]
    restarts = {(g["replica"], g["revision"]): g.get("restarts", 0) for g in previous.get("groups") or []}
    free = free_gpus(world.nodes, world.gpu_uses, ctx.spec.placement.gpu_resource)
    decision = decide(wants, seen.groups, ctx.spec.rollout, restarts, budget, free, healthy_nodes(world.nodes))
    for key in decision.restart:
        restarts[key] = restarts.get(key, 0) + 1
    alive = {g.key for g in seen.groups} | {w.key for w in wants}
    return RolledOut(wants=wants, decision=decision, restarts={k: v for k, v in restarts.items() if k in alive},
                     group_plans={w.key: group_plan(plan, w.replica) for w in wants},
                     writes=changes(ctx, plan, decision, listing, node_names(world.nodes)),
                     events=rollout_events(choice, seen, decision))


def rollout_events(choice: PlanChoice | None, seen: Seen, decision: Decision) -> list[Event]:
    """A new plan, and each group created, recreated or deleted."""
    events = []
    current = seen.current
    if choice is not None and (current is None or choice.plan.hash != current.hash or
                               choice.plan.replicas != current.replicas):
        reason = {"initial": "Planned", "improved": "Rebalancing", "repaired": "Rebalancing", "moved": "Rebalancing",
                  "replanned": "Rebalancing", "respec": "Replanned", "scaled": "Scaled"}.get(choice.kind, "Planned")
        events.append(Event("Normal", reason, choice.message))
        if (streaming := offload.event(current, choice.plan)) is not None:
            events.append(Event("Normal", *streaming))
    states = {g.key: group_state(g) for g in seen.groups}
    for key, create_pods in decision.keep.items():
        if create_pods and states.get(key, ("Empty",))[0] == "Empty":
            events.append(Event("Normal", "CreatingGroup", f"group {key[0]} revision {key[1]}"))
    for key in decision.restart:
        events.append(Event("Warning", "RecreatingGroup", f"group {key[0]}: {states[key][1]}"))
    for key, why in decision.delete.items():
        events.append(Event("Normal", "DeletingGroup", f"group {key[0]} revision {key[1]}: {why}"))
    return events


# ---------------------------------------------------------------- poll
@dataclass(frozen=True)
class Polled:
    measured: dict[tuple[str, int], Measured]  # (pod, rank) -> what it measured: a pod may hold several ranks
    last_poll: float
    wake_in: float | None


def poll(owner: Owner, spec: ShardedModelSpec | None, groups: list[ObservedGroup], memory: Memory, now: float,
         settings: Settings, fetch: Callable[[str, float], ShardsResponse | None]) -> Polled:
    """Measured resident bytes per rank (and its pod) from each ready leader, every status_poll_seconds."""
    due_in = poll_in(memory.last_poll, now, settings.status_poll_seconds)
    if due_in is None or spec is None or due_in > 0:
        return Polled(memory.measured, memory.last_poll, due_in if spec is not None else None)
    ready = [g for g in groups if group_state(g)[0] == "Ready"]
    if not ready:
        return Polled(memory.measured, memory.last_poll, None)
    measured: dict[tuple[str, int], Measured] = {}
    for group in ready:
        leader = next((r for r in group.ranks if r.rank == 0), None)
        if leader is None or not leader.pod_ip:
            continue
        url = settings.leader_url.format(pod_ip=leader.pod_ip, port=spec.worker.port, pod=leader.pod,
                                         namespace=owner.namespace)
        report = fetch(url, settings.poll_timeout_seconds)
        if report is None:
            continue
        pods = {r.rank: r.pod for r in group.ranks}
        for rank, figures in report.measured_by_rank().items():
            if rank in pods:
                measured[(pods[rank], rank)] = figures
    return Polled(measured, now, settings.status_poll_seconds)


# ---------------------------------------------------------------- report
def ready_events(previous: dict[str, Any], status: dict[str, Any]) -> list[Event]:
    """A group that serves now."""
    return [Event("Normal", "GroupReady", f"group {g['replica']} revision {g['revision']} serves ({g['ranks']} ranks)")
            for g in newly_ready(previous, status)]


def problem_events(previous: dict[str, Any], status: dict[str, Any]) -> list[Event]:
    """A Warning whenever the Degraded or a blocked Progressing condition says something new."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    events = []
    for cond in status["conditions"]:
        bad = (cond["type"] == "Degraded" and cond["status"] == "True") or \
              (cond["type"] == "Progressing" and cond.get("reason") in ("Blocked", "Failed"))
        old = before.get(cond["type"]) or {}
        if bad and (old.get("reason"), old.get("message")) != (cond.get("reason"), cond.get("message")):
            events.append(Event("Warning", cond["reason"], cond.get("message", "")))
    return events
