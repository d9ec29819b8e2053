"""Rollout decisions: which groups to create, keep, recreate or delete for an observed state."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from shard_operator.api import Rollout, load_sharded_models
from shard_operator.planning.inventory import inventory_from_nodes
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.replan import choose_plan, make_room
from shard_operator.reconcile.rollout import (
    ObservedGroup,
    RankState,
    Want,
    decide,
    deletion_grace,
    group_state,
    observe_groups,
    rank_state,
)
from tests.support.cluster import gpu_node


def pod(name="m-0-r1-0", rank=0, phase="Running", ready=True, node="a", **extra):
    status = {"phase": phase, "podIP": "10.0.0.5",
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
              "containerStatuses": extra.pop("containerStatuses", [])}
    meta = {"name": name, "labels": {"sharding.dev/group": "0", "sharding.dev/revision": "r1",
                                     "sharding.dev/rank": str(rank), "sharding.dev/plan": "h1"},
            "annotations": {"sharding.dev/node": node}}
    meta.update(extra.pop("metadata", {}))
    return {"metadata": meta, "spec": {"containers": [{"env": [{"name": "WORLD_SIZE", "value": "2"}]}]},
            "status": status}


@pytest.mark.parametrize("p,healthy,state,message", [
    (pod(), None, "Ready", ""),
    (pod(ready=False), None, "Running", ""),
    (pod(phase="Pending", ready=False), None, "Pending", ""),
    (pod(phase="Failed", containerStatuses=[{"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]),
     None, "Failed", "Failed: OOMKilled (exit code 137)"),
    (pod(phase="Failed", containerStatuses=[{"state": {"terminated": {
        "reason": "Error", "exitCode": 1,
        "message": "loading slices\nshard_worker: model.safetensors: tensor lm_head.weight: truncated file\n"}}}]),
     None, "Failed",
     "Failed: Error (exit code 1): shard_worker: model.safetensors: tensor lm_head.weight: truncated file"),
    (pod(phase="Succeeded"), None, "Failed", "Succeeded"),
    (pod(containerStatuses=[{"restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]),
     None, "Failed", "restarted 2 times (CrashLoopBackOff)"),
    (pod(metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}), None, "Terminating", ""),
    (pod(node="gone"), {"a"}, "Lost", "node gone is gone or NotReady"),
    (pod(node="a"), {"a"}, "Ready", ""),
    (pod(phase="Pending", ready=False, containerStatuses=[{"state": {"waiting": {"reason": "ImagePullBackOff",
                                                                                "message": "no such image"}}}]),
     None, "Pending", "ImagePullBackOff: no such image"),
])
def test_rank_state(p, healthy, state, message):
    rs = rank_state(p, healthy)
    assert rs.state == state
    assert message in rs.message


def bound(node, **extra):
    p = pod(node=node, **extra)
    p["spec"]["nodeName"] = node
    return p


@pytest.mark.parametrize("p,state,message,grace", [
    (bound("a"), "Ready", "", None),
    (bound("gone"), "Lost", "node gone no longer exists", 0),
    # Deleted already, but no kubelet will ever confirm it: lost, and deleted again with grace 0.
    (bound("gone", metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}), "Lost", "no longer exists", 0),
    (bound("a", metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}), "Terminating", "", None),
    (pod(node="gone", phase="Pending", ready=False), "Pending", "", None),
    # pinned by the plan, never bound: no grace to cut short
])
def test_pods_bound_to_a_node_that_no_longer_exists_are_lost_and_deleted_at_once(p, state, message, grace):
    rs = rank_state(p, healthy_nodes={"a"} if state != "Pending" else None, existing_nodes={"a"})
    assert (rs.state, deletion_grace(p, {"a"})) == (state, grace)
    assert message in rs.message


def group(states, replica=0, revision="r1", world=2, started=True):
    return ObservedGroup(replica=replica, revision=revision, plan_hash="h", world_size=world, ranks=tuple(
        RankState(rank=i, pod=f"p{replica}{revision}{i}", state=s, started=started and s != "Pending")
        for i, s in enumerate(states) if s is not None))


@pytest.mark.parametrize("g,state", [
    (None, "Empty"),
    (group([]), "Empty"),
    (group(["Ready", "Ready"]), "Ready"),
    (group(["Ready", "Running"]), "Starting"),
    (group(["Pending", None], started=False), "Starting"),  # still being created
    (group(["Ready", None]), "Failed"),  # a rank was deleted while the group ran
    (group(["Ready", "Failed"]), "Failed"),
    (group(["Ready", "Lost"]), "Lost"),
    (group(["Lost", "Failed"]), "Lost"),  # the peer failed because the node went
    (group(["Terminating", "Failed"]), "Terminating"),
])
def test_group_state(g, state):
    assert group_state(g)[0] == state


def test_observe_groups_from_pods_and_leftover_services():
    pods = [pod("m-0-r1-0", 0), pod("m-0-r1-1", 1, ready=False)]
    leftover = {"metadata": {"name": "m-1-r9", "labels": {"sharding.dev/group": "1", "sharding.dev/revision": "r9",
                                                          "sharding.dev/plan": "h9"}}}
    groups = observe_groups(pods, [leftover])
    assert [(g.replica, g.revision, g.world_size, len(g.ranks)) for g in groups] == [(0, "r1", 2, 2), (1, "r9", 0, 0)]
    assert [group_state(g)[0] for g in groups] == ["Starting", "Empty"]


@pytest.mark.parametrize("second, state", [(dict(ready=True), "Ready"), (dict(ready=False), "Starting"),
                                           (dict(phase="Failed"), "Failed"), (None, "Failed")])
def test_a_pod_of_a_tensor_parallel_group_counts_as_each_of_its_ranks(second, state):
    """World 4 in two pods of two ranks (stage 0: ranks 0-1, stage 1: ranks 2-3)."""
    def group_pod(name: str, first: int, **kwargs) -> dict:
        p = pod(name, first, **kwargs)
        p["metadata"]["labels"]["sharding.dev/ranks"] = "2"
        p["spec"]["containers"][0]["env"] = [{"name": "WORLD_SIZE", "value": "4"}]
        return p
    pods = [group_pod("m-0-r1-0", 0)] + ([group_pod("m-0-r1-2", 2, **second)] if second is not None else [])
    (g,) = observe_groups(pods)
    assert [(r.rank, r.pod) for r in g.ranks] == [(0, "m-0-r1-0"), (1, "m-0-r1-0"), (2, "m-0-r1-2"),
                                                  (3, "m-0-r1-2")][:len(pods) * 2]
    assert group_state(g)[0] == state


SURGE = Rollout(max_surge=1, max_unavailable=0)


def test_new_groups_are_created():
    d = decide([Want(0, "a"), Want(1, "b")], [], SURGE, {}, 3)
    assert d.keep == {(0, "a"): True, (1, "b"): True} and not d.delete


def test_steady_state_changes_nothing():
    d = decide([Want(0, "a"), Want(1, "b")], [group(["Ready"] * 2, 0, "a"), group(["Ready"] * 2, 1, "b")], SURGE, {}, 3)
    assert d.keep == {(0, "a"): False, (1, "b"): False}
    assert not d.delete and not d.restart and not d.waiting


def test_scaling_down_deletes_whole_groups_only():
    observed = [group(["Ready"] * 2, r, "x") for r in range(3)]
    d = decide([Want(0, "x"), Want(1, "x")], observed, SURGE, {}, 3)
    assert d.delete == {(2, "x"): "no longer in the plan"}
    assert d.keep == {(0, "x"): False, (1, "x"): False}


def test_surge_then_switch_then_delete_the_old_group():
    old = group(["Ready"] * 2, 0, "old")
    d = decide([Want(0, "new")], [old], SURGE, {}, 3)
    assert d.keep == {(0, "new"): True} and not d.delete  # the new group starts beside the old
    d = decide([Want(0, "new")], [old, group(["Ready", "Running"], 0, "new")], SURGE, {}, 3)
    assert not d.delete  # the old one serves until the new one is ready
    d = decide([Want(0, "new")], [old, group(["Ready"] * 2, 0, "new")], SURGE, {}, 3)
    assert list(d.delete) == [(0, "old")]


def test_max_surge_limits_concurrent_replacements():
    observed = [group(["Ready"] * 2, r, "old") for r in range(3)]
    d = decide([Want(r, "new") for r in range(3)], observed, SURGE, {}, 3)
    assert [k for k, create in d.keep.items() if create] == [(0, "new")]
    observed.append(group(["Running"] * 2, 0, "new"))
    d = decide([Want(r, "new") for r in range(3)], observed, SURGE, {}, 3)
    assert not [k for k, create in d.keep.items() if create and k != (0, "new")]
    assert d.queued and "1 of maxSurge=1" in d.queued[0] and not d.waiting  # its turn comes by itself


def test_max_unavailable_replaces_in_place():
    old = group(["Ready"] * 2, 0, "old")
    d = decide([Want(0, "new")], [old], Rollout(max_surge=0, max_unavailable=1), {}, 3)
    assert list(d.delete) == [(0, "old")] and not any(d.keep.values())
    d = decide([Want(0, "new")], [], Rollout(max_surge=0, max_unavailable=1), {}, 3)
    assert d.keep == {(0, "new"): True}


def test_no_room_to_surge_is_said_not_forced():
    old = group(["Ready"] * 2, 0, "old")
    d = decide([Want(0, "new", {"a": 2})], [old], SURGE, {}, 3, free_gpus={"a": 0, "b": 4})
    assert not d.delete and not any(d.keep.values())
    assert "no room for a new group beside the serving one (a needs 2 GPUs, 0 free)" in d.waiting[0]
    assert "takes the model down (no other group serves)" in d.waiting[0]
    d = decide([Want(0, "new", {"b": 2})], [old], SURGE, {}, 3, free_gpus={"a": 0, "b": 4})
    assert d.keep == {(0, "new"): True}
    d = decide([Want(0, "new")], [old], Rollout(max_surge=0, max_unavailable=0), {}, 3)
    assert "both 0" in d.waiting[0]


def test_a_full_pool_replaces_one_group_at_a_time_while_the_others_serve():
    """Two groups, each on the node the other does not use: none can surge."""
    observed = [group(["Ready"] * 2, 0, "old"), group(["Ready"] * 2, 1, "old")]
    wants = [Want(0, "new", {"a": 2}), Want(1, "new", {"b": 2})]
    d = decide(wants, observed, SURGE, {}, 3, free_gpus={"a": 0, "b": 0})
    assert not d.delete and not d.queued  # maxUnavailable 0: nobody may go down
    assert "takes it down while 1 other group serves: spec.rollout.maxUnavailable 1 allows that" in d.waiting[0]
    one_down = Rollout(max_surge=1, max_unavailable=1)
    d = decide(wants, observed, one_down, {}, 3, free_gpus={"a": 0, "b": 0})
    assert list(d.delete) == [(0, "old")] and not d.waiting  # group 1 serves meanwhile ...
    assert "1 of maxUnavailable=1 groups are down already" in d.queued[0]  # ... and waits its turn
    d = decide(wants, [observed[1], group(["Ready", "Running"], 0, "new")], one_down, {}, 3, free_gpus={"a": 0, "b": 0})
    assert not d.delete and d.queued
    d = decide(wants, [observed[1], group(["Ready"] * 2, 0, "new")], one_down, {}, 3, free_gpus={"a": 0, "b": 0})
    assert list(d.delete) == [(1, "old")]  # group 0 serves again: group 1's turn


def test_a_failed_group_whose_node_left_is_lost_not_recreated_there():
    """Its ranks on the gone node are not even listed; the peers elsewhere failed for want of them."""
    peers_failed = group(["Failed", None], 0, "a")
    d = decide([Want(0, "a", {"a": 1, "b": 1})], [peers_failed], SURGE, {}, 3, healthy_nodes={"a"})
    assert not d.restart and d.keep == {(0, "a"): False} and d.lost == {0}
    d = decide([Want(0, "a", {"a": 1, "b": 1})], [peers_failed], SURGE, {}, 3, healthy_nodes={"a", "b"})
    assert d.restart == [(0, "a")]


def test_lost_is_decided_before_failed():
    """A rank on a NotReady node that failed with it, and its peer that failed for want of it: lost."""
    failed = pod(phase="Failed", node="b")
    assert rank_state(failed, healthy_nodes={"a"}).state == "Lost"
    assert rank_state(failed, healthy_nodes={"a", "b"}).state == "Failed"
    assert group_state(group(["Failed", "Lost"]))[0] == "Lost"


def test_failed_group_is_recreated_within_budget_then_given_up():
    failed = group(["Ready", "Failed"], 0, "a")
    d = decide([Want(0, "a")], [failed], SURGE, {(0, "a"): 1}, 3)
    assert d.restart == [(0, "a")] and not d.exhausted
    d = decide([Want(0, "a")], [failed], SURGE, {(0, "a"): 3}, 3)
    assert d.restart == [] and "over the restart budget of 3" in d.exhausted[0]


def test_a_rank_that_exited_for_good_gives_its_group_up_at_once():
    config_error = pod(phase="Failed", containerStatuses=[{"state": {"terminated": {
        "reason": "Error", "exitCode": 78, "message": "shard_worker: model.safetensors: tensor x: truncated"}}}])
    assert rank_state(config_error).permanent and not rank_state(pod(phase="Failed")).permanent
    [failed] = observe_groups([pod(name="m-0-r1-0"), {**config_error, "metadata": {
        **config_error["metadata"], "name": "m-0-r1-1", "labels": {**config_error["metadata"]["labels"],
                                                                   "sharding.dev/rank": "1"}}}])
    d = decide([Want(0, "r1")], [failed], SURGE, {}, 3)
    assert d.restart == [] and d.unrecoverable == {0}
    assert "restart would repeat" in d.exhausted[0] and "rank 1 (m-0-r1-1)" in d.exhausted[0]
    assert "truncated" in d.exhausted[0]


def test_lost_groups_wait_for_a_new_plan_instead_of_restarting():
    d = decide([Want(0, "a")], [group(["Ready", "Lost"], 0, "a")], SURGE, {}, 3)
    assert not d.restart and d.keep == {(0, "a"): False}


def test_interrupted_creation_is_completed():
    d = decide([Want(0, "a")], [group(["Pending", None], 0, "a", started=False)], SURGE, {}, 3)
    assert d.keep == {(0, "a"): True} and not d.restart


def test_broken_old_groups_go_at_once_and_terminating_ones_are_left_alone():
    d = decide([Want(0, "new")], [group(["Failed", "Ready"], 0, "old")], SURGE, {}, 3)
    assert list(d.delete) == [(0, "old")] and d.keep == {(0, "new"): True}
    d = decide([Want(0, "new")], [group(["Terminating", "Ready"], 0, "old")], SURGE, {}, 3)
    assert not d.delete and d.keep == {(0, "new"): True}


def test_the_70b_example_rolls_on_exactly_two_nodes_of_eight_gpus():
    """examples/llama-70b.yaml (2 replicas of tensor=8) on two 8 x H100 nodes and nothing else: a new
    image replaces group 0 in place while group 1 serves, then group 1 while group 0 serves."""
    examples = Path(__file__).resolve().parents[3] / "examples"
    (model,) = load_sharded_models(examples / "llama-70b.yaml")
    profile = profile_from_config(json.loads((examples / "models" / "llama-3-70b" / "config.json").read_text()))
    nodes = [gpu_node(n, gpus=8, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3",
                      labels={"sharding.dev/pool": "inference"}) for n in ("h100-a", "h100-b")]
    inventory = inventory_from_nodes(nodes, model.spec.placement)
    serving = choose_plan(None, profile, model.spec, inventory).plan
    assert (serving.tensor_parallel, len(serving.groups)) == (8, 2)
    held = {r: dict(Counter(x.node for x in serving.group(r))) for r in (0, 1)}
    assert sorted(map(str, held.values())) == ["{'h100-a': 8}", "{'h100-b': 8}"]

    # The new image: nothing is free, so each replacement is planned where its own group runs.
    room = make_room(serving, profile, model.spec, inventory, {"h100-a": 0, "h100-b": 0}, held, set())
    wants = [Want(r, "new", dict(Counter(x.node for x in room.plan.group(r)))) for r in (0, 1)]
    assert [w.gpus for w in wants] == [held[0], held[1]]
    old = [group(["Ready"] * 8, r, "old", world=8) for r in (0, 1)]
    free = {"h100-a": 0, "h100-b": 0}
    d = decide(wants, old, model.spec.rollout, {}, 3, free)
    assert list(d.delete) == [(0, "old")] and not d.waiting and d.queued  # group 1 serves meanwhile
    d = decide(wants, [old[1], group(["Ready"] * 8, 0, "new", world=8)], model.spec.rollout, {}, 3, free)
    assert list(d.delete) == [(1, "old")]  # group 0 serves again: group 1's turn
    d = decide(wants, [group(["Ready"] * 8, r, "new", world=8) for r in (0, 1)], model.spec.rollout, {}, 3, free)
    assert not d.delete and not d.waiting and not d.queued
