"""The reconcile's table tier: scenarios of one model, round by round, against an in-memory store.

Each round does something to the world (a node goes, a rank fails, the spec changes, time passes,
the kubelet runs the pods), then runs one reconcile through the model loop's own `step` (the
Controller with a `Store` for its API edge, a manual clock and a list for its recorder) and checks
what it wrote, in order, the Events it posted and when it asks to run next. No HTTP, no kopf:
the whole tier runs in well under a second. The kopf + emulated API tests (test_operator.py) are
the integration tier of the same behaviours.

Names in the tables: `m1-<group>-<revision>[-<rank>]`, with each revision digest replaced by a
letter in the order the scenario meets them (a, b, ...); a status write reads `status <phase>`;
(409), (404), (500), (504) are the API server's answers other than success, (grace 0) a deletion's
grace period.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from shard_contract.checkpoint import read_checkpoint
from shard_contract.env import SECRET_KEY
from shard_devcluster.patches import merge_patch
from shard_operator.objects.manifests import MODEL_LABEL
from shard_operator.reconcile.capacity import gpu_use, slim_node
from shard_operator.reconcile.core import Event, World
from shard_operator.reconcile.handlers import Controller, Loop
from shard_operator.settings import Settings
from tests.operator.conftest import RESIDENT, leader_report
from tests.support.cluster import gpu_node, sharded_model, write_model
from tests.support.operator import ManualClock
from tests.support.store import MODEL, Store

# Distinct periods, so a table's next-run time says which rule set it: the settle window (30 s,
# +0.01), the leader poll (20 s), pods that start or stop (5 s, also after a failure), resync (60 s).
SETTINGS = Settings(resync_seconds=60, settle_seconds=30, status_poll_seconds=20, restart_budget=2,
                    host_path_prefix="", worker_image="example.com/shard-worker:test")


class Sim:
    """One ShardedModel `m1` reconciled against a Store, on GPU nodes, by a manual clock."""

    def __init__(self, tmp, nodes: list[dict], settings: Settings = SETTINGS):
        self.store, self.clock, self.tmp = Store(), ManualClock(), tmp
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.events: list[Event] = []
        self.controller = Controller(settings, self.store, fetch=lambda url, timeout: leader_report(),
                                     clock=self.clock, recorder=lambda body, event: self.events.append(event))
        self.loop = Loop("m1")
        self.letters: dict[str, dict[str, str]] = {}  # group -> revision digest -> letter

    # ---- what happens between two reconciles
    def create(self, **spec) -> None:
        body = sharded_model("m1", write_model(self.tmp / "models" / "tiny"), **spec)
        self.store.put({**body, "metadata": {**body["metadata"], "generation": 1}})

    def edit(self, **spec) -> None:
        model = self.store.get(MODEL, "m1")
        model["spec"] = merge_patch(model["spec"], spec)
        model["metadata"]["generation"] += 1

    def pods(self, group: int | None = None) -> list[str]:
        return [p["metadata"]["name"] for p in self.store.of_kind("Pod")
                if group is None or p["metadata"]["labels"].get("sharding.dev/group") == str(group)]

    def world(self) -> World:
        return World(nodes=[slim_node(n) for n in self.nodes.values()],
                     gpu_uses=[u for p in self.store.of_kind("Pod")
                               if (u := gpu_use(p, (p["metadata"].get("labels") or {}).get(MODEL_LABEL, "")))])

    # ---- one reconcile
    def reconcile(self) -> tuple[list[str], list[str], float]:
        """(writes, Events as "Type Reason", seconds until the next reconcile)."""
        body = copy.deepcopy(self.store.get(MODEL, "m1"))
        wait = self.controller.step(self.loop, body, self.world())
        events, self.events = self.events, []
        return [self.short(w) for w in self.store.take_log()], [f"{e.type} {e.reason}" for e in events], wait

    def short(self, text: str) -> str:
        """Each group's revision digests as letters, in the order first seen (a: its first)."""
        def letter(m: re.Match) -> str:
            seen = self.letters.setdefault(m[1], {})
            return f"-{m[1]}-{seen.setdefault(m[2], 'abcdefgh'[len(seen)])}"
        return re.sub(r"-(\d+)-([0-9a-f]{6})\b", letter, text)

    def condition(self, type_: str) -> dict:
        status = self.store.get(MODEL, "m1")["status"]
        return next(c for c in status["conditions"] if c["type"] == type_)


