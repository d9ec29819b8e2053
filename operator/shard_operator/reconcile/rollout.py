"""Which groups to create, keep, recreate or delete, from what is observed. Pure.

A group is all-or-nothing: its ranks share one communicator, so one failed, deleted or restarted
rank fails the group, and the operator recreates all of it (up to a restart budget), unless a rank
exited EXIT_CONFIG: it said a restart would fail the same way (a bad checkpoint, a plan its device
cannot run), so the group is given up at once and the status says why. A group whose
node is gone or NotReady is *lost*: it is not recreated in place (that would fail again) but waits
for the planner to move it.

A pod bound to a Node that no longer exists is lost even while it is being deleted: no kubelet
will ever confirm its deletion, and the pod GC removes it only after a quarantine (40 s). The
operator deletes such pods with grace 0 (`deletion_grace`), as the pod GC will, so a replaced group
on a vanished node does not hold the model's status back.

Replacing a group (new placement or pod template) follows LeaderWorkerSet's rules: with `maxSurge`
the new group starts beside the old one, which is deleted once the new one is ready (the endpoint
Service selects ready leaders, so traffic moves by itself); with `maxUnavailable` an old group may
be deleted first. When neither allows progress the decision says so instead of cutting service.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from shard_contract.env import ENV_NAMES, EXIT_CONFIG

from ..api import Rollout
from ..objects.manifests import GROUP_LABEL, NODE_ANNOTATION, PLAN_LABEL, RANK_LABEL, RANKS_LABEL, REVISION_LABEL

GroupKey = tuple[int, str]  # (replica, revision)

# Container waiting reasons that mean the rank process died and was restarted in place.
CRASHED = ("CrashLoopBackOff", "RunContainerError")


@dataclass(frozen=True)
class RankState:
    rank: int
    pod: str
    state: str  # Pending | Running | Ready | Failed | Lost | Terminating
    node: str = ""
    started: bool = False
    message: str = ""
    pod_ip: str = ""
    permanent: bool = False  # it failed for good: it exited EXIT_CONFIG


def _terminations(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for cs in (pod.get("status") or {}).get("containerStatuses") or []
            for t in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated")) if t]


@dataclass(frozen=True)
class ObservedGroup:
    replica: int
    revision: str
    plan_hash: str
    world_size: int
    ranks: tuple[RankState, ...] = ()

    @property
    def key(self) -> GroupKey:
        return (self.replica, self.revision)


@dataclass(frozen=True)
class Want:
    """The group one replica should run: its revision and how many GPUs it takes on each node."""

    replica: int
    revision: str
    gpus: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> GroupKey:
        return (self.replica, self.revision)


# ---------------------------------------------------------------- observing
def _terminated_message(pod: dict[str, Any]) -> str:
    terminations = _terminations(pod)
    if not terminations:
        status = pod.get("status") or {}
        return status.get("reason") or status.get("message") or "failed"
    term = terminations[0]
    # With FallbackToLogsOnError the message is the tail of the rank's log: keep its last line.
    tail = (term.get("message") or "").strip().splitlines()
    said = f": {tail[-1][:300]}" if tail else ""
    return f"{term.get('reason') or 'exited'} (exit code {term.get('exitCode')}){said}"


def pod_node(pod: dict[str, Any]) -> str:
    """The node a pod runs on, or the node the plan pinned it to while it is unscheduled."""
    return (pod.get("spec") or {}).get("nodeName") or \
        ((pod["metadata"].get("annotations") or {}).get(NODE_ANNOTATION) or "")


def bound_to_missing_node(pod: dict[str, Any], existing_nodes: set[str] | None) -> bool:
    node = (pod.get("spec") or {}).get("nodeName")
    return existing_nodes is not None and bool(node) and node not in existing_nodes


def deletion_grace(pod: dict[str, Any], existing_nodes: set[str] | None) -> int | None:
    """The grace period to delete a pod with: 0 where its node no longer exists; None: the pod's own."""
    return 0 if bound_to_missing_node(pod, existing_nodes) else None


