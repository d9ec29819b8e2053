"""The real kopf operator against the emulated API server, with a simulated kubelet and fake leaders.

Every test also checks (in the `world` fixture) that the operator made no API request outside the
RBAC table in permissions.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shard_contract.env import WorkerEnv
from shard_contract.plan import Plan
from shard_contract.units import quantity
from shard_devcluster.apirules import Faults
from shard_devcluster.apiserver import SM
from shard_operator.api import parse_spec
from shard_operator.metrics import ControllerCollector
from shard_operator.objects.manifests import PLAN_KEY, Context, Owner, desired_objects, drift_patch, plan_record_name
from shard_operator.objects.permissions import permissions
from tests.operator.conftest import RESIDENT
from tests.support.cluster import SEVEN_B, gpu_node, sharded_model, write_model
from tests.support.operator import eventually

from .conftest import permission_of

NETPOL = "networking.k8s.io/v1/networkpolicies"


def uids(pods):
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


def groups_of(pods):
    out = {}
    for p in pods:
        labels = p["metadata"]["labels"]
        out.setdefault(int(labels["sharding.dev/group"]), set()).add(p["metadata"]["annotations"]["sharding.dev/node"])
    return out


@pytest.mark.parametrize("layout, ranks_per_pod", [("perRank", 1), ("auto", 2)])  # auto on GPUs: a pod per TP group
async def test_create_wires_every_rank_and_reports_ready(world, layout, ranks_per_pod):
    for n in ("a", "b"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        created = await world.create(sharded_model("m1", model_dir, replicas=2, tensor=2, pod_layout=layout,
                                                   worker={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}))
        status = await world.wait_phase("m1", "Ready")
        async def measured():
            s = await world.status("m1")
            return s if all("residentBytes" in shard for shard in s["shards"]) else None
        status = await eventually(measured)

    pods = await world.pods("m1")
    assert len(pods) == 4 // ranks_per_pod and groups_of(pods) in ({0: {"a"}, 1: {"b"}}, {0: {"b"}, 1: {"a"}})
    uid = created["metadata"]["uid"]
    for pod in pods:
        labels = pod["metadata"]["labels"]
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
        worker = WorkerEnv.from_env(env)
        assert (worker.world_size, worker.tp_size, worker.pp_size) == (2, 2, 1)
        assert str(worker.rank) == labels["sharding.dev/rank"] and str(worker.replica) == labels["sharding.dev/group"]
        assert worker.master_addr.startswith(pod["metadata"]["name"][:-1] + "0.")
        assert env["NCCL_DEBUG"] == "INFO"
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(ranks_per_pod)
        assert labels["sharding.dev/ranks"] == str(ranks_per_pod)
        assert [r["uid"] for r in pod["metadata"]["ownerReferences"]] == [uid]
        assert set(labels) >= {"sharding.dev/model", "sharding.dev/group", "sharding.dev/rank",
                               "sharding.dev/role", "sharding.dev/plan"}
    services = {s["metadata"]["name"]: s for s in await world.objects("v1/services", "m1")}
    assert services["m1"]["spec"]["selector"] == {"sharding.dev/model": "m1", "sharding.dev/role": "leader"}
    assert {p["spec"]["subdomain"] for p in pods} < set(services)
    for kind in ("v1/services", "v1/configmaps", "v1/secrets"):
        assert all(o["metadata"]["ownerReferences"][0]["uid"] == uid for o in await world.objects(kind, "m1"))
    # Each group's key: a Secret named as the group, mounted by its pods; a key of its own.
    secrets = {s["metadata"]["name"]: s for s in await world.objects("v1/secrets", "m1")}
    assert set(secrets) == {p["spec"]["subdomain"] for p in pods} and len(secrets) == 2
    assert len({s["data"]["group-key"] for s in secrets.values()}) == 2
    assert all(len(base64.b64decode(s["data"]["group-key"])) == 32 and s["immutable"] for s in secrets.values())
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["group-key"]["secret"]["secretName"] == pod["spec"]["subdomain"]

    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert (status["plan"]["tensorParallel"], status["plan"]["pipelineParallel"]) == (2, 1)
    assert {(s["group"], s["rank"], s["state"]) for s in status["shards"]} == \
        {(g, r, "Ready") for g in (0, 1) for r in (0, 1)}
    assert {s["residentBytes"] for s in status["shards"]} == {RESIDENT, RESIDENT + 2**20}
    assert all(s["predictedBytes"] > 0 for s in status["shards"])
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Available"]["status"] == "True" and conditions["Degraded"]["status"] == "False"
    reasons = [e[1] for e in await world.events("m1")]
    assert "Planned" in reasons and reasons.count("CreatingGroup") == 2
    told = str(await world.events("m1")) + str(status) + str(pods)  # the keys are in their Secrets only
    assert not any(s["data"]["group-key"] in told or base64.b64decode(s["data"]["group-key"]).hex() in told
                   for s in secrets.values())


async def test_scaling_adds_and_removes_whole_groups(world):
    for n in ("a", "b", "c"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir, replicas=1))
        await world.wait_phase("m1", "Ready")
        first = uids(await world.pods("m1"))

        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 3}}, subresource="scale")
        await eventually(lambda: _ready_replicas(world, "m1", 3))
        pods = await world.pods("m1")
        assert len(pods) == 6 and set(first.items()) < set(uids(pods).items())  # group 0 untouched
        assert sorted(len(n) for n in groups_of(pods).values()) == [1, 1, 1]

        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 2}}, subresource="scale")
        await eventually(lambda: _pod_count(world, "m1", 4))
        status = await world.wait_phase("m1", "Ready")
        kept = await world.pods("m1")
        assert set(uids(kept).items()) < set(uids(pods).items())  # groups 0 and 1 untouched
        assert set(groups_of(kept)) == {0, 1} and (status["replicas"], status["readyReplicas"]) == (2, 2)
        scale = await world.emu.k8s_get(SM, "default", "m1")
        assert scale["spec"]["replicas"] == 2
    for kind in ("v1/services", "v1/secrets"):  # the group's key went with it
        assert not [o for o in await world.objects(kind, "m1")
                    if o["metadata"]["labels"].get("sharding.dev/group") == "2"]
    assert len(await world.objects("v1/secrets", "m1")) == 2


async def test_replicas_that_do_not_all_fit_run_as_many_as_fit_whatever_the_history(world):
    await world.add_node(gpu_node("a"))  # room for one group of tensor=2
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir, replicas=3))
        status = await eventually(lambda: _degraded_serving(world, "m1", wanted=3, ready=1))
        assert status["replicas"] == 1 and len(await world.pods("m1")) == 2

        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 0}}, subresource="scale")
        await eventually(lambda: _pod_count(world, "m1", 0))
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 2}}, subresource="scale")
        status = await eventually(lambda: _degraded_serving(world, "m1", wanted=2, ready=1))
        assert status["replicas"] == 1 and groups_of(await world.pods("m1")) == {0: {"a"}}
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Degraded"]["message"].startswith(
        "2 replicas wanted, 1 fits: tensor=2 x pipeline=1 x 2 replicas needs 4 devices, tensor-parallel ranks on one "
        "node; the pool has 2")
    assert "add 2 more devices of 24.0 GiB (NVIDIA-L4) to node a" in conditions["Degraded"]["message"]
    assert conditions["Available"]["message"] == "1 of 2 groups ready, 2 needed; only 1 fits the pool"
    warnings = [e[2] for e in await world.events("m1") if e[0] == "Warning"]
    assert any(m.startswith("3 replicas wanted, 1 fits") for m in warnings)


async def _degraded_serving(world, name, wanted, ready):
    """The status once `ready` groups serve and the Degraded condition says only they fit."""
    model = await world.model(name)
    status = model.get("status") or {}
    degraded = next((c for c in status.get("conditions") or [] if c["type"] == "Degraded"), {})
    ok = status.get("observedGeneration") == model["metadata"]["generation"] and status.get("phase") == "Degraded" \
        and status.get("readyReplicas") == ready and degraded.get("reason") == "InsufficientCapacity" \
        and degraded.get("message", "").startswith(f"{wanted} replicas wanted, {ready} fit")
    return status if ok else None


async def _ready_replicas(world, name, n):
    return (await world.status(name)).get("readyReplicas") == n


async def _pod_count(world, name, n):
    return len(await world.pods(name)) == n


async def test_a_removed_node_moves_its_group_while_the_other_keeps_serving(world):
    for n in ("a", "b", "c"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator() as op:
        await world.create(sharded_model("m1", model_dir, replicas=2))
        await world.wait_phase("m1", "Ready")
        before = await world.pods("m1")
        placement = groups_of(before)
        lost = next(iter(placement[0]))
        other = {n: u for n, u in uids(before).items() if "-1-" in n}

        await world.emu.k8s_delete("v1/nodes", None, lost)
        await eventually(lambda: _phase_in(world, "m1", {"Degraded"}))  # its pods are lost
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)
        assert uids(await world.pods("m1")) == uids(before)  # nothing moves inside the settle window

        world.clock.advance(1.0)
        await eventually(lambda: _placed_elsewhere(world, "m1", lost))
        status = await world.wait_phase("m1", "Ready")
        after = await world.pods("m1")
        assert {n: u for n, u in uids(after).items() if "-1-" in n} == other  # group 1 never restarted
        assert lost not in set().union(*groups_of(after).values())
        assert status["readyReplicas"] == 2
    # Its pods would wait for the pod GC (40 s here): the operator deleted them with grace 0.
    forced = {r.name for r in world.emu.api_requests() if permission_of(r) == (("", "pods"), "delete")
              and r.params.get("gracePeriodSeconds") == "0"}
    assert forced == {n for n in uids(before) if "-0-" in n}
    reasons = [e[1] for e in await world.events("m1")]
    assert "Rebalancing" in reasons and "NodeLost" in reasons and reasons.count("GroupReady") == 3


async def _phase_in(world, name, phases):
    return (await world.status(name)).get("phase") in phases


async def _placed_elsewhere(world, name, node):
    pods = await world.pods(name)
    return len(pods) == 4 and node not in set().union(*groups_of(pods).values())


async def test_an_added_node_rebalances_only_when_the_plan_improves(world):
    await world.add_node(gpu_node("l4-a", memory_mib=23034, product="NVIDIA-L4"))
    model_dir = write_model(world.tmp / "models" / "seven", **SEVEN_B)
    async with world.operator() as op:
        await world.create(sharded_model("m1", model_dir, replicas=1, tensor=2))
        await world.wait_phase("m1", "Ready")
        before = uids(await world.pods("m1"))

        await world.add_node(gpu_node("l4-b", memory_mib=23034, product="NVIDIA-L4"))
        seen = op.reconciles
        world.clock.advance(1.0)
        await eventually(lambda: op.reconciles >= seen + 3)
        assert uids(await world.pods("m1")) == before  # no faster plan: no churn

        await world.add_node(gpu_node("h100", memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"))
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 2)
        assert uids(await world.pods("m1")) == before  # not before the pool settles
        world.clock.advance(1.0)
        await eventually(lambda: _on_nodes(world, "m1", {"h100"}))
        await world.wait_phase("m1", "Ready")
    reasons = [e[1] for e in await world.events("m1")]
    assert reasons.count("Rebalancing") == 1 and "DeletingGroup" in reasons


async def _on_nodes(world, name, nodes, ranks=2):
    pods = await world.pods(name)
    return pods and set().union(*groups_of(pods).values()) == nodes and len(pods) == ranks


async def test_a_flapping_node_causes_no_churn(world):
    for n in ("a", "b"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator() as op:
        await world.create(sharded_model("m1", model_dir, replicas=1))
        await world.wait_phase("m1", "Ready")
        before = uids(await world.pods("m1"))
        node = next(iter(groups_of(await world.pods("m1"))[0]))
        for ready in ("False", "True", "False", "True"):
            await world.emu.k8s_patch("v1/nodes", None, node, {"status": {"conditions": [
                {"type": "Ready", "status": ready}]}}, subresource="status")
            seen = op.reconciles
            await eventually(lambda: op.reconciles >= seen + 1)
        world.clock.advance(1.0)
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 2)
        assert uids(await world.pods("m1")) == before
        await world.wait_phase("m1", "Ready")
    assert "Rebalancing" not in [e[1] for e in await world.events("m1")]


async def test_a_failed_rank_recreates_its_group_until_the_budget_is_spent(world):
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator(restart_budget=2) as op:
        await world.create(sharded_model("m1", model_dir, replicas=1))
        await world.wait_phase("m1", "Ready")
        for attempt in (1, 2):
            before = uids(await world.pods("m1"))
            if attempt == 1:
                await world.kubelet.fail("default", sorted(before)[1], exit_code=137, reason="OOMKilled")
            else:  # a deleted rank breaks the group just the same
                await world.emu.k8s_delete("v1/pods", "default", sorted(before)[0])
            await eventually(lambda: _recreated(world, "m1", before))
            status = await world.wait_phase("m1", "Ready")
            assert status["groups"][0]["restarts"] == attempt

        await world.kubelet.fail("default", sorted(uids(await world.pods("m1")))[0], exit_code=1)
        status = await world.wait_phase("m1", "Failed")
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "RestartBudgetExhausted" and "exit code 1" in degraded["message"]
        assert len(await world.pods("m1")) == 2  # kept for `kubectl logs`
        # What the chart's ShardRestartBudgetExhausted alert reads (the loop publishes the status it
        # wrote once the write is answered, a moment after the server has it).
        def gauges():
            scraped = {(s.name, s.labels.get("group") or s.labels.get("reason")): s.value
                       for s in scrape(op) if s.labels.get("model") == "m1"}
            return scraped if ("shard_operator_degraded", "RestartBudgetExhausted") in scraped else None
        assert (await eventually(gauges))[("shard_operator_degraded", "RestartBudgetExhausted")] == 1
        assert (await eventually(gauges))[("shard_operator_group_restarts", "0")] == 2

        async def posted():  # Events are posted in the background
            reasons = [e[1] for e in await world.events("m1")]
            return reasons if "RestartBudgetExhausted" in reasons else None
        reasons = await eventually(posted)
    assert reasons.count("RecreatingGroup") == 2


async def test_a_rank_that_fails_for_good_is_not_restarted(world):
    """A rank that exits EXIT_CONFIG (78: its checkpoint or plan is wrong) said that a restart would
    fail the same way: the group is given up at once, whatever the restart budget."""
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator(restart_budget=3):
        await world.create(sharded_model("m1", model_dir, replicas=1))
        await world.wait_phase("m1", "Ready")
        before = uids(await world.pods("m1"))
        await world.kubelet.fail("default", sorted(before)[1], exit_code=78)
        status = await world.wait_phase("m1", "Failed")
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "RankFailedForGood" and "exit code 78" in degraded["message"], degraded
        assert status["groups"][0]["restarts"] == 0
        assert uids(await world.pods("m1")) == before  # kept for `kubectl logs`

        async def posted():
            reasons = [e[1] for e in await world.events("m1")]
            return reasons if "RankFailedForGood" in reasons else None
        assert "RecreatingGroup" not in await eventually(posted)


def scrape(op):
    """The operator's metrics samples, as Prometheus would scrape them."""
    registry = CollectorRegistry()
    registry.register(ControllerCollector(op))
    return [s for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples]


