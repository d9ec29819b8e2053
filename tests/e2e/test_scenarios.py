"""End to end on one machine: `kubectl apply` to served tokens, and a sharded model that keeps
serving while its nodes come and go.

The real chain runs: kubectl -> the emulated API server and its control plane (the scheduler binds
pods, graceful deletion waits for the kubelet, the pod GC keeps a deleted node's pods for the real
40 s) -> the operator process (`python -m shard_operator`) -> pods -> the process kubelet ->
`python -m shard_worker` ranks (gloo on CPU) -> Ready -> completions through the model's Service
(the dev cluster's proxy, which routes to the ready endpoints of its EndpointSlices). The model is
the demo model (196 MiB of float32 weights); every node has two simulated GPUs of 200 MiB, which
the workers enforce.

The scenarios share one cluster, each with its own ShardedModel and node pool: demo (the example,
pool dev: scenarios 1, 1b and 4), twin (pool twin: 5 and 2), grow (pool grow: 3), block (the
example's plan in a pod per tensor-parallel group, pool block: 1b). They pass in any order (`make
test` runs them in file order; `-p random_order --random-order-bucket=module` shuffles them): each
applies the models it needs and deletes them when it ends (the two cores are shared), and one that
deletes a node leaves what the others need (the twin pool has a spare node for scenario 2 in
either order).
Timings go to the report (SHARD_E2E_REPORT=FILE writes them; docs/benchmarks.md "End to end").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from shard_devcluster.cluster import default_nodes, sim_node
from shard_operator.api import load_sharded_models
from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import inventory_from_nodes, load_nodes
from shard_operator.planning.profile import profile_model
from tests.support.k8s_binaries import rows

from .conftest import MODELS
from .harness import Harness, Traffic, complete, completion_body, tokens_of

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dev-cluster" / "shardedmodel.yaml"
EXAMPLE_NODES = ROOT / "examples" / "dev-cluster" / "nodes.yaml"
BUDGET = 200 * 2**20  # every simulated GPU here
PROMPT = "The operator plans"

# grow-slow streams weights at 0.02 TB/s, grow-fast (added in scenario 3) at 2 TB/s: the planner's
# decode-step estimate on CPU-backed devices is mostly collective latency, so only a big difference
# in speed passes the operator's 10% improvement threshold.
NODES = [*default_nodes(),
         *(sim_node(f"twin-{x}", pool="twin") for x in "abc"),
         sim_node("grow-slow", pool="grow", speed=0.02),
         *(sim_node(f"block-{x}", pool="block") for x in "ab")]


def model_yaml(name: str, pool: str, replicas: int = 1) -> str:
    """A ShardedModel of the demo checkpoint at tensor=2 on one node of `pool`."""
    return yaml.safe_dump({
        "apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": name},
        "spec": {"model": {"path": "demo-llama", "volume": {"hostPath": {"path": "/" + MODELS}},
                           "dtype": "float32", "maxModelLen": 256},
                 "parallelism": {"tensor": 2, "pipeline": 1}, "replicas": replicas,
                 "placement": {"nodeSelector": {"sharding.dev/pool": pool}},
                 "worker": {"rendezvousTimeoutSeconds": 120}}})


@pytest.fixture(scope="module")
def h(harness_for) -> Harness:
    return harness_for(NODES)


def applied(h: Harness, name: str, manifest: str | Path, replicas: int = 1) -> float:
    """Apply a ShardedModel unless it exists; seconds from `kubectl apply` to Ready (0 if it existed:
    then Ready with the replicas it has, which another scenario may have scaled)."""
    if existing := h.model(name):
        h.wait_ready(name, existing["spec"]["replicas"])
        return 0.0
    start = time.monotonic()
    if isinstance(manifest, Path):
        h.kubectl("apply", "-f", str(manifest))
    else:
        h.kubectl("apply", "-f", "-", stdin=manifest)
    h.wait_ready(name, replicas)
    return time.monotonic() - start


def uids(pods: list[dict]) -> set[str]:
    return {p["metadata"]["uid"] for p in pods}


def pod_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def nodes_of(pods: list[dict]) -> set[str]:
    return {p["spec"].get("nodeName") for p in pods}


def events(h: Harness, name: str) -> list[tuple[str, str]]:
    items = h.call(h.cluster.emu.k8s_list, "v1/events", "default")
    return [(e.get("reason"),
             e.get("message", "")) for e in items if (e.get("involvedObject") or {}).get("name") == name]


def removed(h: Harness, name: str) -> None:
    """Delete a ShardedModel (if it is there) and wait for its pods to go: the two cores are shared,
    so each scenario leaves the next one the machine it found."""
    if h.model(name):
        h.kubectl("delete", "shardedmodel", name)
    h.wait(f"{name}'s pods gone", lambda: not h.pods(name), timeout=120)


@pytest.fixture
def demo(h, report):
    seconds = applied(h, "demo", EXAMPLE)
    if seconds:
        report.add("apply_to_ready", model="demo (tensor=2 x pipeline=2, 4 ranks)", seconds=round(seconds, 1))
    yield seconds
    removed(h, "demo")


# ---------------------------------------------------------------- 1
def test_1_kubectl_apply_the_example_serves_the_tokens_of_shardctl_generate(h, demo, tmp_path):
    model_dir = h.cluster.host_root / MODELS / "demo-llama"
    # The model fits no single simulated GPU of the example's nodes (the nodes of this cluster).
    (example,) = load_sharded_models(str(EXAMPLE))
    alone = example.spec.model_copy(update={"parallelism": example.spec.parallelism.model_copy(
        update={"tensor": 1, "pipeline": 1})})
    with pytest.raises(PlanError) as err:
        plan(profile_model(model_dir), alone, inventory_from_nodes(load_nodes(EXAMPLE_NODES), example.spec.placement))
    assert err.value.reason == "InsufficientCapacity"
    assert yaml.safe_load(EXAMPLE_NODES.read_text())["items"] == default_nodes()  # what dev-cluster starts with

    # Ready, with every shard's memory measured by its worker and within the plan and the device.
    status = h.wait("measured memory of every shard", lambda: (s := h.ready("demo", 1)) and
                    all(x.get("residentBytes") for x in s["shards"]) and s)
    assert (status["plan"]["tensorParallel"], status["plan"]["pipelineParallel"]) == (2, 2)
    pods = h.pods("demo")
    assert len(pods) == 4 and nodes_of(pods) == {"sim-a", "sim-b"}
    for shard in status["shards"]:
        assert shard["state"] == "Ready"
        assert 40 * 2**20 < shard["residentBytes"] <= shard["predictedBytes"] <= BUDGET, shard
    (columns,) = rows(h.kubectl("get", "shardedmodels", "demo"))
    assert (columns["PHASE"], columns["TP"], columns["PP"], columns["READY"]) == ("Ready", "2", "2", "1/1")
    assert columns["URL"] == "http://demo.default.svc:8000"

    # A completion through the model's Service: the tokens of `shardctl generate` on the same files.
    served = complete(h.service_url("demo"), completion_body(PROMPT, max_tokens=8))
    assert served.status_code == 200, served.text
    generated = subprocess.run(
        [sys.executable, "-m", "shard_operator.cli", "generate", "--model-dir", str(model_dir), "--tensor", "2",
         "--pipeline", "2",
         "--prompt", PROMPT, "--max-tokens", "8", "--threads", "1", "--json"],
        capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr
    result = json.loads(generated.stdout)
    choice = served.json()["choices"][0]
    assert choice["text"] == result["text"]
    assert tokens_of(served) == tuple(result["token_ids"])
    # The model's URL (its row's URL column), as a pod would call it, through the cluster network's proxy.
    proxied = httpx.post(columns["URL"] + "/v1/completions", json=completion_body(PROMPT, max_tokens=8),
                         proxy=h.cluster.gateway.url, timeout=120)
    assert proxied.status_code == 200 and tokens_of(proxied) == tokens_of(served)

    # `shardctl status demo`: the status table, with the leader's time shares and measured decode
    # step read through the API server's pod proxy (the emulator's, to the leader pod's IP).
    shown = subprocess.run([sys.executable, "-m", "shard_operator.cli", "status", "demo"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "KUBECONFIG": str(h.cluster.kubeconfig)})
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    ranks = [dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=False)) for line in lines[2:6]]
    assert [r["rank"] for r in ranks] == ["0", "1", "2", "3"]
    for r in ranks:
        assert all(r[k].endswith("%") for k in ("compute", "comm", "idle")) and r["capacity MiB"] == "200.00", r
        assert 99 <= sum(int(r[k][:-1]) for k in ("compute", "comm", "idle")) <= 101, r
    assert re.search(r"measured \d+\.\d\d ms \(the latest batch\)", shown.stdout), shown.stdout
    assert "time shares" not in shown.stdout, shown.stdout


# ---------------------------------------------------------------- 1b
def test_1b_a_pod_per_tensor_parallel_group_serves_the_tokens_of_a_pod_per_rank(h, demo, report):
    """The example's plan (tensor=2 x pipeline=2) in the perTensorGroup layout: a pod per stage,
    each holding its node's two GPUs and running two rank processes (`python -m
    shard_worker.launch`); it answers with the tokens of demo's four pods of one rank."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = "block"
    manifest["spec"]["placement"] = {"nodeSelector": {"sharding.dev/pool": "block"}, "podLayout": "perTensorGroup"}
    seconds = applied(h, "block", yaml.safe_dump(manifest))
    report.add("apply_to_ready_pod_per_tensor_group", model="block (tensor=2 x pipeline=2, 2 pods of 2 ranks)",
               seconds=round(seconds, 1))
    pods = h.pods("block")
    assert len(pods) == 2 and nodes_of(pods) == {"block-a", "block-b"}
    for pod in pods:
        assert pod["metadata"]["labels"]["sharding.dev/ranks"] == "2"
        assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "shard_worker.launch", "--local-ranks", "2"]
        for port in (8000, 8001):  # each rank of the pod serves on its own port, and knows the group
            # (the pod's probe asks its first rank; the second reads the group's records a beat later)
            url = f"http://{h.cluster.network.local(pod['status']['podIP'])}:{port}/ready"
            h.wait(f"{url} ready", lambda: httpx.get(url, timeout=10).status_code == 200, timeout=30)
    status = h.wait("measured memory of every rank", lambda: (s := h.ready("block", 1)) and
                    all(x.get("residentBytes") for x in s["shards"]) and s)
    names = [p["metadata"]["name"] for p in pods]
    assert [(s["rank"], s["pod"], s["state"]) for s in status["shards"]] == \
        [(0, names[0], "Ready"), (1, names[0], "Ready"), (2, names[1], "Ready"), (3, names[1], "Ready")]

    per_group = complete(h.service_url("block"), completion_body(PROMPT, max_tokens=8, model="block"))
    per_rank = complete(h.service_url("demo"), completion_body(PROMPT, max_tokens=8))
    assert per_group.status_code == per_rank.status_code == 200, (per_group.text, per_rank.text)
    assert tokens_of(per_group) == tokens_of(per_rank)
    removed(h, "block")


# ---------------------------------------------------------------- 4
def test_4_a_killed_rank_process_gets_its_group_recreated(h, demo, report):
    url = h.service_url("demo")
    body = completion_body(PROMPT)
    expected = tokens_of(complete(url, body))
    before = h.pods("demo")
    victim = before[3]["metadata"]["name"]  # a rank of the last stage
    with Traffic(url, body, expected, clients=1) as traffic:
        traffic.wait_for(2)
        killed = time.monotonic()
        h.call(h.cluster.kubelet.kill, "default", victim, signal.SIGKILL)
        h.wait("the group recreated", lambda: not (uids(h.pods("demo")) & uids(before)) and len(h.pods("demo")) == 4,
               timeout=120, interval=0.05)
        recreated = time.monotonic()
        h.wait("the new group Ready", lambda: h.ready("demo", 1) and all(map(pod_ready, h.pods("demo"))))
        ready = time.monotonic()
        h.wait("served again", lambda: any(r.ok and r.start >= ready for r in traffic.results), timeout=60)
        traffic.wait_for(1)
    served_again = min(r.end for r in traffic.results if r.ok and r.start >= ready)
    reasons = [reason for reason, _ in events(h, "demo")]
    assert "RecreatingGroup" in reasons
    recreating = next(message for reason, message in events(h, "demo") if reason == "RecreatingGroup")
    assert victim in recreating and "exit code -9" in recreating
    window = traffic.during(killed, served_again)
    report.add("killed_rank_recovery", model="demo (4 ranks, 1 replica)",
               seconds_to_new_pods=round(recreated - killed, 1), seconds_to_ready=round(ready - killed, 1),
               seconds_to_served=round(served_again - killed, 1), traffic=traffic.summary(window),
               proxy_retries=h.cluster.proxy.stats.retried)
    assert traffic.results[-1].ok


# ---------------------------------------------------------------- 5
@pytest.fixture
def twin(h):
    applied(h, "twin", model_yaml("twin", "twin"))
    yield "twin"
    removed(h, "twin")


def test_5_kubectl_scale_adds_a_second_group_that_serves(h, twin, report):
    url = h.service_url("twin")
    body = completion_body(PROMPT, model="twin")
    expected = tokens_of(complete(url, body))
    first = h.pods("twin")
    start = time.monotonic()
    h.kubectl("scale", "shardedmodel/twin", "--replicas=2")
    h.wait_ready("twin", 2)
    report.add("scale_1_to_2", model="twin (tensor=2)", seconds_to_ready=round(time.monotonic() - start, 1))
    pods = h.pods("twin")
    assert uids(first) <= uids(pods) and len(pods) == 4  # group 0 untouched
    leaders = h.pods("twin", role="leader")
    assert len(leaders) == 2 and len(nodes_of(leaders)) == 2  # replicas spread over nodes
    # Both leaders answer, directly and through the Service.
    for leader in leaders:
        direct = complete(f"http://{h.cluster.network.local(leader['status']['podIP'])}:8000", body)
        assert direct.status_code == 200 and tokens_of(direct) == expected
    served_by = set()
    for _ in range(8):
        r = complete(url, body)
        assert r.status_code == 200 and tokens_of(r) == expected
        served_by.add(r.headers["x-upstream-pod"])
    assert served_by == {leader["metadata"]["name"] for leader in leaders}


# ---------------------------------------------------------------- 2
def test_2_a_removed_node_replans_its_group_while_the_other_keeps_serving(h, twin, report):
    if h.model("twin")["spec"]["replicas"] != 2:
        h.kubectl("scale", "shardedmodel/twin", "--replicas=2")
    h.wait_ready("twin", 2)
    url = h.service_url("twin")
    body = completion_body(PROMPT, model="twin")
    expected = tokens_of(complete(url, body))
    group0, group1 = h.pods("twin", group="0"), h.pods("twin", group="1")
    (lost_node,) = nodes_of(group0)
    (spare,) = {"twin-a", "twin-b", "twin-c"} - nodes_of(group0) - nodes_of(group1)
    retries = h.cluster.proxy.stats.retried
    with Traffic(url, body, expected, clients=2) as traffic:
        traffic.wait_for(4)
        removed = time.monotonic()
        h.kubectl("delete", "node", lost_node)
        h.wait("group 0 re-planned onto the spare node", lambda: spare in nodes_of(h.pods("twin", group="0")),
               timeout=120, interval=0.05)
        planned = time.monotonic()
        h.wait("group 0 Ready on the spare node", lambda: nodes_of(h.pods("twin", group="0")) == {spare}
               and h.ready("twin", 2), timeout=180)
        replaced = time.monotonic()
        traffic.wait_for(4)
    # Ready as soon as the new group served: the lost pods did not wait out the pod GC's 40 s
    # quarantine, the operator deleted them with grace 0.
    assert h.cluster.control_plane.pod_gc.deleted == 0 and not (uids(h.pods("twin")) & uids(group0))
    assert uids(h.pods("twin", group="1")) == uids(group1)  # the other group was never touched
    window = traffic.during(removed, replaced)
    served = {r.pod for r in traffic.results if r.start > replaced}
    report.add("node_removed_replan", model="twin (2 replicas of tensor=2)",
               seconds_to_new_pods=round(planned - removed, 1), seconds=round(replaced - removed, 1),
               traffic=traffic.summary(window), proxy_retries=h.cluster.proxy.stats.retried - retries)
    assert traffic.failures() == [], traffic.summary()
    assert window and served  # requests ran throughout, and after it


# ---------------------------------------------------------------- 3
def test_3_an_added_node_surges_a_better_plan_moves_traffic_and_drains_the_old_group(h, report):
    applied(h, "grow", model_yaml("grow", "grow"))
    url = h.service_url("grow")
    body = completion_body(PROMPT, model="grow")
    expected = tokens_of(complete(url, body))
    old = h.pods("grow")
    assert nodes_of(old) == {"grow-slow"}
    old_leader = next(p["metadata"]["name"] for p in old if p["metadata"]["labels"]["sharding.dev/rank"] == "0")
    retries = h.cluster.proxy.stats.retried
    with Traffic(url, body, expected, clients=2) as traffic:
        traffic.wait_for(4)
        added = time.monotonic()
        h.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(sim_node("grow-fast", pool="grow", speed=2.0)))
        h.wait("a group surged on the faster node", lambda: "grow-fast" in nodes_of(h.pods("grow")),
               timeout=120, interval=0.05)
        surged = time.monotonic()
        h.wait("the group moved to the faster node", lambda: nodes_of(h.pods("grow")) == {"grow-fast"}
               and h.ready("grow", 1), timeout=180)
        moved = time.monotonic()
        traffic.wait_for(4)
    new_leader = h.pods("grow", role="leader")[0]["metadata"]["name"]
    reasons = [reason for reason, _ in events(h, "grow")]
    assert "Rebalancing" in reasons and "DeletingGroup" in reasons
    window = traffic.during(added, moved)
    report.add("node_added_rebalance", model="grow (tensor=2, slow node -> fast node)",
               seconds_to_new_pods=round(surged - added, 1), seconds=round(moved - added, 1),
               traffic=traffic.summary(window), proxy_retries=h.cluster.proxy.stats.retried - retries)
    assert traffic.failures() == [], traffic.summary()
    served_by = {r.pod for r in traffic.results}
    assert {old_leader, new_leader} <= served_by  # traffic moved from the old group to the new one
    assert all(r.pod == new_leader for r in traffic.results if r.start > moved)
    removed(h, "grow")
