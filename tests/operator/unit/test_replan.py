"""Plan reuse: what moves (and what does not) when the spec or the node pool changes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shard_operator.planning import PlanError
from shard_operator.planning.inventory import Inventory, parse_devices
from shard_operator.planning.replan import (
    choose_plan,
    critical_path,
    incompatibility,
    make_room,
    without_devices,
    without_held,
)
from tests.operator.conftest import make_spec, tiny_profile
from tests.support.cluster import SEVEN_B

POOL = "a:24GiB*2,b:24GiB*2,c:24GiB*2"


def placements(plan):
    return {g.replica: plan.group_hash(g.replica) for g in plan.groups}


def nodes_of(plan, replica):
    return {r.node for r in plan.group(replica)}


@pytest.fixture
def two_groups(profile):
    spec = make_spec(replicas=2)
    return choose_plan(None, profile, spec, parse_devices(POOL)).plan


def test_first_plan(profile):
    choice = choose_plan(None, profile, make_spec(replicas=2), parse_devices(POOL))
    assert choice.kind == "initial" and choice.plan.replicas == 2 and "tensor=2 x pipeline=1" in choice.message


def test_nothing_changes_while_the_plan_is_valid(profile, two_groups):
    choice = choose_plan(two_groups, profile, make_spec(replicas=2), parse_devices(POOL), reconsider=True)
    assert choice.kind == "unchanged" and choice.plan.hash == two_groups.hash


def test_scaling_up_and_down_leaves_other_groups_in_place(profile, two_groups):
    up = choose_plan(two_groups, profile, make_spec(replicas=3), parse_devices(POOL))
    assert up.kind == "scaled" and up.plan.replicas == 3
    assert {r: h for r, h in placements(up.plan).items() if r < 2} == placements(two_groups)
    assert nodes_of(up.plan, 2) == {"c"}  # the free devices
    down = choose_plan(up.plan, profile, make_spec(replicas=1), parse_devices(POOL))
    assert down.kind == "scaled" and placements(down.plan) == {0: placements(two_groups)[0]}
    zero = choose_plan(two_groups, profile, make_spec(replicas=0), parse_devices(POOL))
    assert zero.plan.replicas == 0 and zero.plan.groups == []


def test_a_lost_node_moves_only_its_group_once_settled(profile, two_groups):
    lost = sorted(nodes_of(two_groups, 0))[0]
    pool = ",".join(p for p in POOL.split(",") if not p.startswith(lost + ":"))
    waiting = choose_plan(two_groups, profile, make_spec(replicas=2), parse_devices(pool), settled=False)
    assert waiting.waiting and waiting.plan.hash == two_groups.hash
    moved = choose_plan(two_groups, profile, make_spec(replicas=2), parse_devices(pool), settled=True)
    assert moved.kind == "repaired" and "group 0 lost its devices" in moved.message
    assert placements(moved.plan)[1] == placements(two_groups)[1]
    assert lost not in nodes_of(moved.plan, 0)


def test_no_room_for_a_lost_group_runs_what_fits_and_says_what_is_missing(profile, two_groups):
    choice = choose_plan(two_groups, profile, make_spec(replicas=2), parse_devices("c:24GiB*2"), settled=True)
    assert choice.kind == "repaired" and [g.replica for g in choice.plan.groups] == [0]
    assert nodes_of(choice.plan, 0) == {"c"} and choice.plan.replicas == 2
    assert choice.shortfall.startswith("2 replicas wanted, 1 fits: tensor=2 x pipeline=1 x 2 replicas needs 4 "
                                       "devices, tensor-parallel ranks on one node; the pool has 2")
    assert "add 2 more devices of 24.0 GiB (gpu) to node c" in choice.shortfall
    with pytest.raises(PlanError) as err:  # not even one
        choose_plan(two_groups, profile, make_spec(replicas=2), parse_devices("c:24GiB*1"), settled=True)
    assert err.value.reason == "InsufficientCapacity"


@pytest.mark.parametrize("history", [(3, 0, 2), (1, 2), (2,), (3, 2), (1, 3, 1, 2)])
def test_replicas_that_do_not_all_fit_run_as_many_as_fit_whatever_the_history(profile, history):
    pool = parse_devices("a:24GiB*2,b:24GiB*1")  # one group of tensor=2
    current = None
    for replicas in history:
        choice = choose_plan(current, profile, make_spec(replicas=replicas), pool)
        current = choice.plan
    assert [g.replica for g in current.groups] == [0] and nodes_of(current, 0) == {"a"}
    assert choice.shortfall == ("2 replicas wanted, 1 fits: tensor=2 x pipeline=1 x 2 replicas needs 4 devices, "
                                "tensor-parallel ranks on one node; the pool has 3 (3 x 24.0 GiB (gpu) on 2 nodes). "
                                "A group takes 2 x 24.0 GiB (gpu); unused now: 1 x 24.0 GiB (gpu) on b. To run them "
                                "all (each checked by planning again): add 1 more node like a (2 x 24.0 GiB (gpu) "
                                "each); or set tensor: auto; or lower spec.replicas to 1.")


def test_a_grown_pool_adds_the_groups_that_did_not_fit_beside_the_running_one(profile):
    short = choose_plan(None, profile, make_spec(replicas=2), parse_devices("a:24GiB*2")).plan
    assert len(short.groups) == 1
    same = choose_plan(short, profile, make_spec(replicas=2), parse_devices("a:24GiB*2"))
    assert same.kind == "unchanged" and same.plan == short and same.shortfall
    grown = choose_plan(short, profile, make_spec(replicas=2), parse_devices("a:24GiB*2,b:24GiB*2"))
    assert grown.kind == "scaled" and "group 1 on b" in grown.message and not grown.shortfall
    assert placements(grown.plan)[0] == placements(short)[0]


def test_a_grown_pool_replaces_groups_only_when_clearly_faster():
    profile = tiny_profile(**SEVEN_B)
    spec = make_spec(replicas=1)
    slow = choose_plan(None, profile, spec, parse_devices("a:24GiB*2@0.3")).plan
    same = choose_plan(slow, profile, spec, parse_devices("a:24GiB*2@0.3,b:24GiB*2@0.3"), reconsider=True)
    assert same.kind == "unchanged"
    faster = parse_devices("a:24GiB*2@0.3,h:80GiB*2@3.35")
    assert choose_plan(slow, profile, spec, faster, reconsider=False).kind == "unchanged"
    better = choose_plan(slow, profile, spec, faster, reconsider=True)
    assert better.kind == "improved" and nodes_of(better.plan, 0) == {"h"}
    assert critical_path(better.plan) < critical_path(slow)
    waiting = choose_plan(slow, profile, spec, faster, reconsider=True, settled=False)
    assert waiting.kind == "unchanged"


@pytest.mark.parametrize("change,why", [
    (dict(parallelism={"tensor": 1}), "tensor changed from 2 to 1"),
    (dict(model={"maxModelLen": 128}), "maxModelLen changed from 256 to 128"),
    (dict(model={"dtype": "bfloat16"}), "dtype changed"),
    (dict(placement={"memoryHeadroom": 0.2}), "memoryHeadroom changed"),
])
def test_spec_changes_replan(profile, two_groups, change, why):
    spec = make_spec(replicas=2, **change)
    assert why in incompatibility(two_groups, profile, spec)
    choice = choose_plan(two_groups, profile, spec, parse_devices(POOL))
    assert choice.kind == "respec" and why in choice.message


def test_a_new_checkpoint_replans(two_groups):
    other = tiny_profile(intermediate_size=256)
    assert incompatibility(two_groups, other, make_spec(replicas=2)) == "the checkpoint changed"


def test_repair_that_does_not_fit_beside_the_others_replans_everything():
    profile = tiny_profile(**SEVEN_B)  # ~15 GiB a rank at tensor=1, ~8 GiB at tensor=2
    spec = make_spec(replicas=2, parallelism={"tensor": "auto", "pipeline": "auto"})
    current = choose_plan(None, profile, spec, parse_devices("a:24GiB*1,b:24GiB*1")).plan
    assert current.tensor_parallel == 1
    # b is gone; the new nodes' 12 GiB GPUs hold a group only at tensor=2, so group 0 moves too.
    choice = choose_plan(current, profile, spec, parse_devices("a:24GiB*1,c:12GiB*2,d:12GiB*2"))
    assert choice.kind == "replanned" and "planned again" in choice.message
    assert choice.plan.tensor_parallel == 2 and {r.node for r in choice.plan.ranks} == {"c", "d"}


def test_without_devices_takes_the_highest_indices():
    inv = without_devices(parse_devices("a:24GiB*4,b:24GiB*2"), {"a": 3})
    assert [(d.node, d.index) for d in inv.devices] == [("a", 0), ("b", 0), ("b", 1)]


def test_a_node_whose_gpus_other_workloads_hold_is_listed_with_the_reason():
    inv = without_held(parse_devices("a:24GiB*2,b:24GiB*2"), {"a": 2, "b": 1})
    assert [(d.node, d.index) for d in inv.devices] == [("b", 0)]
    assert [(s.node, s.reason) for s in inv.skipped] == [("a", "other workloads hold its 2 GPUs")]


# ---------------------------------------------------------------- room for replacements
def held_by(plan, replica):
    """GPUs each node gives group `replica` of `plan`."""
    out = {}
    for r in plan.group(replica):
        out[r.node] = out.get(r.node, 0) + 1
    return out


def test_a_replacement_starts_on_the_free_node_beside_the_serving_group(profile):
    pool = parse_devices(POOL)
    serving = choose_plan(None, profile, make_spec(replicas=1), pool).plan
    assert nodes_of(serving, 0) == {"a"}
    # A new revision planned where the serving group runs (the planner's first choice) moves to a free node.
    room = make_room(serving, profile, make_spec(replicas=1), pool, free={"a": 0, "b": 2, "c": 2},
                     replacing={0: held_by(serving, 0)}, started=set())
    assert nodes_of(room.plan, 0) == {"b"} and room.moved == [
        "group 0 starts on b, where the pool has room beside the serving group"]
    assert (room.plan.tensor_parallel, room.plan.pipeline_parallel) == (serving.tensor_parallel,
                                                                        serving.pipeline_parallel)
    # Started already, or not a replacement: nothing moves.
    for kwargs in (dict(replacing={0: held_by(serving, 0)}, started={0}), dict(replacing={}, started=set())):
        assert make_room(serving, profile, make_spec(replicas=1), pool, free={"b": 2, "c": 2}, **kwargs).moved == []


def test_a_full_pool_plans_each_replacement_on_its_own_groups_devices(profile):
    pool = parse_devices("a:24GiB*2,b:24GiB*2")
    serving = choose_plan(None, profile, make_spec(replicas=2), pool).plan
    assert (nodes_of(serving, 0), nodes_of(serving, 1)) == ({"a"}, {"b"})
    # A fresh plan that swapped them would deadlock (each waits for the other's node): in place instead.
    swapped = serving.model_copy(update={"ranks": [r.model_copy(update={"replica": 1 - r.replica})
                                                   for r in serving.ranks]})
    room = make_room(swapped, profile, make_spec(replicas=2), pool, free={"a": 0, "b": 0},
                     replacing={0: held_by(serving, 0), 1: held_by(serving, 1)}, started=set())
    assert (nodes_of(room.plan, 0), nodes_of(room.plan, 1)) == ({"a"}, {"b"})
    assert all("to replace its serving group in place" in m for m in room.moved) and len(room.moved) == 2
    # Planned in place already: it stays.
    assert make_room(serving, profile, make_spec(replicas=2), pool, free={"a": 0, "b": 0},
                     replacing={0: held_by(serving, 0), 1: held_by(serving, 1)}, started=set()).moved == []


def test_room_is_taken_in_replica_order(profile):
    """One spare node: group 0 surges onto it, group 1 is planned in place (its turn comes later)."""
    pool = parse_devices(POOL)
    serving = choose_plan(None, profile, make_spec(replicas=2), pool).plan
    spare = ({"a", "b", "c"} - nodes_of(serving, 0) - nodes_of(serving, 1)).pop()
    room = make_room(serving, profile, make_spec(replicas=2), pool, free={spare: 2},
                     replacing={0: held_by(serving, 0), 1: held_by(serving, 1)}, started=set())
    assert nodes_of(room.plan, 0) == {spare} and nodes_of(room.plan, 1) == nodes_of(serving, 1)


@settings(max_examples=100, deadline=None)
@given(nodes=st.lists(st.integers(0, 4), min_size=1, max_size=4), replicas=st.integers(1, 3),
       frees=st.lists(st.integers(0, 2), min_size=4, max_size=4), started=st.sets(st.integers(0, 2)),
       data=st.data())
def test_make_room_moves_a_group_only_where_it_fits(nodes, replicas, frees, started, data):
    """Whatever the pool and what is free: started groups and those not replacing one stay; every
    group keeps the plan's degrees; a moved group fits what is free plus its own serving group's
    devices, and the groups moved beside the serving ones fit what is free, together."""
    if not any(nodes):
        return
    profile, names = tiny_profile(), "abcd"
    pool = parse_devices(",".join(f"{names[i]}:24GiB*{n}" for i, n in enumerate(nodes) if n))
    # The serving groups, and a new plan made on part of the pool (so some groups land elsewhere).
    part = data.draw(st.sets(st.sampled_from(sorted({d.node for d in pool.devices})), min_size=1))
    try:
        serving = choose_plan(None, profile, make_spec(replicas=replicas), pool).plan
        current = choose_plan(None, profile, make_spec(replicas=replicas), Inventory(
            devices=[d for d in pool.devices if d.node in part])).plan
    except PlanError:
        return
    groups = [g.replica for g in current.groups]
    replacing = {r: held_by(serving, r) for r in data.draw(st.sets(st.sampled_from(groups)))
                 if serving.group(r)}
    # Free: what the serving groups and other workloads (up to `frees`) leave of each node.
    held = Counter(r.node for r in serving.ranks)
    free = {names[i]: max(0, n - held[names[i]] - f) for i, (f, n) in enumerate(zip(frees, nodes, strict=False))}
    room = make_room(current, profile, make_spec(replicas=replicas), pool, free, replacing, started)
    beside: dict[str, int] = {}
    assert (room.plan.tensor_parallel, room.plan.pipeline_parallel, len(room.plan.groups)) == \
        (current.tensor_parallel, current.pipeline_parallel, len(current.groups))
    for r in groups:
        before, after = held_by(current, r), held_by(room.plan, r)
        assert len(room.plan.group(r)) == current.world_size
        if r in started or r not in replacing:
            assert after == before
        elif after != before:
            assert all(free.get(node, 0) + replacing[r].get(node, 0) >= n for node, n in after.items())
            if f"group {r} starts on" in " ".join(room.moved):
                for node, n in after.items():
                    beside[node] = beside.get(node, 0) + n
    assert all(free.get(node, 0) >= n for node, n in beside.items()), (beside, free)