async def _recreated(world, name, before):
    pods = await world.pods(name)
    return len(pods) == 2 and not set(uids(pods).values()) & set(before.values())


TRAINING = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "training"},  # holds node a's 2 GPUs
            "spec": {"nodeName": "a", "containers": [{"name": "t", "image": "x",
                                                       "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}


@pytest.mark.parametrize("change,reason,words", [
    (dict(tensor=3), "InvalidParallelism", "does not divide the 4 attention heads; valid: 1, 2, 4"),
    # Parallelism no pool can run is named as such, also while other workloads hold every GPU.
    (dict(tensor=3, held=True), "InvalidParallelism", "tensor=3 does not divide the 4 attention heads"),
    (dict(tensor=1, pipeline=100, held=True), "InvalidParallelism", "pipeline=100 exceeds the 4 decoder layers"),
    (dict(held=True), "NoDevices", "no usable devices in the node pool (a: other workloads hold its 2 GPUs)"),
    (dict(placement={"nodeSelector": {"pool": "nowhere"}}), "NoDevices", "not in the node pool"),
    (dict(rollout={"maxSurge": -1}), "InvalidSpec", "spec.rollout.maxSurge"),
    (dict(missing=True), "ModelNotFound", "does not exist"),
])
async def test_an_invalid_spec_creates_nothing_and_says_why_once(world, change, reason, words):
    await world.add_node(gpu_node("a"))
    if change.pop("held", False):
        await world.emu.k8s_create("v1/pods", "default", TRAINING)
    model_dir = write_model(world.tmp / "models" / "tiny")
    if change.pop("missing", False):
        model_dir = world.tmp / "models" / "absent"
    async with world.operator() as op:
        await world.create(sharded_model("bad", model_dir, **change))
        status = await world.wait_phase("bad", "Failed")
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)  # it keeps reconciling, quietly
        assert op.failures == 0
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == reason and words in degraded["message"]
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    # the message once, in Degraded; Available gives the reason and points there
    assert (available["status"], available["reason"], available["message"]) == \
        ("False", reason, "no group ready; the Degraded condition says why")
    assert await world.objects("v1/pods", "bad") == [] and await world.objects("v1/services", "bad") == []
    assert [e for e in await world.events("bad") if e[0] == "Warning"] == [("Warning", reason, degraded["message"])]


async def test_a_restarted_operator_resumes_without_duplicates_or_writes(world):
    for n in ("a", "b"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir, replicas=2))
        await world.wait_phase("m1", "Ready")
        async def measured():
            return all("residentBytes" in s for s in (await world.status("m1"))["shards"])
        await eventually(measured)
    before = {kind: uids(await world.objects(kind, "m1")) for kind in ("v1/pods", "v1/services", "v1/configmaps")}
    status = await world.status("m1")
    async with world.operator() as op:
        await eventually(lambda: op.reconciles >= 3)
        assert op.kube.writes == 0 and op.failures == 0
    after = {kind: uids(await world.objects(kind, "m1")) for kind in ("v1/pods", "v1/services", "v1/configmaps")}
    assert after == before
    assert await world.status("m1") == status


async def test_deleting_the_model_removes_everything(world):
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir))
        await world.wait_phase("m1", "Ready")
        assert await world.objects("v1/configmaps", "m1")
        await world.emu.k8s_delete(SM, "default", "m1")
        await eventually(lambda: _gone(world, "m1"))