# ---------------------------------------------------------------- what happens, as table cells
Act = Callable[[Sim], None]


def create(**spec) -> Act:
    return lambda sim: sim.create(**spec)


def edit(**spec) -> Act:
    return lambda sim: sim.edit(**spec)


def kubelet(ready: bool = True) -> Act:
    return lambda sim: sim.store.kubelet(ready, nodes=set(sim.nodes))


def later(seconds: float) -> Act:
    return lambda sim: sim.clock.advance(seconds)


def node_ready(name: str, ready: bool) -> Act:
    def act(sim: Sim) -> None:
        sim.nodes[name]["status"]["conditions"] = [{"type": "Ready", "status": str(ready)}]
    return act


def node_gone(name: str) -> Act:
    return lambda sim: sim.nodes.pop(name)


def rank_fails(group: int, rank: int, exit_code: int = 1) -> Act:
    return lambda sim: sim.store.fail_pod(sim.pods(group)[rank], exit_code)


def request_fails(verb: str, kind: str | None = None, landed: bool = False) -> Act:
    return lambda sim: sim.store.fail(verb, kind, landed)


def profiler_done(sim: Sim) -> None:
    """The profiling pod printed the checkpoint's facts (as `python -m shard_contract.checkpoint`) and exited 0."""
    sim.store.get("Pod", "m1-profile")["status"] = {"phase": "Succeeded"}
    facts = read_checkpoint(sim.tmp / "models" / "tiny").model_dump_json()
    sim.store.logs[("default", "m1-profile")] = f"reading the checkpoint\n{facts}\n"


@dataclass
class Round:
    do: list[Act]                       # what happens before this reconcile
    writes: list[str]                   # the requests it makes, in order
    events: list[str] = field(default_factory=list)
    next: float = 60.0                  # seconds until it asks to run again
    then: Callable[[Sim], object] = lambda sim: None  # more to check afterwards


def group_writes(group: int, revision: str, pods: int = 2) -> list[str]:
    """Creating a group of two ranks (in two pods, or one): Service, plan, a new key (whatever key
    an earlier incarnation left is deleted first: here none, a 404), then the pods."""
    name = f"m1-{group}-{revision}"
    return [f"create Service {name}", f"create ConfigMap {name}", f"delete Secret {name} (404)",
            f"create Secret {name}",
            *(f"create Pod {name}-{rank}" for rank in range(pods))]


def group_deletes(group: int, revision: str, grace: int | None = None) -> list[str]:
    """Deleting a group: its key (once, with its Service), pods (with a grace period), Service and plan."""
    name = f"m1-{group}-{revision}"
    pods = [f"delete Pod {name}-{rank}" + (f" (grace {grace})" if grace is not None else "") for rank in (0, 1)]
    return [f"delete Secret {name}", *pods, f"delete Service {name}", f"delete ConfigMap {name}"]


# Group 0 recreated after a rank failed: a new key (the last incarnation's deleted), then its pods.
RECREATE = ["delete Secret m1-0-a", "create Secret m1-0-a", "create Pod m1-0-a-0", "create Pod m1-0-a-1"]
MODEL_WRITES = ["create Service m1", "create Service m1-metrics", "create ConfigMap m1-plan"]

def condition(type_: str, reason: str, words: str = "") -> Callable[[Sim], None]:
    def check(sim: Sim) -> None:
        cond = sim.condition(type_)
        assert (cond["reason"], words in cond["message"]) == (reason, True), cond
    return check


def both(*checks: Callable[[Sim], None]) -> Callable[[Sim], None]:
    def check(sim: Sim) -> None:
        for c in checks:
            c(sim)
    return check


def nodes_of_group(group: int, revision: str, nodes: set[str]) -> Callable[[Sim], None]:
    """The pods of group `group` revision `revision` (its letter) are planned onto `nodes`."""
    def check(sim: Sim) -> None:
        planned = {p["metadata"]["annotations"]["sharding.dev/node"] for p in sim.store.of_kind("Pod")
                   if sim.short(p["metadata"]["name"]).startswith(f"m1-{group}-{revision}-")}
        assert planned == nodes, planned
    return check


def measured(sim: Sim) -> None:
    shards = sim.store.get(MODEL, "m1")["status"]["shards"]
    assert sorted(s["residentBytes"] for s in shards) == [RESIDENT, RESIDENT + 2**20]


