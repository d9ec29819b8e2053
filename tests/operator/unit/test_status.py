"""The status as a function of what the reconcile saw: phases, conditions, shards, stability."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shard_contract.wire import Measured
from shard_operator.reconcile.events import event_body
from shard_operator.reconcile.rollout import Decision, ObservedGroup, RankState, Want
from shard_operator.reconcile.status import Observation, Problem, build_status, newly_ready, status_patch
from tests.operator.conftest import make_plan, make_spec

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
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready", "Failed"])],
     {"decision": Decision(restart=[(1, "new")])},
     "Degraded", ("False", "TooFewGroupsReady"), ("True", "Recreating"), ("True", "GroupFailed")),
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready", "Lost"])], {}, "Degraded",
     ("False", "TooFewGroupsReady"), ("True", "Creating"), ("True", "NodeLost")),
    # failed ranks of a group planned onto a node that is gone (the decision says so): lost too
    ([group(0, "new", ["Ready"] * 2), group(1, "new", ["Failed"])], {"decision": Decision(lost={1})}, "Degraded",
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


@pytest.mark.parametrize("valid_spec, reason", [
    (False, "InvalidSpec"),          # spec.rollout.maxSurge: -1, an unknown dtype, ...
    (True, "InvalidParallelism"),    # tensor: 5 for 12 heads
    (True, "ModelNotFound"),
    (True, "InvalidModel"),
    (True, "NoDevices"),
    (True, "InsufficientCapacity"),  # not even one group fits, and none ran before
])
def test_a_model_that_cannot_be_planned_says_why_it_is_not_available(valid_spec, reason):
    problem = Problem(reason, "what is wrong")
    obs = Observation(name="m", generation=1, spec=make_spec(replicas=2) if valid_spec else None, problem=problem)
    status = build_status(obs, None, NOW)
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    assert (available["status"], available["reason"], available["message"]) == \
        ("False", reason, "no group ready; the Degraded condition says why")
    assert status["phase"] == "Failed" and conditions(status)["Degraded"] == ("True", reason)
    # The message is written once, in Degraded (Progressing and Available point to it).
    assert [c["type"] for c in status["conditions"] if "what is wrong" in c["message"]] == ["Degraded"]
    # Groups of an earlier spec that still serve are counted, and said to be there.
    serving = Observation(name="m", generation=2, spec=obs.spec, problem=problem,
                          groups=[group(0, "old", ["Ready"] * 2)])
    status = build_status(serving, None, NOW)
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    assert (available["status"], available["reason"]) == ("True", reason)
    assert available["message"] == "1 group of an earlier plan still ready; the Degraded condition says why"
    assert status["phase"] == "Degraded" and status["readyReplicas"] == 1


def test_scaled_to_zero_is_said_only_of_a_valid_spec():
    status = build_status(observation(replicas=0), None, NOW)
    assert conditions(status)["Available"] == ("False", "ScaledToZero")


def test_replicas_that_do_not_all_fit_run_the_groups_that_do_and_say_what_is_missing():
    short = make_plan("a:24GiB*2", replicas=2)  # one group fits
    obs = Observation(name="m", generation=1, spec=make_spec(replicas=2), plan=short, wants=[Want(0, "new")],
                      groups=[group(0, "new", ["Ready"] * 2)], group_plans={(0, "new"): short},
                      problem=Problem("InsufficientCapacity", "2 replicas wanted, 1 fits: ...", fatal=False))
    status = build_status(obs, None, NOW)
    assert (status["phase"], status["replicas"], status["readyReplicas"]) == ("Degraded", 1, 1)
    assert conditions(status) == {"Available": ("False", "TooFewGroupsReady"),
                                  "Progressing": ("False", "InsufficientCapacity"),
                                  "Degraded": ("True", "InsufficientCapacity")}
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    assert available["message"] == "1 of 2 groups ready, 2 needed; only 1 fits the pool"


def test_capacity_loss_with_groups_serving_is_degraded_not_failed():
    obs = observation([group(0, "new", ["Ready"] * 2)],
                      problem=Problem("InsufficientCapacity", "needs 2 GPUs", fatal=False))
    status = build_status(obs, None, NOW)
    assert status["phase"] == "Degraded" and conditions(status)["Degraded"] == ("True", "InsufficientCapacity")
    assert conditions(status)["Available"] == ("False", "TooFewGroupsReady")  # 1 of 2, maxUnavailable 0
    assert status["readyReplicas"] == 1


def test_shards_and_groups_report_plan_and_pods():
    obs = observation([group(0, "new", ["Ready", "Running"])], replicas=1,
                      measured={("m-0-new-0", 0): Measured(resident=123456789)}, restarts={(0, "new"): 1})
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
    # the KV cache's capacity in tokens, per group (a GPU's: 0.9 of what the plan leaves free)
    assert status["plan"]["kvCacheTokens"] == plan.kv_cache_tokens >= plan.max_model_len
    assert {s["kvCacheTokens"] for s in status["shards"]} == {plan.kv_cache_tokens}
    assert status["plan"]["reason"] == plan.reason  # why this layout (and a chosen maxBatchSize)
    assert status["selector"] == "sharding.dev/model=m,sharding.dev/role=leader"


def test_shards_say_how_their_weights_are_stored():
    obs = observation([group(0, "new", ["Ready"] * 2)], replicas=1)
    assert {s["quantization"] for s in build_status(obs, None, NOW)["shards"]} == {"none"}
    int8 = obs.plan.model_copy(update={"quantization": "int8"})
    status = build_status(replace(obs, plan=int8, group_plans={key: int8 for key in obs.group_plans}), None, NOW)
    assert {s["quantization"] for s in status["shards"]} == {"int8"} and status["plan"]["quantization"] == "int8"


def test_streaming_shards_say_what_they_stream_and_their_counters_as_they_grow():
    plan = make_plan("a:24GiB*2", replicas=1, placement={"offload": {"policy": "always"}})
    obs = Observation(name="m", generation=3, spec=make_spec(replicas=1), plan=plan, wants=[Want(0, "new")],
                      groups=[group(0, "new", ["Ready"] * 2)], group_plans={(0, "new"): plan},
                      measured={("m-0-new-0", 0): Measured(resident=10, streamed_bytes=1000, stream_seconds=2.0,
                                                      stall_seconds=0.1, device_stall_seconds=0.5)})
    first = build_status(obs, None, NOW)
    rank0, rank1 = first["shards"]
    planned = plan.rank_plan(0, 0).offload
    assert rank0["offload"] == {"layers": planned.layers, "tier": "host", "bytesPerStep": planned.streamed_bytes,
                                "stepSeconds": round(max(planned.compute_seconds, planned.stream_seconds), 6),
                                "streamedBytes": 1000, "streamSeconds": 2.0, "stallSeconds": 0.1,
                                "deviceStallSeconds": 0.5}
    assert "streamedBytes" not in rank1["offload"] and rank1["offload"]["layers"] == planned.layers
    # counters that grew by 10% or less are not written again; more, they are
    grown = replace(obs, measured={("m-0-new-0", 0): Measured(resident=10, streamed_bytes=1100, stream_seconds=2.2,
                                                                      stall_seconds=0.11)})
    assert status_patch(first, build_status(grown, first, LATER)) is None
    more = replace(obs, measured={("m-0-new-0", 0): Measured(resident=10, streamed_bytes=1101, stream_seconds=2.2,
                                                                     stall_seconds=0.11)})
    moved = build_status(more, first, LATER)
    assert moved["shards"][0]["offload"]["streamedBytes"] == 1101
    assert moved["shards"][0]["offload"]["streamSeconds"] == 2.0  # each counter on its own


def test_a_steady_world_writes_nothing():
    obs = observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready"] * 2)],
                      measured={("m-0-new-0", 0): Measured(resident=1000)})
    first = build_status(obs, None, NOW)
    assert status_patch(None, first) is not None
    again = build_status(observation(obs.groups, measured={("m-0-new-0", 0): Measured(resident=1005)}), first, LATER)
    assert status_patch(first, again) is None  # same state; memory within 1%; times kept
    moved = build_status(observation(obs.groups, measured={("m-0-new-0", 0): Measured(resident=2000)}), first, LATER)
    assert status_patch(first, moved) == {"shards": moved["shards"]}


def test_transition_times_change_only_with_the_status():
    ready = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Ready"] * 2)]), None, NOW)
    broken = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Failed"] * 2)]), ready, LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in broken["conditions"]}
    assert times == {"Available": LATER, "Progressing": LATER, "Degraded": LATER}
    still = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Failed"] * 2)]), broken,
                         "2026-01-01T00:09:00Z")
    assert {c["type"]: c["lastTransitionTime"] for c in still["conditions"]} == times


def test_the_printer_columns_fields_ready_of_wanted_the_url_and_the_reason():
    ready = build_status(observation([group(0, "new", ["Ready"] * 2), group(1, "new", ["Running"] * 2)]), None, NOW)
    assert (ready["ready"], ready["url"], ready["reason"]) == ("1/2", "http://m.default.svc:8000", "")
    failed = build_status(Observation(name="m", generation=1, spec=make_spec(replicas=2), namespace="team",
                                      problem=Problem("InvalidParallelism", "tensor=3 ...")), None, NOW)
    assert (failed["phase"], failed["ready"], failed["reason"]) == ("Failed", "0/2", "InvalidParallelism")
    assert failed["url"] == "http://m.team.svc:8000"


def test_a_group_that_turns_ready_is_named_once():
    starting = build_status(observation([group(0, "new", ["Ready", "Running"])], replicas=1), None, NOW)
    ready = build_status(observation([group(0, "new", ["Ready"] * 2)], replicas=1), starting, LATER)
    assert [(g["replica"], g["revision"]) for g in newly_ready(starting, ready)] == [(0, "new")]
    assert newly_ready(ready, ready) == []


def test_events_say_what_the_operator_did_and_who_it_is():
    model = {"metadata": {"name": "m", "namespace": "team", "uid": "u1", "resourceVersion": "7"}}
    event = event_body(model, "Normal", "GroupReady", "group 0 serves", "2026-01-01T00:00:00.123456Z", "op-1")
    assert (event["action"], event["reportingComponent"], event["reportingInstance"]) == (
        "GroupReady", "sharding.dev/shard-operator", "op-1")
    assert event["involvedObject"] == {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "name": "m",
                                       "namespace": "team", "uid": "u1", "resourceVersion": "7"}
    assert (event["eventTime"], event["lastTimestamp"]) == ("2026-01-01T00:00:00.123456Z", "2026-01-01T00:00:00Z")
    invalid = event_body(model, "Warning", "InvalidSpec", "x", "2026-01-01T00:00:00.000000Z", "op-1")
    assert invalid["action"] == "Reconcile"
    for reason in ("Offloading", "FullyResident"):  # they come with the plan that streams (or stops)
        assert event_body(model, "Normal", reason, "x", "2026-01-01T00:00:00.000000Z", "op-1")["action"] == "Plan"
    # kubectl describe prints the message as its Events table's last cell: one line, or the table breaks.
    paragraphs = "needs 0.18 GiB a rank.\n\n  2 x 0.17 GiB usable:\n  offload cannot stream int8 weights\n"
    event = event_body(model, "Warning", "InsufficientCapacity", paragraphs, "2026-01-01T00:00:00.000000Z", "op-1")
    assert event["message"] == "needs 0.18 GiB a rank. 2 x 0.17 GiB usable: offload cannot stream int8 weights"