async def _gone(world, name):
    if await world.model(name) is not None:
        return False
    for kind in ("v1/pods", "v1/services", "v1/configmaps", "v1/secrets"):
        if await world.objects(kind, name):
            return False
    return True


async def test_a_replacement_without_room_to_surge_waits_and_says_so(world):
    await world.add_node(gpu_node("a", gpus=2))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir))
        await world.wait_phase("m1", "Ready")
        before = uids(await world.pods("m1"))
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"worker": {"image": "example.com/worker:2"}}})
        async def blocked():
            progressing = next(c for c in (await world.status("m1"))["conditions"] if c["type"] == "Progressing")
            return progressing if progressing["reason"] == "Blocked" else None
        progressing = await eventually(blocked)
        assert "no room for a new group beside the serving one (a needs 2 GPUs, 0 free)" in progressing["message"]
        assert "takes the model down" in progressing["message"]
        assert uids(await world.pods("m1")) == before  # still serving

        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"rollout": {"maxUnavailable": 1}}})
        await eventually(lambda: _recreated(world, "m1", before))
        await world.wait_phase("m1", "Ready")
        images = {p["spec"]["containers"][0]["image"] for p in await world.pods("m1")}
        assert images == {"example.com/worker:2"}


async def test_a_profiling_pod_reads_a_volume_the_operator_cannot(world):
    await world.add_node(gpu_node("a"))
    write_model(world.tmp / "pvc" / "tiny")  # the kubelet mounts <tmp>/pvc at /models
    body = sharded_model("m1", world.tmp / "unused" / "tiny")
    body["spec"]["model"] = {"path": "tiny", "volume": {"pvc": {"claimName": "weights"}}, "maxModelLen": 256}
    async with world.operator():
        await world.create(body)
        status = await world.wait_phase("m1", "Ready")
        assert status["plan"]["tensorParallel"] == 2
    configmaps = {c["metadata"]["name"]: c for c in await world.objects("v1/configmaps", "m1")}
    assert '"num_layers":4' in configmaps["m1-profile"]["data"]["profile.json"]
    assert not [p for p in await world.objects("v1/pods", "m1")
                if p["metadata"]["labels"]["sharding.dev/component"] == "profiler"]  # cleaned up
    assert "Planned" in [e[1] for e in await world.events("m1")]


