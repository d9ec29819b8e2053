"""The kopf operator: one level-triggered reconcile per ShardedModel, read top to bottom.

Each ShardedModel gets a kopf daemon that reconciles it whenever something it depends on changes
(the model, its pods, any node: kopf watches wake it) and every `resync_seconds` besides. One loop
per model means one reconcile at a time per model, so the reconcile needs no locks. It runs the
blocking API calls in a worker thread.

    spec -> profile -> inventory (live Nodes minus other workloads' GPUs) -> plan (reuse while
    valid) -> rollout decision -> create / patch / delete the difference -> status + Events

The pure parts live in manifests.py, replan.py, rollout.py, capacity.py and status.py.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf
from prometheus_client import Histogram

from shard_contract.checkpoint import CheckpointError
from shard_contract.env import new_group_key
from shard_contract.plan import Plan
from shard_contract.wire import ShardsResponse

from . import leaders
from .api import GROUP, PLURAL, VERSION, ShardedModelSpec, SpecError, parse_spec
from .capacity import GpuUse, fingerprint, free_gpus, gpu_use, healthy_nodes, slim_node, used_per_node
from .inventory import inventory_from_nodes
from .kube import KINDS, NETWORK_POLICY, Kube
from .manifests import (
    COMPONENT_LABEL,
    GROUP_LABEL,
    MODEL_LABEL,
    PLAN_KEY,
    REVISION_LABEL,
    Context,
    Owner,
    check,
    drift_patch,
    group_name,
    group_objects,
    group_plan,
    group_revision,
    group_secret,
    model_label,
    model_objects,
    plan_record_name,
)
from .planner import PlanError, PlannerOptions
from .profile import ModelProfile
from .profiles import LocalProfiles, ModelNotFound, local_model_dir, remote_profile
from .replan import PlanChoice, choose_plan, without_held
from .rollout import Decision, GroupKey, Want, decide, group_state, observe_groups
from .settings import Settings
from .status import Observation, Problem, build_status, failed_status, status_patch

log = logging.getLogger("shard_operator")


@dataclass
class Memory:
    """What one model's loop remembers between reconciles (lost on restart, which is harmless)."""

    pool: str = ""               # inventory fingerprint ...
    pool_since: float = 0.0      # ... and since when it has been this
    generation: int = -1         # the spec generation the pool was last seen with
    reconsidered: str = ""       # the pool fingerprint a better plan was last looked for on
    last_poll: float = float("-inf")
    measured: dict[tuple[str, int], int] = field(default_factory=dict)  # (pod, rank) -> resident bytes
    wake_in: float = 0.0         # seconds until the next reconcile is due anyway
    # The status this loop last wrote: kopf's copy of the object may not show it yet, and a stale
    # status would undo restart counts and transition times.
    status: dict[str, Any] | None = None
    # A status write failed: it may have landed or not (a timeout), so the server's status is
    # unknown and the next write sends all of it, not the difference from `status`.
    status_unknown: bool = False


@dataclass
class World:
    """The cluster as the indexes saw it when a reconcile started."""

    nodes: list[dict[str, Any]]
    gpu_uses: list[GpuUse]