def ranks_of_one_pod(sim: Sim) -> None:
    """Each rank of the pod is a shard of its own, with its own measured bytes."""
    shards = sim.store.get(MODEL, "m1")["status"]["shards"]
    assert [(s["rank"], sim.short(s["pod"]), s["state"], s["residentBytes"]) for s in shards] == \
        [(0, "m1-0-a-0", "Ready", RESIDENT), (1, "m1-0-a-0", "Ready", RESIDENT + 2**20)]


KEYS: list[str] = []  # the group key of each incarnation, as its Secret held it


def key_of_this_incarnation(sim: Sim) -> None:
    """Each incarnation of a group has a key of its own: a record sealed in one opens in no other."""
    ranks_of_one_pod(sim)
    (secret,) = sim.store.of_kind("Secret")
    KEYS.append(secret["data"][SECRET_KEY])
    assert len(set(KEYS)) == len(KEYS)


def shard_states(*states: str) -> Callable[[Sim], None]:
    def check(sim: Sim) -> None:
        assert [s["state"] for s in sim.store.get(MODEL, "m1")["status"]["shards"]] == list(states)
    return check


def ready(groups: int = 1) -> list[str]:
    return ["Normal GroupReady"] * groups


READY = Round([kubelet()], ["status Ready"], ready(), next=20)  # the first poll of the leaders is due at once
READY2 = Round([kubelet()], ["status Ready"], ready(2), next=20)