async def test_edited_objects_are_put_back(world):
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir))
        await world.wait_phase("m1", "Ready")
        await world.emu.k8s_patch("v1/services", "default", "m1", {"spec": {"selector": {"app": "hijacked"}}})
        record = "m1-plan"
        await world.emu.k8s_patch("v1/configmaps", "default", record, {"data": {"plan.json": "{}"}})

        async def restored():
            service = await world.emu.k8s_get("v1/services", "default", "m1")
            cm = await world.emu.k8s_get("v1/configmaps", "default", record)
            return service["spec"]["selector"] == {"sharding.dev/model": "m1", "sharding.dev/role": "leader"} \
                and cm["data"]["plan.json"] != "{}"
        await eventually(restored)


async def test_gpus_held_by_other_workloads_are_planned_around(world):
    for n in ("a", "b"):
        await world.add_node(gpu_node(n))
    await world.emu.k8s_create("v1/pods", "default", TRAINING)
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir))
        await world.wait_phase("m1", "Ready")
    assert groups_of(await world.pods("m1")) == {0: {"b"}}


async def test_an_edited_node_pool_moves_the_groups_at_once(world):
    await world.add_node(gpu_node("a", labels={"pool": "x"}))
    await world.add_node(gpu_node("b", labels={"pool": "y"}))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir, placement={"nodeSelector": {"pool": "x"}}))
        await world.wait_phase("m1", "Ready")
        assert groups_of(await world.pods("m1")) == {0: {"a"}}
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"placement": {"nodeSelector": {"pool": "y"}}}})
        await eventually(lambda: _on_nodes(world, "m1", {"b"}))  # no settle window: the user asked
        await world.wait_phase("m1", "Ready")