def rank_state(pod: dict[str, Any], healthy_nodes: set[str] | None = None,
               existing_nodes: set[str] | None = None) -> RankState:
    """What one rank pod is doing. `healthy_nodes`: nodes that exist and are Ready; `existing_nodes`:
    nodes that exist (None: unknown)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    statuses = status.get("containerStatuses") or []
    node = pod_node(pod)
    started = phase != "Pending" or any((cs.get("state") or {}).get("running") or
                                        (cs.get("state") or {}).get("terminated") for cs in statuses)
    common = dict(rank=int(meta["labels"][RANK_LABEL]), pod=meta["name"], node=node, started=started,
                  pod_ip=status.get("podIP") or "")
    if bound_to_missing_node(pod, existing_nodes):
        return RankState(state="Lost", message=f"node {node} no longer exists", **common)
    if meta.get("deletionTimestamp"):
        return RankState(state="Terminating", **common)
    # Before Failed: a rank whose node went away fails with it (and its peers fail for want of
    # it); recreating the group there would fail again.
    if healthy_nodes is not None and node and node not in healthy_nodes:
        return RankState(state="Lost", message=f"node {node} is gone or NotReady", **common)
    if phase in ("Failed", "Succeeded"):
        permanent = any(t.get("exitCode") == EXIT_CONFIG for t in _terminations(pod))
        return RankState(state="Failed", message=f"{phase}: {_terminated_message(pod)}", permanent=permanent,
                         **common)
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in CRASHED or cs.get("restartCount", 0) > 0:
            return RankState(state="Failed", message=f"restarted {cs.get('restartCount', 0)} times "
                             f"({waiting.get('reason') or _terminated_message(pod)})", **common)
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    if phase == "Running":
        ready = (conditions.get("Ready") or {}).get("status") == "True"
        return RankState(state="Ready" if ready else "Running", **common)
    scheduled = conditions.get("PodScheduled") or {}
    message = scheduled.get("message", "") if scheduled.get("status") == "False" else ""
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            message = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return RankState(state="Pending", message=message, **common)


def _world_size(pod: dict[str, Any]) -> int | None:
    for c in (pod.get("spec") or {}).get("containers") or []:
        for e in c.get("env") or []:
            if e.get("name") == ENV_NAMES["world_size"]:
                return int(e["value"])
    return None


def observe_groups(pods: Iterable[dict[str, Any]], other_objects: Iterable[dict[str, Any]] = (),
                   healthy_nodes: set[str] | None = None,
                   existing_nodes: set[str] | None = None) -> list[ObservedGroup]:
    """Groups from rank pods, plus groups of which only a Service or ConfigMap is left. A pod of
    several ranks (a tensor-parallel group) counts as each of them, in its state."""
    ranks: dict[GroupKey, list[RankState]] = defaultdict(list)
    info: dict[GroupKey, tuple[str, int]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if RANK_LABEL not in labels or GROUP_LABEL not in labels:
            continue
        key = (int(labels[GROUP_LABEL]), labels.get(REVISION_LABEL, ""))
        state = rank_state(pod, healthy_nodes, existing_nodes)
        ranks[key].extend(replace(state, rank=state.rank + i) for i in range(int(labels.get(RANKS_LABEL, "1"))))
        world = _world_size(pod)
        if world is not None:
            info[key] = (labels.get(PLAN_LABEL, ""), world)
    for obj in other_objects:
        labels = obj["metadata"].get("labels") or {}
        if GROUP_LABEL in labels:
            key = (int(labels[GROUP_LABEL]), labels.get(REVISION_LABEL, ""))
            ranks.setdefault(key, [])
            info.setdefault(key, (labels.get(PLAN_LABEL, ""), 0))
    return [ObservedGroup(replica=k[0], revision=k[1], plan_hash=info.get(k, ("", 0))[0],
                          world_size=info.get(k, ("", 0))[1],
                          ranks=tuple(sorted(ranks[k], key=lambda r: r.rank)))
            for k in sorted(ranks)]


def group_state(group: ObservedGroup | None) -> tuple[str, str]:
    """(state, message): Empty, Terminating, Failed, Lost, Ready or Starting."""
    if group is None or not group.ranks:
        return "Empty", ""
    ranks = group.ranks
    if any(r.state == "Terminating" for r in ranks):
        return "Terminating", "waiting for the old pods to go"
    # Lost before Failed: when a node goes, its ranks are lost and their peers elsewhere fail for
    # want of them; the group must move (a new plan), not be recreated where it was.
    lost = [r for r in ranks if r.state == "Lost"]
    if lost:
        return "Lost", "; ".join(f"rank {r.rank} ({r.pod}): {r.message}" for r in lost)
    failed = [r for r in ranks if r.state == "Failed"]
    if failed:
        return "Failed", "; ".join(f"rank {r.rank} ({r.pod}) {r.message}" for r in failed)
    present = {r.rank for r in ranks}
    missing = sorted(set(range(group.world_size)) - present)
    if missing and any(r.started for r in ranks):
        return "Failed", f"rank {', '.join(map(str, missing))} deleted while the group ran"
    if not missing and all(r.state == "Ready" for r in ranks):
        return "Ready", ""
    waiting = [f"rank {r.rank}: {r.message}" for r in ranks if r.message]
    return "Starting", "; ".join(waiting)


# ---------------------------------------------------------------- deciding
@dataclass
class Decision:
    # Groups to keep, and whether their missing pods may be created (new or still-forming groups).
    keep: dict[GroupKey, bool] = field(default_factory=dict)
    restart: list[GroupKey] = field(default_factory=list)     # delete the pods; recreated next round
    delete: dict[GroupKey, str] = field(default_factory=dict)  # whole groups, with the reason
    exhausted: dict[int, str] = field(default_factory=dict)    # replica -> why it is given up
    unrecoverable: set[int] = field(default_factory=set)       # of those, the ones a restart would not mend
    waiting: list[str] = field(default_factory=list)           # why a replacement cannot proceed (blocked)
    queued: list[str] = field(default_factory=list)            # replacements that wait their turn
    lost: set[int] = field(default_factory=set)                # replicas whose failed group's node is gone


def _fits(want: Want, free: dict[str, int] | None) -> bool:
    return free is None or all(free.get(node, 0) >= n for node, n in want.gpus.items())


def decide(wants: Iterable[Want], observed: Iterable[ObservedGroup], rollout: Rollout,
           restarts: dict[GroupKey, int], budget: int, free_gpus: dict[str, int] | None = None,
           healthy_nodes: set[str] | None = None) -> Decision:
    """The next step towards `wants` (one group per replica) from the `observed` groups.

    `restarts`: recreations so far per group; `free_gpus`: GPUs nobody requests on each node (None:
    unknown, assume room); `healthy_nodes`: nodes that exist and are Ready (None: unknown). A failed
    group planned onto a node outside them is lost, not recreated there.
    """
    wanted = {w.replica: w for w in wants}
    groups: dict[int, list[ObservedGroup]] = defaultdict(list)
    state = {}
    decision = Decision()
    for g in observed:
        state[g.key] = group_state(g)
        if g.replica in wanted:
            groups[g.replica].append(g)
        elif state[g.key][0] != "Terminating":
            decision.delete[g.key] = "no longer in the plan"

    def ready(r: int) -> list[ObservedGroup]:
        return [g for g in groups[r] if state[g.key][0] == "Ready"]

    unavailable = sum(1 for r in wanted if not ready(r))
    surging = sum(1 for r, w in wanted.items() if any(g.revision != w.revision for g in ready(r))
                  and state.get(w.key, ("Empty",))[0] not in ("Empty", "Ready"))
    free = dict(free_gpus) if free_gpus is not None else None
    for r in sorted(wanted):
        want = wanted[r]
        new = next((g for g in groups[r] if g.revision == want.revision), None)
        new_state, new_message = state.get(want.key, ("Empty", ""))
        if new_state == "Failed" and healthy_nodes is not None and not set(want.gpus) <= healthy_nodes:
            new_state = "Lost"  # its node went with some of its ranks: they are not even listed
            decision.lost.add(r)
        olds = [g for g in groups[r] if g.revision != want.revision]
        old_ready = [g for g in olds if state[g.key][0] == "Ready"]
        for g in olds:
            if state[g.key][0] not in ("Ready", "Terminating"):
                decision.delete[g.key] = f"replaced by revision {want.revision} ({state[g.key][0].lower()})"
        if new_state == "Ready":
            decision.keep[want.key] = False
            for g in old_ready:
                decision.delete[g.key] = f"replaced by revision {want.revision}, which is ready"
        elif new_state == "Failed":
            done = restarts.get(want.key, 0)
            for_good = [rank for rank in new.ranks if rank.permanent] if new is not None else []
            if for_good:
                decision.keep[want.key] = False
                decision.unrecoverable.add(r)
                decision.exhausted[r] = (
                    f"group {r} failed in a way a restart would repeat (a bad checkpoint, or a plan its devices "
                    f"cannot run): {'; '.join(f'rank {x.rank} ({x.pod}) {x.message}' for x in for_good)}. "
                    "Fix the model or the spec (an edit makes a new group), or delete its pods to retry.")
            elif done < budget:
                decision.restart.append(want.key)
                decision.keep[want.key] = False
            else:
                decision.keep[want.key] = False
                decision.exhausted[r] = (f"group {r} failed {done + 1} times, over the restart budget of "
                                         f"{budget}; last: {new_message}. Delete its pods to retry.")
        elif new_state == "Starting":
            decision.keep[want.key] = True  # completes a group whose creation was interrupted
        elif new_state in ("Terminating", "Lost"):
            decision.keep[want.key] = False
        elif not old_ready:
            decision.keep[want.key] = True
            _take(want, free)
        elif surging < rollout.max_surge and _fits(want, free):
            decision.keep[want.key] = True
            surging += 1
            _take(want, free)
        elif unavailable < rollout.max_unavailable:
            unavailable += 1
            for g in old_ready:
                decision.delete[g.key] = f"replaced in place by revision {want.revision} (maxUnavailable)"
        else:
            # Its turn comes when the replacements under way are done (maxSurge or maxUnavailable
            # taken by them); otherwise only a change to the spec or the pool moves it.
            turn = bool((rollout.max_surge and surging >= rollout.max_surge) or
                        (rollout.max_unavailable and unavailable >= rollout.max_unavailable))
            others = sum(1 for o in wanted if o != r and ready(o))
            why = _why_waiting(want, rollout, surging, unavailable, free, others, turn)
            (decision.queued if turn else decision.waiting).append(why)
        if new is not None and want.key not in decision.keep:
            decision.keep[want.key] = False
    return decision


def _take(want: Want, free: dict[str, int] | None) -> None:
    if free is not None:
        for node, n in want.gpus.items():
            free[node] = free.get(node, 0) - n


def _why_waiting(want: Want, rollout: Rollout, surging: int, unavailable: int, free: dict[str, int] | None,
                 others: int, turn: bool) -> str:
    """Why a replacement waits (`turn`: for those under way), and what would let it go on: in
    place, it takes its group down while `others` groups serve (none: the model goes down)."""
    head = f"group {want.replica} {'waits its turn' if turn else 'cannot be replaced yet'}: "
    if rollout.max_surge == 0 and rollout.max_unavailable == 0:
        return head + "maxSurge and maxUnavailable are both 0"
    if surging >= rollout.max_surge:
        return head + f"{surging} of maxSurge={rollout.max_surge} replacement groups are starting"
    short = ", ".join(f"{node} needs {n} GPUs, {max(0, (free or {}).get(node, 0))} free"
                      for node, n in sorted(want.gpus.items()) if (free or {}).get(node, 0) < n)
    if rollout.max_unavailable:
        return head + (f"the pool has no room for a new group beside the serving one ({short}), and {unavailable} "
                       f"of maxUnavailable={rollout.max_unavailable} groups are down already")
    if others:
        down = (f"replacing it in place takes it down while {others} other group{'s' if others > 1 else ''} "
                f"serve{'s' if others == 1 else ''}")
    else:
        down = "replacing it in place takes the model down (no other group serves)"
    return (head + f"the pool has no room for a new group beside the serving one ({short}); {down}: "
            f"spec.rollout.maxUnavailable 1 allows that")
