"""`shardctl status NAME`: a ShardedModel's status merged with what its group leaders report."""

from __future__ import annotations

import json

import pytest

from shard_contract.plan import PredictedBytes
from shard_contract.wire import ShardsResponse
from shard_operator.cli.view import leader_pods, render, view_of_model, with_leaders
from shard_operator.objects.manifests import pod_name
from tests.support.shards import entry, rank_plan

PREDICTED = PredictedBytes(weights=1, kv_cache=1, activations=1, overhead=1)


def shard(group: int, revision: str, rank: int, resident: int | None = 5 * 2**20) -> dict:
    return {"group": group, "rank": rank, "pod": pod_name("m", group, revision, rank), "node": "n", "device": "gpu0",
            "layers": [0, 3], "predictedBytes": 2**30, "residentBytes": resident, "state": "Ready"}


def report(replica: int, seconds: list[tuple[float, float, float]], step: tuple[float, int] | None) -> ShardsResponse:
    """A leader's /v1/shards: each rank's compute, communication and idle seconds; rank 0's last batch."""
    return ShardsResponse(model="m", replica=replica, ready=True, ranks=[
        entry(rank_plan(r, layers=(0, 3), capacity=4 * 2**30, usable=3 * 2**30, predicted=PREDICTED),
              (7 + r) * 2**20, compute_seconds=c, comm_seconds=m, idle_seconds=i,
              **({"last_generate": {"decode_seconds": step[0], "decode_steps": step[1]}} if step and r == 0 else {}))
        for r, (c, m, i) in enumerate(seconds)])


MODEL = {"metadata": {"name": "m", "namespace": "ns"}, "spec": {"replicas": 2}, "status": {
    "phase": "Ready", "plan": {"hash": "h", "predictedStepSeconds": 0.01},
    # group 0 is being replaced: its old revision still has both pods, the new one a pod without a
    # leader yet; group 1's rank 1 is missing (no pod)
    "shards": [shard(0, "old", 0), shard(0, "old", 1), shard(0, "new", 1), shard(1, "a", 0),
               {**shard(1, "a", 1, resident=None), "pod": ""}]}}


def test_leaders_are_the_rank_0_pods_of_the_status():
    assert leader_pods(MODEL) == [(0, "m-0-old-0"), (1, "m-1-a-0")]


def test_every_rank_of_a_leaders_group_gets_its_shares_capacity_and_bytes_and_the_slowest_step():
    reports = {"m-0-old-0": report(0, [(3.0, 1.0, 0.0), (1.0, 1.0, 2.0)], (0.5, 25)),
               "m-1-a-0": report(1, [(1.0, 0.0, 0.0), (2.0, 2.0, 0.0)], (0.9, 30))}
    view = with_leaders(view_of_model(MODEL), reports, [])
    got = [(r.group, r.where, r.shares, r.capacity, r.measured) for r in view.rows]
    assert got == [
        (0, "m-0-old-0", (0.75, 0.25, 0.0), 4 * 2**30, 7 * 2**20),
        (0, "m-0-old-1", (0.25, 0.25, 0.5), 4 * 2**30, 8 * 2**20),
        (0, "m-0-new-1", None, None, 5 * 2**20),  # the new revision's pod: not that leader's group
        (1, "m-1-a-0", (1.0, 0.0, 0.0), 4 * 2**30, 7 * 2**20),
        (1, "n/gpu0", None, None, None)]  # no pod, no report of it
    assert view.measured_step == pytest.approx(0.03)  # group 1's 0.9 s over 30 steps: slower than group 0's 20 ms
    text = render(view)
    assert "measured 30.00 ms (the latest batch)" in text and "75%" in text
    raw = json.loads(json.dumps(view.raw))  # --json: what was read, the leaders' own reports included
    assert raw["shardedModel"] == MODEL and raw["unread"] == []
    assert {pod: ShardsResponse.model_validate(r) for pod, r in raw["leaders"].items()} == reports
    assert not [line for line in text.splitlines() if "time shares" in line]


def test_leaders_not_read_leave_the_status_table_and_say_why_in_one_line():
    plain = view_of_model(MODEL)
    view = with_leaders(plain, {}, ["group 0 (m-0-old-0): HTTP 503: error trying to reach service",
                                    "group 1 (m-1-a-0): HTTP 400: address not allowed"])
    assert view.rows == plain.rows and view.measured_step is None
    assert view.notes == plain.notes + [
        "no time shares or measured step from group 0 (m-0-old-0): HTTP 503: error trying to reach service; "
        "group 1 (m-1-a-0): HTTP 400: address not allowed"]
    assert "- (no batch yet)" in render(view)
    assert view.raw["shardedModel"] == MODEL and view.raw["leaders"] == {} and len(view.raw["unread"]) == 2


def test_a_problem_is_noted_once_whatever_conditions_carry_it():
    """The Degraded condition's message, once: Progressing points to it (or, written by an older
    operator, repeats it word for word), and Available says what still serves."""
    why = "tiny does not fit: the most loaded rank needs 2561.1 MiB; the largest device offers 2560.5 MiB usable"
    for progressing in (why, "the Degraded condition says why"):
        obj = {**MODEL, "status": {**MODEL["status"], "conditions": [
            {"type": "Available", "status": "False", "reason": "InsufficientCapacity",
             "message": "no group ready; the Degraded condition says why"},
            {"type": "Progressing", "status": "False", "reason": "InsufficientCapacity", "message": progressing},
            {"type": "Degraded", "status": "True", "reason": "InsufficientCapacity", "message": why}]}}
        assert view_of_model(obj).notes == [f"Degraded: InsufficientCapacity: {why}",
                                            "Available: InsufficientCapacity: no group ready; the Degraded condition "
                                            "says why"]


def test_the_kv_cache_capacity_in_tokens_and_the_busiest_groups_use():
    model = {**MODEL, "status": {**MODEL["status"], "plan": {"hash": "h", "kvCacheTokens": 8192}}}
    reports = {"m-0-old-0": report(0, [(1.0, 0.0, 0.0)], None).model_copy(update={"kv_cache_used_tokens": 1024}),
               "m-1-a-0": report(1, [(1.0, 0.0, 0.0)], None).model_copy(update={"kv_cache_used_tokens": 2048})}
    assert "KV cache: 8192 tokens per group\n" in render(view_of_model(model)) + "\n"
    assert "KV cache: 8192 tokens per group, 2048 in use (25%)" in render(with_leaders(view_of_model(model), reports,
                                                                                       []))