async def test_no_room_left_says_so_and_keeps_the_other_group_serving(world):
    for n in ("a", "b"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator():
        await world.create(sharded_model("m1", model_dir, replicas=2))
        await world.wait_phase("m1", "Ready")
        before = await world.pods("m1")
        lost = next(iter(groups_of(before)[1]))
        await world.emu.k8s_delete("v1/nodes", None, lost)
        await eventually(lambda: _phase_in(world, "m1", {"Degraded"}))  # seen: the settle window starts
        world.clock.advance(1.0)

        async def no_room():
            degraded = next(c for c in (await world.status("m1"))["conditions"] if c["type"] == "Degraded")
            return degraded if degraded["reason"] == "InsufficientCapacity" else None
        degraded = await eventually(no_room)
        assert degraded["message"].startswith("2 replicas wanted, 1 fits") and "GiB" in degraded["message"]
        status = await world.status("m1")
        assert status["phase"] == "Degraded" and status["readyReplicas"] == 1
        serving = {n: u for n, u in uids(before).items() if "-0-" in n}
        assert {n: u for n, u in uids(await world.pods("m1")).items() if "-0-" in n} == serving
    assert "InsufficientCapacity" in [e[1] for e in await world.events("m1") if e[0] == "Warning"]


async def test_offload_auto_runs_what_does_not_fit_and_holds_it_all_again_when_the_pool_grows(world):
    """A 7B model on one 8 GiB GPU: InsufficientCapacity (whose message says what offload would do);
    with offload auto it runs, streaming the layers that do not fit (status and an Event say which
    rank streams how much; its pod requests the host memory of what it streams, which the
    emulated scheduler places as kube-scheduler's NodeResourcesFit does); a node that holds it all
    makes it fully resident again."""
    await world.add_node(gpu_node("small", gpus=1, memory_mib=8192, product="NVIDIA-L4"))
    model_dir = write_model(world.tmp / "models" / "seven", **SEVEN_B)
    async with world.operator() as op:
        await world.create(sharded_model("m1", model_dir, tensor=1, pipeline=1))
        status = await world.wait_phase("m1", "Failed")
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "InsufficientCapacity"
        assert "set spec.placement.offload.policy auto: streaming" in degraded["message"]

        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"placement": {"offload": {"policy": "auto"}}}})
        status = await world.wait_phase("m1", "Ready")
        (shard,) = status["shards"]
        assert shard["offload"]["tier"] == "host" and 0 < len(shard["offload"]["layers"]) < 32
        assert shard["predictedBytes"] <= 8192 * 2**20 * 0.9
        assert "stream" in status["plan"]["reason"]
        (pod,) = await world.pods("m1")  # it asks for the host memory its pinned copies take, and got it
        assert quantity(pod["spec"]["containers"][0]["resources"]["requests"]["memory"]) >= \
            shard["offload"]["bytesPerStep"] > 2**30
        offloading = [e for e in await world.events("m1") if e[1] == "Offloading"]
        assert len(offloading) == 1 and "rank 0 streams" in offloading[0][2]

        await world.add_node(gpu_node("big", gpus=1, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"))
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 2)  # seen: the settle window starts
        world.clock.advance(1.0)
        await eventually(lambda: _on_nodes(world, "m1", {"big"}, ranks=1))
        status = await world.wait_phase("m1", "Ready")
        assert [s.get("offload") for s in status["shards"]] == [None]
    reasons = [e[1] for e in await world.events("m1")]
    assert reasons.count("FullyResident") == 1 and "Rebalancing" in reasons


async def test_the_rbac_table_is_exactly_what_the_operator_uses(world):
    """Every verb in permissions.py is used (and nothing else: the fixture checks every test)."""
    for n in ("a", "b"):
        await world.add_node(gpu_node(n))
    write_model(world.tmp / "pvc" / "tiny")
    body = sharded_model("m1", world.tmp / "unused" / "tiny", replicas=2)
    body["spec"]["model"] = {"path": "tiny", "volume": {"pvc": {"claimName": "weights"}}, "maxModelLen": 256}
    async with world.operator(network_policies=True):
        created = await world.create(body)  # a profiling pod (pods/log), then groups
        await world.wait_phase("m1", "Ready")
        await world.emu.k8s_patch("v1/services", "default", "m1", {"spec": {"selector": {"x": "y"}}})
        await world.emu.k8s_patch(NETPOL, "default", "m1-ranks",
                                  {"spec": {"podSelector": {"matchLabels": {"sharding.dev/model": "x"}}}})
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 1}})  # deletes a group
        await eventually(lambda: _pod_count(world, "m1", 2))
        await eventually(lambda: _selector_restored(world))
        policy = await eventually(lambda: _policy_restored(world))
    assert [r["uid"] for r in policy["metadata"]["ownerReferences"]] == [created["metadata"]["uid"]]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"sharding.dev/model": "m1"}}}]}]
    used: dict = {}
    for request in world.emu.api_requests():
        perm = permission_of(request)
        if perm is not None:
            used.setdefault(perm[0], set()).add(perm[1])
    expected = {key: set(verbs) for key, verbs in permissions(network_policies=True).items()
                if key != ("", "namespaces")}
    assert used == expected  # namespaces: only kopf's namespace patterns (SHARD_OPERATOR_NAMESPACES=a-*)