class Controller:
    """Settings, the API edge, caches and the wake-up calls of every model's loop."""

    def __init__(self, settings: Settings, kube: Kube,
                 fetch: Callable[[str, float], ShardsResponse | None] = leaders.fetch,
                 clock: Callable[[], float] = time.monotonic):
        self.settings, self.kube, self.fetch, self.clock = settings, kube, fetch, clock
        self.planner_options = PlannerOptions.from_json(settings.planner_options)
        self.local_profiles = LocalProfiles()
        self.wakeups: dict[tuple[str, str], asyncio.Event] = {}
        self.generations: dict[tuple[str, str], int] = {}  # the spec generation last reconciled
        self.reconciles = 0
        self.failures = 0
        self.memories: dict[tuple[str, str], Memory] = {}  # (namespace, name) -> its running loop's memory
        # Read by the metrics endpoint (metrics.py), with each model's last status.
        self.reconcile_seconds = Histogram("shard_operator_reconcile_seconds", "Time of one reconcile of one model.",
                                           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=None)

    def statuses(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(namespace, name) -> the status each running model loop last wrote."""
        return {key: m.status for key, m in list(self.memories.items()) if m.status is not None}

    # ---------------------------------------------------------------- waking
    def wake(self, namespace: str, label: str) -> None:
        event = self.wakeups.get((namespace, label))
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for event in self.wakeups.values():
            event.set()

    async def run(self, body: kopf.Body, stopped: kopf.DaemonStopped, world: Callable[[], World]) -> None:
        """A model's loop: reconcile, then sleep until woken or due."""
        key = (body.metadata.namespace, model_label(body.metadata.name))
        wake = self.wakeups.setdefault(key, asyncio.Event())
        named = (body.metadata.namespace, body.metadata.name)
        memory = self.memories[named] = Memory()
        settings = self.settings
        try:
            while not stopped:
                wake.clear()
                snapshot = copy.deepcopy({"metadata": dict(body.metadata), "spec": dict(body.spec),
                                          "status": dict(body.status)})
                try:
                    with self.reconcile_seconds.time():
                        await asyncio.to_thread(self.reconcile, snapshot, world(), memory)
                except Exception as err:  # nothing must end the loop: say why, and the next round retries
                    self.failures += 1
                    log.exception("reconcile of %s/%s failed", *key)
                    memory.wake_in = min(memory.wake_in or settings.resync_seconds, 5.0)
                    await asyncio.to_thread(self._report_failure, snapshot, memory, err)
                try:  # kopf cancels this task when the model is deleted or the operator stops
                    await asyncio.wait_for(wake.wait(), timeout=memory.wake_in or settings.resync_seconds)
                except TimeoutError:
                    pass
                if wake.is_set() and not stopped:
                    await asyncio.sleep(settings.debounce_seconds)  # one reconcile for a burst of events
        finally:
            if self.memories.get(named) is memory:
                del self.memories[named]
            if self.wakeups.get(key) is wake:
                del self.wakeups[key]
                self.generations.pop(key, None)

    # ---------------------------------------------------------------- the reconcile
    def reconcile(self, body: dict[str, Any], world: World, memory: Memory) -> None:
        self.reconciles += 1
        owner = Owner.of(body)
        generation = body["metadata"].get("generation") or 0
        self.generations[(owner.namespace, model_label(owner.name))] = generation
        previous = memory.status if memory.status is not None else body.get("status") or {}
        memory.wake_in = self.settings.resync_seconds
        selector = f"{MODEL_LABEL}={model_label(owner.name)}"
        kinds = (*KINDS, NETWORK_POLICY) if self.settings.network_policies else KINDS
        listing = {kind: self.kube.list(kind, owner.namespace, selector) for kind in kinds}

        obs = self._observe(owner, generation, listing, world)
        current = _current_plan(listing["ConfigMap"], owner.name)
        ctx, choice = self._plan(body, obs, current, listing, world, memory)
        if ctx is not None and obs.plan is not None:
            self._roll_out(body, ctx, obs, choice, current, previous, listing, world)
        obs.measured = self._poll(owner, obs, memory)
        self._report(body, owner, obs, previous, memory)

    def _observe(self, owner: Owner, generation: int, listing: dict[str, list], world: World) -> Observation:
        """The model's groups as its pods, Services and ConfigMaps show them."""
        obs = Observation(name=owner.name, generation=generation, spec=None)
        group_objs = [o for o in listing["Service"] + listing["ConfigMap"]
                      if (o["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == "group"]
        obs.groups = observe_groups(listing["Pod"], group_objs, healthy_nodes(world.nodes))
        obs.group_plans = _group_plans(listing["ConfigMap"])
        return obs

    def _plan(self, body: dict[str, Any], obs: Observation, current: Plan | None, listing: dict[str, list],
              world: World, memory: Memory) -> tuple[Context | None, PlanChoice | None]:
        """Spec, profile and plan; what stops them becomes `obs.problem` (a condition, not a crash)."""
        ctx = choice = None
        try:
            obs.spec = parse_spec(body.get("spec") or {})
            ctx = Context(owner=Owner.of(body), spec=obs.spec, default_image=self.settings.worker_image,
                          network_policy=self.settings.network_policies)
            check(ctx)
            profile = self._profile(ctx, listing)
            if profile is None:
                obs.planning = "profiling the checkpoint in a pod (the operator cannot read its volume)"
                memory.wake_in = min(memory.wake_in, 5.0)
                return ctx, None
            choice = self._choose(current, profile, obs.spec, world, ctx.owner, memory, obs.generation)
            obs.plan = choice.plan
            if choice.shortfall:  # run the groups that fit, and say what the others lack
                obs.problem = Problem("InsufficientCapacity", choice.shortfall, fatal=False)
        except SpecError as err:
            obs.problem = Problem("InvalidSpec", str(err))
            return None, None
        except ModelNotFound as err:
            obs.problem = Problem("ModelNotFound", str(err))
        except CheckpointError as err:
            obs.problem = Problem("InvalidModel", str(err))
        except PlanError as err:
            obs.problem = Problem(err.reason, err.message, fatal=current is None)
            obs.plan = current  # nothing new fits: keep serving with what still runs
        return ctx, choice

    def _roll_out(self, body: dict[str, Any], ctx: Context, obs: Observation, choice: PlanChoice | None,
                  current: Plan | None, previous: dict[str, Any], listing: dict[str, list], world: World) -> None:
        """Decide which groups to create, keep, recreate or delete, and do it."""
        plan = obs.plan
        assert plan is not None
        obs.wants = [Want(g.replica, group_revision(ctx, plan, g.replica),
                          dict(Counter(r.node for r in plan.group(g.replica)))) for g in plan.groups]
        for want in obs.wants:
            obs.group_plans[want.key] = group_plan(plan, want.replica)
        restarts = {(g["replica"], g["revision"]): g.get("restarts", 0) for g in previous.get("groups") or []}
        free = free_gpus(world.nodes, world.gpu_uses, ctx.spec.placement.gpu_resource)
        decision = decide(obs.wants, obs.groups, ctx.spec.rollout, restarts, self.settings.restart_budget, free)
        self._apply(ctx, plan, decision, listing)
        for key in decision.restart:
            restarts[key] = restarts.get(key, 0) + 1
        alive = {g.key for g in obs.groups} | {w.key for w in obs.wants}
        obs.restarts = {k: v for k, v in restarts.items() if k in alive}
        obs.decision = decision
        self._events(body, choice, current, decision, obs)

    def _report(self, body: dict[str, Any], owner: Owner, obs: Observation, previous: dict[str, Any],
                memory: Memory) -> None:
        """Write the status when it changed, and say what went wrong in Events."""
        status = build_status(obs, previous, _now())
        self._problem_events(body, previous, status)
        self._write_status(owner, previous, status, memory)
        if any(group_state(g)[0] in ("Starting", "Terminating") for g in obs.groups):
            memory.wake_in = min(memory.wake_in, 5.0)  # pods change without other events at times

    def _report_failure(self, body: dict[str, Any], memory: Memory, err: Exception) -> None:
        """A reconcile raised: the Degraded condition (ReconcileError) and a Warning Event say so."""
        previous = memory.status if memory.status is not None else body.get("status") or {}
        message = " ".join(f"{type(err).__name__}: {err}".split())[:1000]
        try:
            status = failed_status(previous, message, body["metadata"].get("generation") or 0, _now())
            self._write_status(Owner.of(body), previous, status, memory)
        except Exception:  # the API may be what failed: the next round tries again
            log.exception("reporting the failed reconcile of %s/%s failed too", body["metadata"].get("namespace"),
                          body["metadata"]["name"])
            return
        self._problem_events(body, previous, status)

    def _write_status(self, owner: Owner, previous: dict[str, Any], status: dict[str, Any], memory: Memory) -> None:
        """Patch the status from `previous` (the last written) to `status`: all of it while the fate
        of an earlier write is unknown (it failed, maybe after landing)."""
        patch = status if memory.status_unknown else status_patch(previous, status)
        if patch is not None:
            memory.status_unknown = True  # until the server answers
            self.kube.patch_status(owner.namespace, owner.name, patch)
            memory.status_unknown = False
        memory.status = status

    # ---------------------------------------------------------------- steps
    def _profile(self, ctx: Context, listing: dict[str, list]) -> ModelProfile | None:
        model_dir = local_model_dir(ctx.spec, self.settings)
        if model_dir is not None:
            return self.local_profiles.get(model_dir)
        return remote_profile(ctx, self.kube, listing["Pod"], listing["ConfigMap"], self.settings.profile_timeout_seconds)

    def _choose(self, current: Plan | None, profile: ModelProfile, spec: ShardedModelSpec, world: World,
                owner: Owner, memory: Memory, generation: int) -> PlanChoice:
        settings = self.settings
        resource = spec.placement.gpu_resource
        others = used_per_node(world.gpu_uses, resource, exclude=(owner.namespace, model_label(owner.name)))
        inventory = without_held(inventory_from_nodes(world.nodes, spec.placement), others)
        pool, now = fingerprint(inventory), self.clock()
        if pool != memory.pool:
            # A pool that changed with the spec (nodeSelector, tolerations) was asked for: no wait.
            spec_changed = memory.generation not in (-1, generation)
            memory.pool, memory.pool_since = pool, (float("-inf") if spec_changed else now)
        memory.generation = generation
        waited = now - memory.pool_since
        settled = waited >= settings.settle_seconds
        if not settled:
            memory.wake_in = min(memory.wake_in, settings.settle_seconds - waited + 0.01)
        reconsider = settled and memory.reconsidered != pool
        choice = choose_plan(current, profile, spec, inventory, settled=settled, reconsider=reconsider,
                             improvement=settings.improvement_threshold, options=self.planner_options)
        if reconsider:
            memory.reconsidered = pool
        return choice

    def _apply(self, ctx: Context, plan: Plan, decision: Decision, listing: dict[str, list]) -> None:
        """Create what is missing, patch what drifted, delete what the decision drops.

        A group's Secret (its key) is never listed or read: it is created just before pods of the
        group are (a 409 means it is there already) and deleted with the group's Service.
        """
        kube, ns = self.kube, ctx.owner.namespace
        existing = {(kind, o["metadata"]["name"]): o for kind, objs in listing.items() for o in objs}
        desired = model_objects(ctx, plan)
        for (replica, revision), create_pods in sorted(decision.keep.items()):
            service, config, *pods = group_objects(ctx, plan, replica)
            desired += [service, config]
            missing = [p for p in pods if ("Pod", p["metadata"]["name"]) not in existing]
            if create_pods and missing:
                desired += [group_secret(ctx.owner, plan, replica, revision, new_group_key()), *missing]
        for obj in desired:
            actual = existing.get((obj["kind"], obj["metadata"]["name"]))
            if actual is None:
                kube.create(obj)
            elif obj["kind"] != "Pod" and (patch := drift_patch(obj, actual)) is not None:
                kube.patch(obj["kind"], ns, obj["metadata"]["name"], patch)
        for key in decision.restart:
            for pod in _group_members(listing, key, kinds=("Pod",)):
                kube.delete("Pod", ns, pod["metadata"]["name"])
        for key in decision.delete:
            if _group_members(listing, key, kinds=("Service",)):  # once per group, before its Service goes
                kube.delete("Secret", ns, group_name(ctx.owner.name, *key))
            for kind in ("Pod", "Service", "ConfigMap"):
                for obj in _group_members(listing, key, kinds=(kind,)):
                    kube.delete(kind, ns, obj["metadata"]["name"])

    def _poll(self, owner: Owner, obs: Observation, memory: Memory) -> dict[tuple[str, int], int]:
        """Measured resident bytes per rank (and its pod) from each ready leader, every status_poll_seconds."""
        period = self.settings.status_poll_seconds
        if period <= 0 or obs.spec is None:
            return memory.measured
        now = self.clock()
        if now - memory.last_poll < period:
            memory.wake_in = min(memory.wake_in, period - (now - memory.last_poll))
            present = {(r.pod, r.rank) for g in obs.groups for r in g.ranks}
            return {key: n for key, n in memory.measured.items() if key in present}
        ready = [g for g in obs.groups if group_state(g)[0] == "Ready"]
        if not ready:
            return memory.measured
        memory.last_poll = now
        memory.wake_in = min(memory.wake_in, period)
        measured: dict[tuple[str, int], int] = {}
        for group in ready:
            leader = next((r for r in group.ranks if r.rank == 0), None)
            if leader is None or not leader.pod_ip:
                continue
            url = self.settings.leader_url.format(pod_ip=leader.pod_ip, port=obs.spec.worker.port,
                                                  pod=leader.pod, namespace=owner.namespace)
            report = self.fetch(url, self.settings.poll_timeout_seconds)
            if report is None:
                continue
            pods = {r.rank: r.pod for r in group.ranks}
            for rank, resident in report.resident_by_rank().items():
                if rank in pods:
                    measured[(pods[rank], rank)] = resident
        memory.measured = measured
        return measured

    # ---------------------------------------------------------------- events
    def _events(self, body: dict[str, Any], choice: PlanChoice | None, current: Plan | None,
                decision: Decision, obs: Observation) -> None:
        if choice is not None and (current is None or choice.plan.hash != current.hash or
                                   choice.plan.replicas != current.replicas):
            reason = {"initial": "Planned", "improved": "Rebalancing", "repaired": "Rebalancing",
                      "replanned": "Rebalancing", "respec": "Replanned", "scaled": "Scaled"}.get(choice.kind, "Planned")
            _event(body, "Normal", reason, choice.message)
        states = {g.key: group_state(g) for g in obs.groups}
        for key, create_pods in decision.keep.items():
            if create_pods and states.get(key, ("Empty",))[0] == "Empty":
                _event(body, "Normal", "CreatingGroup", f"group {key[0]} revision {key[1]}")
        for key in decision.restart:
            _event(body, "Warning", "RecreatingGroup", f"group {key[0]}: {states[key][1]}")
        for key, why in decision.delete.items():
            _event(body, "Normal", "DeletingGroup", f"group {key[0]} revision {key[1]}: {why}")

    def _problem_events(self, body: dict[str, Any], previous: dict[str, Any], status: dict[str, Any]) -> None:
        """A Warning whenever the Degraded or a blocked Progressing condition says something new."""
        before = {c.get("type"): c for c in previous.get("conditions") or []}
        for cond in status["conditions"]:
            bad = (cond["type"] == "Degraded" and cond["status"] == "True") or \
                  (cond["type"] == "Progressing" and cond.get("reason") in ("Blocked", "Failed"))
            old = before.get(cond["type"]) or {}
            if bad and (old.get("reason"), old.get("message")) != (cond.get("reason"), cond.get("message")):
                _event(body, "Warning", cond["reason"], cond.get("message", ""))


# ---------------------------------------------------------------- helpers
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    log.info("%s/%s %s: %s", body["metadata"].get("namespace"), body["metadata"]["name"], reason, message)
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ShardedModel", **body}
    kopf.event(ref, type=type_, reason=reason, message=message[:1000])


def _current_plan(configmaps: list[dict[str, Any]], name: str) -> Plan | None:
    record = next((c for c in configmaps if c["metadata"]["name"] == plan_record_name(name)), None)
    if record is None:
        return None
    try:
        return Plan.from_json((record.get("data") or {}).get(PLAN_KEY, ""))
    except ValueError:
        return None  # unreadable: plan afresh


def _group_plans(configmaps: list[dict[str, Any]]) -> dict[GroupKey, Plan]:
    out = {}
    for cm in configmaps:
        labels = cm["metadata"].get("labels") or {}
        if labels.get(COMPONENT_LABEL) != "group":
            continue
        try:
            out[(int(labels[GROUP_LABEL]), labels[REVISION_LABEL])] = Plan.from_json(cm["data"][PLAN_KEY])
        except (KeyError, ValueError):
            continue
    return out


def _group_members(listing: dict[str, list], key: GroupKey, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    out = []
    for kind in kinds:
        for obj in listing[kind]:
            labels = obj["metadata"].get("labels") or {}
            if (labels.get(GROUP_LABEL), labels.get(REVISION_LABEL)) == (str(key[0]), key[1]) \
                    and not obj["metadata"].get("deletionTimestamp"):
                out.append(obj)
    return out


# ---------------------------------------------------------------- kopf wiring
def build_registry(controller: Controller, login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    """The kopf handlers of one operator instance (tests build several, one after another)."""
    registry = kopf.OperatorRegistry()
    if login is not None:
        kopf.on.login(registry=registry)(login)
    else:
        kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.index("", "v1", "nodes", id="nodes_index", registry=registry)
    def nodes_index(body: kopf.Body, **_: Any) -> dict[None, dict[str, Any]]:
        return {None: slim_node(dict(body))}

    @kopf.index("", "v1", "pods", id="gpu_index", registry=registry)
    def gpu_index(body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[None, GpuUse] | None:
        use = gpu_use(dict(body), labels.get(MODEL_LABEL, ""))
        return {None: use} if use is not None else None

    @kopf.on.event("", "v1", "nodes", registry=registry)
    def node_changed(**_: Any) -> None:
        controller.wake_all()

    @kopf.on.event("", "v1", "pods", labels={MODEL_LABEL: kopf.PRESENT}, registry=registry)
    def pod_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
        controller.wake(namespace, labels[MODEL_LABEL])

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def model_changed(namespace: str, name: str, meta: kopf.Meta, **_: Any) -> None:
        # Our own status writes are events too: only a new spec needs a reconcile.
        if controller.generations.get((namespace, model_label(name))) != meta.get("generation"):
            controller.wake(namespace, model_label(name))

    @kopf.daemon(GROUP, VERSION, PLURAL, id="model_loop", registry=registry, cancellation_timeout=10.0)
    async def model_loop(body: kopf.Body, stopped: kopf.DaemonStopped, nodes_index: kopf.Index,
                         gpu_index: kopf.Index, **_: Any) -> None:
        def world() -> World:  # index values are replaced, never changed in place: no copies
            return World(nodes=list(nodes_index.get(None, [])), gpu_uses=list(gpu_index.get(None, [])))
        await controller.run(body, stopped, world)

    return registry


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    ks = kopf.OperatorSettings()
    # Our Events are explicit (kopf.event); kopf's per-handler log lines would be writes on every
    # reconcile.
    ks.posting.level = logging.WARNING
    ks.peering.standalone = settings.standalone
    ks.watching.server_timeout = 300
    ks.persistence.finalizer = "sharding.dev/operator"
    return ks