# name -> (nodes, rounds)
SCENARIOS: dict[str, tuple[list[dict], list[Round]]] = {
    "create, load, ready, then nothing to write": ([gpu_node("a")], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),  # the pool's settle window starts
        Round([kubelet(ready=False)], ["status Loading"], next=5),  # starting pods: look again soon
        Round([kubelet()], ["status Ready"], ready(), next=20, then=measured),
        Round([later(31)], [], next=20),  # settled: no better plan, no churn
        Round([later(20)], [], next=20),
    ]),
    # podLayout auto on GPUs at tensor=2: one pod holds the group's two GPUs and runs both ranks.
    "a pod per tensor-parallel group counts as each of its ranks": ([gpu_node("a")], [
        Round([create(pod_layout="auto")], [*MODEL_WRITES, *group_writes(0, "a", pods=1), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        Round([kubelet()], ["status Ready"], ready(), next=20, then=key_of_this_incarnation),
        Round([rank_fails(0, 0)], ["delete Pod m1-0-a-0", "status Degraded"],
              ["Warning RecreatingGroup", "Warning GroupFailed"], next=20,
              then=shard_states("Failed", "Failed")),  # the pod's ranks fail together
        Round([kubelet()], [*RECREATE[:3], "status Loading"],
              ["Normal CreatingGroup"], next=20),
        Round([kubelet()], ["status Ready"], ready(), next=20, then=key_of_this_incarnation),
    ]),
    "scale up and down by whole groups": ([gpu_node(n) for n in "abc"], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        READY,
        Round([edit(replicas=3)], ["patch ConfigMap m1-plan", "patch ConfigMap m1-0-a", *group_writes(1, "a"),
                                   *group_writes(2, "a"), "status Loading"],
              ["Normal Scaled", "Normal CreatingGroup", "Normal CreatingGroup"], next=20),
        Round([kubelet()], ["status Ready"], ready(2), next=20),
        Round([edit(replicas=2)], ["patch ConfigMap m1-plan", "patch ConfigMap m1-0-a", "patch ConfigMap m1-1-a",
                                   *group_deletes(2, "a"), "status Loading"],
              ["Normal Scaled", "Normal DeletingGroup"], next=20),
        Round([kubelet()], ["status Ready"], next=20),
    ]),
    "a flapping node causes no churn": ([gpu_node(n) for n in "ab"], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        READY,
        Round([later(31)], [], next=20),
        Round([node_ready("a", False)], ["status Degraded"], ["Warning NodeLost"], next=20,
              then=condition("Degraded", "NodeLost", "group 0 is lost; waiting for the node or a new plan")),
        Round([later(10), node_ready("a", True)], ["status Ready"], ready(), next=10),  # it serves again
        Round([later(10), node_ready("a", False)], ["status Degraded"], ["Warning NodeLost"], next=30.01),
        Round([later(10), node_ready("a", True)], ["status Ready"], ready(), next=20),
        Round([later(31)], [], next=20),  # the pool settled as it was: nothing moves
    ]),
    "a failed rank recreates its group until the restart budget is spent": ([gpu_node("a")], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        READY,
        Round([rank_fails(0, 1, exit_code=137)], ["delete Pod m1-0-a-0", "delete Pod m1-0-a-1", "status Degraded"],
              ["Warning RecreatingGroup", "Warning GroupFailed"], next=20),
        Round([kubelet()], [*RECREATE,
                            "status Loading"], ["Normal CreatingGroup"], next=20),
        Round([kubelet()], ["status Ready"], ready(), next=20),
        Round([rank_fails(0, 0)], ["delete Pod m1-0-a-0", "delete Pod m1-0-a-1", "status Degraded"],
              ["Warning RecreatingGroup", "Warning GroupFailed"], next=20),
        Round([kubelet()], [*RECREATE,
                            "status Loading"], ["Normal CreatingGroup"], next=20),
        Round([kubelet()], ["status Ready"], ready(), next=20),
        Round([rank_fails(0, 0)], ["status Failed"], ["Warning Failed", "Warning RestartBudgetExhausted"], next=20,
              then=condition("Degraded", "RestartBudgetExhausted", "over the restart budget of 2")),
        Round([later(20)], [], next=10.01),  # the failed pods stay (`kubectl logs`); no leader to poll
    ]),
    "a replacement without room to surge waits, then goes in place": ([gpu_node("a")], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        READY,
        # The spec is accepted (the plan record keeps it); the rollout waits, saying what it would cost.
        Round([edit(worker={"image": "example.com/worker:2"})], ["patch ConfigMap m1-plan", "status Rebalancing"],
              ["Warning Blocked"], next=20,
              then=condition("Progressing", "Blocked", "the pool has no room for a new group beside the serving one "
                             "(a needs 2 GPUs, 0 free); replacing it in place takes the model down (no other group "
                             "serves): spec.rollout.maxUnavailable 1 allows that")),
        Round([edit(rollout={"maxUnavailable": 1})], ["patch ConfigMap m1-plan", *group_deletes(0, "a"),
                                                      "status Rebalancing"], ["Normal DeletingGroup"], next=20),
        Round([kubelet()], [*group_writes(0, "b"), "status Loading"], ["Normal CreatingGroup"], next=20),
        Round([kubelet()], ["status Ready"], ready(), next=20),
    ]),
    # Issue 26: a new revision is placed on the nodes with room, beside the serving group.
    "a new revision surges onto a free node while the old group serves": ([gpu_node(n) for n in "ab"], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01, then=nodes_of_group(0, "a", {"a"})),
        READY,
        Round([edit(model={"maxModelLen": 200})], ["patch ConfigMap m1-plan", *group_writes(0, "b"),
                                                   "status Rebalancing"],
              ["Normal Replanned", "Normal CreatingGroup"], next=20, then=nodes_of_group(0, "b", {"b"})),
        Round([kubelet(ready=False)], ["status Rebalancing"], next=5, then=nodes_of_group(0, "a", {"a"})),
        Round([kubelet()], [*group_deletes(0, "a"), "status Rebalancing"], ["Normal DeletingGroup", *ready()], next=20,
              then=condition("Available", "MinimumGroupsReady")),
        Round([kubelet()], ["status Ready"], next=20),
    ]),
    # A full pool (no node spare): one group at a time goes down and comes back while the other serves.
    "a full pool replaces one group at a time while the other serves": ([gpu_node(n) for n in "ab"], [
        Round([create(replicas=2, rollout={"maxSurge": 1, "maxUnavailable": 1})],
              [*MODEL_WRITES, *group_writes(0, "a"), *group_writes(1, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup", "Normal CreatingGroup"], next=30.01),
        READY2,
        Round([edit(model={"maxModelLen": 200})], ["patch ConfigMap m1-plan", *group_deletes(0, "a"),
                                                   "status Rebalancing"],
              ["Normal Replanned", "Normal DeletingGroup"], next=20,
              then=condition("Progressing", "Rebalancing", "group 1 waits its turn")),
        Round([kubelet()], [*group_writes(0, "b"), "status Rebalancing"], ["Normal CreatingGroup"], next=20,
              then=both(nodes_of_group(0, "b", {"a"}), condition("Available", "MinimumGroupsReady", "1 of 2 groups"))),
        Round([kubelet()], [*group_deletes(1, "a"), "status Rebalancing"], ["Normal DeletingGroup", *ready()], next=20),
        Round([kubelet()], [*group_writes(1, "b"), "status Loading"], ["Normal CreatingGroup"], next=20,
              then=both(nodes_of_group(1, "b", {"b"}), condition("Available", "MinimumGroupsReady", "1 of 2 groups"))),
        Round([kubelet()], ["status Ready"], ready(), next=20),
    ]),
    # A spec the planner refuses: the groups run on as the accepted spec made them (same pods, and
    # a recreated group is that revision again); Degraded says why. Put back, it rolls out.
    "a spec the planner refuses changes nothing": ([gpu_node(n) for n in "ab"], [
        Round([create()], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        READY,
        Round([edit(worker={"image": "example.com/worker:2"}, placement={"memoryHeadroom": 0.999})],
              ["status Degraded"], ["Warning InsufficientCapacity"], next=20,
              then=both(condition("Degraded", "InsufficientCapacity", "does not fit"),
                        condition("Available", "MinimumGroupsReady", "1 of 1 groups ready"))),
        Round([later(20)], [], next=10.01),
        Round([rank_fails(0, 1)], ["delete Pod m1-0-a-0", "delete Pod m1-0-a-1", "status Degraded"],
              ["Warning RecreatingGroup"], next=10.01),
        Round([kubelet()], [*RECREATE,
                            "status Degraded"], ["Normal CreatingGroup"], next=10.01),
        Round([kubelet()], ["status Degraded"], ready(), next=10.01),
        # The headroom back: the new image rolls out, beside the serving group.
        Round([edit(placement={"memoryHeadroom": 0.1})], ["patch ConfigMap m1-plan", *group_writes(0, "b"),
                                                          "status Rebalancing"],
              ["Normal Rebalancing", "Normal CreatingGroup"], next=10.01, then=nodes_of_group(0, "b", {"b"})),
    ]),
    # A node goes and the rank beside it fails for want of its peer: lost, not recreated there.
    "a lost node is not taken for failed ranks": ([gpu_node(n, gpus=1) for n in "abc"], [
        Round([create(tensor=1, pipeline=2)], [*MODEL_WRITES, *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01, then=nodes_of_group(0, "a", {"a", "b"})),
        READY,
        Round([later(31)], [], next=20),
        Round([node_gone("a"), rank_fails(0, 1)], ["status Degraded"], ["Warning NodeLost"], next=20),
        Round([later(31)], ["patch ConfigMap m1-plan", *group_writes(0, "b"), "delete Secret m1-0-a",
                            "delete Pod m1-0-a-0 (grace 0)", "delete Pod m1-0-a-1", "delete Service m1-0-a",
                            "delete ConfigMap m1-0-a", "status Rebalancing"],
              ["Normal Rebalancing", "Normal CreatingGroup", "Normal DeletingGroup"], next=60,
              then=nodes_of_group(0, "b", {"b", "c"})),
    ]),
    "a lost node's group moves once the pool has settled": ([gpu_node(n) for n in "abc"], [
        Round([create(replicas=2)], [*MODEL_WRITES, *group_writes(0, "a"), *group_writes(1, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup", "Normal CreatingGroup"], next=30.01),
        READY2,
        Round([later(31)], [], next=20),
        Round([node_gone("a")], ["status Degraded"], ["Warning NodeLost"], next=20),
        Round([later(10)], [], next=10),
        # Its pods wait for a kubelet that is gone (the pod GC would take them 40 s later): they
        # are deleted with grace 0, so the replacement is all there is of group 0 once it serves.
        Round([later(21)], ["patch ConfigMap m1-plan", *group_writes(0, "b"), *group_deletes(0, "a", grace=0),
                            "status Rebalancing"],
              ["Normal Rebalancing", "Normal CreatingGroup", "Normal DeletingGroup"], next=20),
        Round([kubelet()], ["status Ready"], ready(), next=20),
    ]),
    "scaling during a rollout": ([gpu_node(n, gpus=4) for n in "ab"], [
        Round([create(replicas=2)], [*MODEL_WRITES, *group_writes(0, "a"), *group_writes(1, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup", "Normal CreatingGroup"], next=30.01),
        READY2,
        # A new image: group 0's replacement surges (maxSurge 1), group 1's waits for it.
        Round([edit(worker={"image": "example.com/worker:2"})], ["patch ConfigMap m1-plan", *group_writes(0, "b"),
                                                                "status Rebalancing"],
              ["Normal CreatingGroup"], next=20,
              then=condition("Progressing", "Rebalancing", "replacing group 0, 1; group 1 waits its turn: 1 of "
                             "maxSurge=1 replacement groups are starting")),
        # Scaled up meanwhile: the new group comes at the wanted revision at once.
        Round([edit(replicas=3)], ["patch ConfigMap m1-plan", "patch ConfigMap m1-0-b", *group_writes(2, "a"),
                                   "status Rebalancing"], ["Normal Scaled", "Normal CreatingGroup"], next=5),
        # Group 0's replacement is ready: its old group goes, and group 1's replacement starts.
        Round([kubelet()], [*group_writes(1, "b"), *group_deletes(0, "a"), "status Rebalancing"],
              ["Normal CreatingGroup", "Normal DeletingGroup", *ready(2)], next=20),
        Round([kubelet()], [*group_deletes(1, "a"), "status Rebalancing"], ["Normal DeletingGroup", *ready()], next=20),
        # Scaled down while group 1's old pods still terminate: only whole, live groups are deleted.
        Round([edit(replicas=1)], ["patch ConfigMap m1-plan", "patch ConfigMap m1-0-b", *group_deletes(1, "b"),
                                   *group_deletes(2, "a"), "status Loading"],
              ["Normal Scaled", "Normal DeletingGroup", "Normal DeletingGroup"], next=5),
        Round([kubelet()], ["status Ready"], next=20),
    ]),
    "a failed request fails the reconcile, and the next does what is missing": ([gpu_node("a")], [
        Round([request_fails("create", "Pod"), create()],
              [*MODEL_WRITES, *group_writes(0, "a")[:4], "create Pod m1-0-a-0 (500)", "status Pending"],
              ["Warning ReconcileError"], next=5, then=condition("Degraded", "ReconcileError", "(500)")),
        Round([], [*RECREATE, "status Loading"],
              ["Normal CreatingGroup"], next=30.01, then=condition("Degraded", "AsExpected")),
        READY,
        # A status write whose answer is lost (it landed): the failure report after it is written whole.
        Round([request_fails("patch_status", landed=True), edit(replicas=0)],
              ["patch ConfigMap m1-plan", *group_deletes(0, "a"), "status Loading (504)", "status Ready"],
              ["Normal Scaled", "Normal DeletingGroup", "Warning ReconcileError"], next=5),
        Round([kubelet()], ["status Ready"], next=20, then=condition("Available", "ScaledToZero")),
        Round([later(20)], [], next=10.01),  # no leader to poll: the settle window is next
    ]),
    "a profiling pod reads what the operator cannot": ([gpu_node("a")], [
        Round([create()], ["create Pod m1-profile", "status Planning"], next=5),
        Round([], [], next=5),
        Round([profiler_done], ["create ConfigMap m1-profile", "delete Pod m1-profile", *MODEL_WRITES,
                                *group_writes(0, "a"), "status Loading"],
              ["Normal Planned", "Normal CreatingGroup"], next=30.01),
        READY,
        # Two replicas, room for one: it runs, and the Degraded condition says what the other lacks.
        Round([edit(replicas=2)], ["patch ConfigMap m1-plan", "patch ConfigMap m1-0-a", "status Degraded"],
              ["Normal Scaled", "Warning InsufficientCapacity"], next=20,
              then=condition("Degraded", "InsufficientCapacity", "2 replicas wanted, 1 fits")),
    ]),
}
PROFILING = {"a profiling pod reads what the operator cannot"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(tmp_path, name):
    nodes, rounds = SCENARIOS[name]
    settings = dataclasses.replace(SETTINGS, host_path_prefix=None) if name in PROFILING else SETTINGS
    sim = Sim(tmp_path, copy.deepcopy(nodes), settings)
    for i, round_ in enumerate(rounds):
        for act in round_.do:
            act(sim)
        writes, events, wait = sim.reconcile()
        assert (writes, events, wait) == (round_.writes, round_.events, pytest.approx(round_.next)), f"round {i}"
        round_.then(sim)
        # What the server holds is what the loop believes it wrote, lost answers or not (merged as
        # the server merges it: a null removes the field).
        assert sim.store.get(MODEL, "m1")["status"] == merge_patch({}, sim.loop.memory.status), f"round {i}"