async def test_without_network_policies_the_operator_makes_none(world):
    await world.add_node(gpu_node("a"))
    async with world.operator():
        await world.create(sharded_model("m1", write_model(world.tmp / "models" / "tiny")))
        await world.wait_phase("m1", "Ready")
    assert await world.objects(NETPOL, "m1") == []
    asked = {perm[0] for perm in map(permission_of, world.emu.api_requests()) if perm is not None}
    assert ("networking.k8s.io", "networkpolicies") not in asked


async def _policy_restored(world):
    policy = await world.emu.k8s_get(NETPOL, "default", "m1-ranks")
    return policy if policy["spec"]["podSelector"] == {"matchLabels": {"sharding.dev/model": "m1"}} else None


async def _selector_restored(world):
    service = await world.emu.k8s_get("v1/services", "default", "m1")
    return service["spec"]["selector"] == {"sharding.dev/model": "m1", "sharding.dev/role": "leader"}


async def test_a_failed_profiling_pod_is_reported_and_kept(world):
    await world.add_node(gpu_node("a"))
    body = sharded_model("m1", world.tmp / "unused" / "tiny")
    body["spec"]["model"] = {"path": "absent", "volume": {"pvc": {"claimName": "weights"}}}
    async with world.operator() as op:
        await world.create(body)
        status = await world.wait_phase("m1", "Failed")
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidModel" and "profiling pod m1-profile failed" in degraded["message"]
    assert "config.json: missing" in degraded["message"]
    profilers = [p for p in await world.objects("v1/pods", "m1")
                 if p["metadata"]["labels"]["sharding.dev/component"] == "profiler"]
    assert len(profilers) == 1  # kept for `kubectl logs`, not recreated in a loop
    assert not await world.pods("m1")


