"""The status as a function of what the reconcile saw: phases, conditions, shards, stability."""

from __future__ import annotations

import pytest

from shard_operator.rollout import Decision, ObservedGroup, RankState, Want
from shard_operator.status import Observation, Problem, build_status, status_patch

from .conftest import make_plan, make_spec

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def group(replica, revision, states):
    return ObservedGroup(replica=replica, revision=revision, plan_hash="h", world_size=len(states), ranks=tuple(
        RankState(rank=i, pod=f"m-{replica}-{revision}-{i}", state=s, node="a", started=s != "Pending")
        for i, s in enumerate(states)))


def observation(groups=(), replicas=2, wants=None, **kw):
    spec = make_spec(replicas=replicas)
    plan = make_plan("a:24GiB*2,b:24GiB*2", replicas=replicas)
    wants = [Want(r, "new") for r in range(replicas)] if wants is None else wants
    return Observation(name="m", generation=3, spec=spec, plan=plan, wants=wants, groups=list(groups),
                       group_plans={(r, "new"): plan for r in range(replicas)}, **kw)


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize("groups,kw,phase,available,progressing,degraded", [
    ([], {}, "Loading", ("False", "TooFewGroupsReady"), ("True", "Creating"), ("False", "AsExpected")),
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready"] * 2)], {}, "Ready",
     ("True", "MinimumGroupsReady"), ("False", "Complete"), ("False", "AsExpected")),
    ([group(0, "new", ["Ready"] * 2), group(1, "old", ["Ready"] * 2), group(1, "new", ["Running"] * 2)], {},
     "Rebalancing", ("True", "MinimumGroupsReady"), ("True", "Rebalancing"), ("False", "AsExpected")),
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready", "Failed"])], {"decision": Decision(restart=[(1, "new")])},
     "Degraded", ("False", "TooFewGroupsReady"), ("True", "Recreating"), ("True", "GroupFailed")),
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready", "Lost"])], {}, "Degraded",
     ("False", "TooFewGroupsReady"), ("True", "Creating"), ("True", "NodeLost")),
    ([group(0, "new", ["Failed"] * 2), group(1, "new", ["Failed"] * 2)],
     {"decision": Decision(exhausted={0: "group 0 failed 4 times", 1: "group 1 failed 4 times"})},
     "Failed", ("False", "TooFewGroupsReady"), ("False", "Failed"), ("True", "RestartBudgetExhausted")),
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready"] * 2)],
     {"decision": Decision(waiting=["group 1 cannot be replaced yet: no room to surge"])},
     "Ready", ("True", "MinimumGroupsReady"), ("False", "Blocked"), ("False", "AsExpected")),
])
def test_phase_and_conditions(groups, kw, phase, available, progressing, degraded):
    status = build_status(observation(groups, **kw), None, NOW)
    assert status["phase"] == phase
    assert conditions(status) == {"Available": available, "Progressing": progressing, "Degraded": degraded}
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])


def test_invalid_spec_fails_without_a_plan():
    obs = Observation(name="m", generation=1, spec=None, problem=Problem("InvalidSpec", "spec.replicas: bad"))
    status = build_status(obs, None, NOW)
    assert status["phase"] == "Failed" and status["plan"] is None
    assert conditions(status)["Degraded"] == ("True", "InvalidSpec")


def test_capacity_loss_with_groups_serving_is_degraded_not_failed():
    obs = observation([group(0, "new", ["Ready"] * 2)],
                      problem=Problem("InsufficientCapacity", "needs 2 GPUs", fatal=False))
    status = build_status(obs, None, NOW)
    assert status["phase"] == "Degraded" and conditions(status)["Degraded"] == ("True", "InsufficientCapacity")
    assert conditions(status)["Available"] == ("False", "TooFewGroupsReady")  # 1 of 2, maxUnavailable 0
    assert status["readyReplicas"] == 1


def test_shards_and_groups_report_plan_and_pods():
    obs = observation([group(0, "new", ["Ready", "Running"])], replicas=1,
                      measured={("m-0-new-0", 0): 123456789}, restarts={(0, "new"): 1})
    status = build_status(obs, None, NOW)
    plan = obs.plan
    assert [(s["group"], s["rank"], s["pod"], s["state"]) for s in status["shards"]] == [
        (0, 0, "m-0-new-0", "Ready"), (0, 1, "m-0-new-1", "Running")]
    first = status["shards"][0]
    rank = plan.rank_plan(0, 0)
    assert (first["device"], first["layers"], first["predictedBytes"]) == (rank.device, list(rank.layers),
                                                                            rank.predicted_bytes.total)
    assert first["residentBytes"] == 123456789 and "residentBytes" not in status["shards"][1]
    assert status["groups"] == [{"replica": 0, "revision": "new", "planHash": plan.group_hash(0), "state": "Starting",
                                 "readyRanks": 1, "ranks": 2, "restarts": 1, "message": ""}]
    assert status["plan"]["tensorParallel"] == 2 and status["plan"]["hash"] == plan.hash
    assert status["selector"] == "sharding.dev/model=m,sharding.dev/role=leader"


def test_a_steady_world_writes_nothing():
    obs = observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready"] * 2)], measured={("m-0-new-0", 0): 1000})
    first = build_status(obs, None, NOW)
    assert status_patch(None, first) is not None
    again = build_status(observation(obs.groups, measured={("m-0-new-0", 0): 1005}), first, LATER)
    assert status_patch(first, again) is None  # same state; memory within 1%; times kept
    moved = build_status(observation(obs.groups, measured={("m-0-new-0", 0): 2000}), first, LATER)
    assert status_patch(first, moved) == {"shards": moved["shards"]}


def test_transition_times_change_only_with_the_status():
    ready = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready"] * 2)]), None, NOW)
    broken = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Failed"] * 2)]), ready, LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in broken["conditions"]}
    assert times == {"Available": LATER, "Progressing": LATER, "Degraded": LATER}
    still = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Failed"] * 2)]), broken,
                         "2026-01-01T00:09:00Z")
    assert {c["type"]: c["lastTransitionTime"] for c in still["conditions"]} == times