async def test_the_operator_metrics_say_what_it_did_and_what_it_sees(world):
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator() as op:
        await world.create(sharded_model("good", model_dir))
        await world.create(sharded_model("bad", model_dir, tensor=3))
        await world.wait_phase("good", "Ready")
        await world.wait_phase("bad", "Failed")

        def seen():  # both statuses as the loops published them once their writes were answered
            scraped = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in scrape(op)}
            phases = [scraped[("shard_operator_models", (("phase", phase),))] for phase in ("Ready", "Failed")]
            return scraped if phases == [1, 1] else None
        samples = await eventually(seen)
        reconciles, created = op.reconciles, op.kube.calls["create"]
    assert samples[("shard_operator_models", (("phase", "Ready"),))] == 1
    assert samples[("shard_operator_models", (("phase", "Failed"),))] == 1
    assert samples[("shard_operator_models", (("phase", "Pending"),))] == 0
    assert samples[("shard_operator_replicas", (("model", "good"), ("namespace", "default")))] == 1
    assert samples[("shard_operator_ready_replicas", (("model", "good"), ("namespace", "default")))] == 1
    assert samples[("shard_operator_ready_replicas", (("model", "bad"), ("namespace", "default")))] == 0
    assert samples[("shard_operator_group_restarts",
                    (("group", "0"), ("model", "good"), ("namespace", "default")))] == 0
    assert samples[("shard_operator_degraded",
                    (("model", "good"), ("namespace", "default"), ("reason", "AsExpected")))] == 0
    assert samples[("shard_operator_degraded", (("model", "bad"), ("namespace", "default"),
                                                ("reason", "InvalidParallelism")))] == 1
    assert 0 < samples[("shard_operator_reconciles_total", ())] <= reconciles
    assert samples[("shard_operator_reconcile_failures_total", ())] == 0
    assert 0 < samples[("shard_operator_api_requests_total", (("verb", "create"),))] <= created
    assert samples[("shard_operator_reconcile_seconds_count", ())] >= 2


# ---------------------------------------------------------------- a faulty API server
# Of the requests: 8% fail (500), 30% of updates conflict (409), 4% time out (504) and 4% are slow
# (answered after the operator's 0.5 s timeout: both after the write landed); every second, each
# open watch is cut with a chance of 30%. About 30 faults in all over the scenario.
FAULTS = dict(seed=20260101, error=0.08, conflict=0.3, timeout=0.04, slow=0.04, drop_watch=0.3,
              delay=1.0, watch_life=1.0)


@contextlib.asynccontextmanager
async def _clock_running(clock, step=0.05):
    """The operator's clock moves as a real one does. Frozen, it made convergence depend on when the
    operator saw each change: the Degraded phase the test waited for before its one advance could be
    an injected 500's ReconcileError, seen before the node loss; the pool then changed after the
    clock's last move, never settled, and the lost group waited for ever (CI, once)."""
    async def run():
        while True:
            await asyncio.sleep(step)
            clock.advance(step)
    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()


async def test_the_operator_converges_while_the_api_server_fails_requests(world):
    """Nodes go and come and the model scales while the API server fails a fraction of requests
    (500, 409, 504 after the write, answers later than the client waits, cut watches): in the end
    exactly the planned objects exist, each once, owned and labelled, and the status says so."""
    for n in ("a", "b", "c"):
        await world.add_node(gpu_node(n))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator(api_timeout_seconds=0.5) as op, _clock_running(world.clock):
        await world.create(sharded_model("m1", model_dir, replicas=2))
        await world.wait_phase("m1", "Ready")
        world.emu.faults = Faults(**FAULTS)
        lost = next(iter(groups_of(await world.pods("m1"))[0]))
        await world.emu.k8s_delete("v1/nodes", None, lost)
        await eventually(lambda: _serving_without(world, "m1", lost, ready=2))  # group 0 moved once the pool settled
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 3}}, subresource="scale")
        await eventually(lambda: _degraded_serving(world, "m1", wanted=3, ready=2))  # 2 nodes left
        await world.add_node(gpu_node("d"))
        status = await eventually(lambda: _as_planned(world, "m1", op.settings, replicas=3), timeout=60)
        injected = dict(world.emu.faults.injected)
        world.emu.faults = None
        # A reconcile still in flight when the faults stopped may yet post what it had to say (an
        # Event whose first post timed out); count from when three have run since.
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)
        before, calls = await _uids(world, "m1"), (op.kube.calls["create"], op.kube.calls["delete"])
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)
        # Converged: nothing is created or deleted any more (a status write whose answer was lost
        # is written again), and the status still tells the truth.
        assert (await _uids(world, "m1"), (op.kube.calls["create"], op.kube.calls["delete"])) == (before, calls)
        status = await _as_planned(world, "m1", op.settings, replicas=3)
    assert sum(injected.values()) >= 10, injected  # (each kind alone: test_emulator_conformance.py)
    assert lost not in set().union(*groups_of(await world.pods("m1")).values())
    assert status["phase"] == "Ready" and (status["replicas"], status["readyReplicas"]) == (3, 3)
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "Available": ("True", "MinimumGroupsReady"), "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected")}


async def test_a_status_write_whose_answer_was_lost_is_written_whole_next_time(world):
    """A status write answered 504 may have landed: the next write must not be a difference from the
    status last known written, or a field that goes back to its value there is never corrected."""
    await world.add_node(gpu_node("a", gpus=4))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator() as op:
        await world.create(sharded_model("m1", model_dir, replicas=1))
        await world.wait_phase("m1", "Ready")
        world.emu.faults = Faults(timeout=1.0, delay=0.0, paths=r"/shardedmodels/m1/status$")
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 2}}, subresource="scale")
        await eventually(lambda: _ready_replicas(world, "m1", 2))  # written, though the operator saw 504s
        await world.emu.k8s_patch(SM, "default", "m1", {"spec": {"replicas": 1}}, subresource="scale")
        await eventually(lambda: _pod_count(world, "m1", 2))
        world.emu.faults = None
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)
    assert world.emu.faults is None and op.failures > 0
    status = await world.status("m1")
    assert (status["phase"], status["replicas"], status["readyReplicas"], len(status["groups"])) == ("Ready", 1, 1, 1)


async def test_a_failure_report_whose_answer_was_lost_is_corrected_once_the_api_heals(world):
    await world.add_node(gpu_node("a"))
    model_dir = write_model(world.tmp / "models" / "tiny")
    async with world.operator() as op:
        await world.create(sharded_model("m1", model_dir))
        await world.wait_phase("m1", "Ready")
        # ConfigMap lists fail (so does the reconcile), and its ReconcileError report lands but is answered 504.
        world.emu.faults = Faults(timeout=1.0, delay=0.0, paths=r"/configmaps$|/shardedmodels/m1/status$")

        async def reported():
            degraded = next(c for c in (await world.status("m1"))["conditions"] if c["type"] == "Degraded")
            return degraded["reason"] == "ReconcileError"
        await eventually(reported)
        world.emu.faults = None
        seen = op.reconciles
        await eventually(lambda: op.reconciles >= seen + 3)
    status = await world.status("m1")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (status["phase"], degraded["status"], degraded["reason"]) == ("Ready", "False", "AsExpected")


KINDS = ("v1/pods", "v1/services", "v1/configmaps", "v1/secrets")  # what a model's groups are made of


async def _uids(world, name):
    return {kind: uids(await world.objects(kind, name)) for kind in KINDS}


async def _serving_without(world, name, node, ready):
    groups = groups_of(await world.pods(name))
    return (await world.status(name)).get("readyReplicas") == ready and len(groups) == ready and \
        node not in set().union(*groups.values())


async def _as_planned(world, name, settings, replicas):
    """The status, once the objects are exactly those the plan record asks for (each once, owned
    by the model, labelled and shaped as the builders make them) and the status describes them;
    until then an AssertionError that says what differs (`eventually` reports the last one)."""
    model = await world.model(name)
    status = model.get("status") or {}
    record = await world.emu.k8s_get("v1/configmaps", "default", plan_record_name(name))
    assert record is not None, "no plan record"
    assert status.get("observedGeneration") == model["metadata"]["generation"], \
        ("status not of this generation", status.get("observedGeneration"), model["metadata"]["generation"])
    plan = Plan.from_json(record["data"][PLAN_KEY])
    ctx = Context(owner=Owner.of(model), spec=parse_spec(model["spec"]), default_image=settings.worker_image)
    desired = {(o["kind"], o["metadata"]["name"]): o for o in desired_objects(ctx, plan)}
    actual = {(o["kind"], o["metadata"]["name"]): o for kind in KINDS for o in await world.objects(kind, name)}
    assert len(plan.groups) == replicas, ("groups planned", len(plan.groups))
    assert actual.keys() == desired.keys(), ("missing", desired.keys() - actual.keys(), "extra",
                                             actual.keys() - desired.keys())
    for key, obj in actual.items():
        want = {**desired[key], "data": obj["data"]} if key[0] == "Secret" else desired[key]  # a random key
        assert obj["metadata"]["ownerReferences"] == want["metadata"]["ownerReferences"], key
        assert drift_patch(want, obj) is None, key  # labels, annotations, spec, data
    pods = [o for (kind, _), o in actual.items() if kind == "Pod"]
    groups = {(g["replica"], g["revision"], g["state"]) for g in status.get("groups", [])}
    pod_groups = {(int(p["metadata"]["labels"]["sharding.dev/group"]),
                   p["metadata"]["labels"]["sharding.dev/revision"], "Ready")
                  for p in pods}
    assert (status.get("phase"), status.get("readyReplicas")) == ("Ready", replicas), \
        (status.get("phase"), status.get("readyReplicas"), status.get("conditions"))
    assert status["plan"]["hash"] == plan.hash, ("status plan", status["plan"]["hash"], "record", plan.hash)
    assert len(status["shards"]) == len(pods), ("shards", len(status["shards"]), "pods", len(pods))
    assert groups == pod_groups, ("status groups", groups, "pods", pod_groups)
    return status
