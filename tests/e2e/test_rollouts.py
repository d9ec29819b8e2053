"""End to end on one machine: day-two rollouts (issue 26) while clients keep asking.

Each scenario edits a serving ShardedModel and counts the requests that failed meanwhile, with
clients that retry as OpenAI's SDKs do (harness.Traffic):
- surge: a new revision (maxModelLen) starts on the free node of the pool, beside the serving
  group, which goes once the new one is ready: no request fails;
- full: two groups on a pool of exactly two nodes are replaced one at a time (maxUnavailable 1)
  while the other serves: no request fails;
- solo: one group on a one-node pool cannot be replaced without going down: the rollout waits,
  saying so, until maxUnavailable 1 allows it; then it goes down and comes back (the failed
  requests are counted, not expected to be 0);
- refused: a spec the planner refuses leaves every serving pod as it was (same uids), Degraded says
  why, and nothing fails.

The model is the demo model at tensor=2 with `pipeline: auto` (one stage on these 200 MiB
"GPUs"), one node of two simulated GPUs per group. The scenarios pass in any order: each applies
its model and deletes it when it ends, pass or fail (the two cores are shared). Timings go to the
report (SHARD_E2E_REPORT).
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from shard_devcluster.cluster import sim_node

from .conftest import MODELS
from .harness import Harness, Traffic, complete, completion_body, tokens_of

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT = "The operator plans"
NODES = [*(sim_node(f"surge-{x}", pool="surge") for x in "ab"),
         *(sim_node(f"full-{x}", pool="full") for x in "ab"),
         sim_node("solo-a", pool="solo")]


def model_yaml(name: str, pool: str, replicas: int = 1, max_unavailable: int = 0) -> str:
    return yaml.safe_dump({
        "apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": name},
        "spec": {"model": {"path": "demo-llama", "volume": {"hostPath": {"path": "/" + MODELS}},
                           "dtype": "float32", "maxModelLen": 256},
                 "parallelism": {"tensor": 2, "pipeline": "auto"}, "replicas": replicas,
                 "placement": {"nodeSelector": {"sharding.dev/pool": pool}},
                 "rollout": {"maxSurge": 1, "maxUnavailable": max_unavailable},
                 "worker": {"rendezvousTimeoutSeconds": 120}}})


@pytest.fixture(scope="module")
def h(harness_for) -> Harness:
    return harness_for(NODES)


def uids(pods: list[dict]) -> set[str]:
    return {p["metadata"]["uid"] for p in pods}


def nodes_of(pods: list[dict]) -> set[str]:
    return {p["spec"].get("nodeName") for p in pods}


def patch(h: Harness, name: str, spec: dict) -> None:
    h.kubectl("patch", "shardedmodel", name, "--type", "merge", "-p", json.dumps({"spec": spec}))


def condition(h: Harness, name: str, type_: str) -> dict:
    return next((c for c in (h.model(name).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def event_reasons(h: Harness, name: str) -> list[str]:
    return [e.get("reason", "") for e in h.call(h.cluster.emu.k8s_list, "v1/events", "default")
            if (e.get("involvedObject") or {}).get("name") == name]


def serve(h: Harness, name: str, replicas: int = 1) -> tuple[str, dict, tuple]:
    """Wait until the applied model serves; its Service URL, a request and its tokens."""
    h.wait_ready(name, replicas)
    url = h.service_url(name)
    body = completion_body(PROMPT, model=name)
    return url, body, tokens_of(complete(url, body))


@pytest.fixture
def apply(h):
    """apply(name, pool, ...) applies a model of `model_yaml`; each is deleted when the scenario
    ends and its pods awaited, so the next scenario finds its pool and the CPU free."""
    applied: list[str] = []

    def apply_model(name: str, pool: str, **kwargs) -> None:
        h.kubectl("apply", "-f", "-", stdin=model_yaml(name, pool, **kwargs))
        applied.append(name)
    yield apply_model
    for name in applied:
        if h.model(name):
            h.kubectl("delete", "shardedmodel", name)
        h.wait(f"{name}'s pods gone", lambda: not h.pods(name), timeout=120)


def test_a_new_revision_surges_onto_the_free_node_and_no_request_fails(h, apply, report):
    apply("surge", "surge")
    url, body, expected = serve(h, "surge")
    old = h.pods("surge")
    (serving_node,) = nodes_of(old)
    (free_node,) = {"surge-a", "surge-b"} - {serving_node}
    with Traffic(url, body, expected, clients=2) as traffic:
        traffic.wait_for(4)
        start = time.monotonic()
        patch(h, "surge", {"model": {"maxModelLen": 200}})
        h.wait("the new revision's pods on the free node", lambda: free_node in nodes_of(h.pods("surge")),
               timeout=60, interval=0.1)
        surged = time.monotonic()
        h.wait("the old group gone and the new one serving", lambda: nodes_of(h.pods("surge")) == {free_node}
               and not uids(h.pods("surge")) & uids(old) and h.ready("surge", 1), timeout=240)
        done = time.monotonic()
        traffic.wait_for(4)
    window = traffic.during(start, done)
    report.add("rollout_surge_onto_free_node", model="surge (tensor=2, maxModelLen 256 -> 200)",
               seconds_to_new_pods=round(surged - start, 1), seconds=round(done - start, 1),
               traffic=traffic.summary(window))
    assert "Blocked" not in event_reasons(h, "surge")  # it never waited for room
    assert traffic.failures() == [], traffic.summary()
    assert window


def test_a_full_pool_replaces_one_group_at_a_time_while_the_other_serves(h, apply, report):
    apply("full", "full", replicas=2, max_unavailable=1)
    url, body, expected = serve(h, "full", replicas=2)
    old = {g: uids(h.pods("full", group=str(g))) for g in (0, 1)}
    assert nodes_of(h.pods("full")) == {"full-a", "full-b"}  # no node spare
    ready_groups_seen: list[int] = []
    with Traffic(url, body, expected, clients=2) as traffic:
        traffic.wait_for(4)
        start = time.monotonic()
        patch(h, "full", {"model": {"maxModelLen": 200}})

        def progress() -> bool:
            status = h.model("full").get("status") or {}
            ready_groups_seen.append(status.get("readyReplicas", 0))
            pods = h.pods("full")
            return not uids(pods) & (old[0] | old[1]) and len(pods) == 4 and bool(h.ready("full", 2))
        h.wait("both groups replaced and serving", progress, timeout=420, interval=0.25)
        done = time.monotonic()
        traffic.wait_for(4)
    window = traffic.during(start, done)
    report.add("rollout_full_pool_one_group_at_a_time", model="full (2 replicas of tensor=2 on 2 nodes)",
               seconds=round(done - start, 1), fewest_ready_groups=min(ready_groups_seen),
               traffic=traffic.summary(window))
    assert min(ready_groups_seen) >= 1  # one group served throughout
    assert nodes_of(h.pods("full")) == {"full-a", "full-b"}
    assert traffic.failures() == [], traffic.summary()


def test_a_single_group_on_a_full_pool_says_it_must_go_down_and_does_only_when_allowed(h, apply, report):
    apply("solo", "solo")
    url, body, expected = serve(h, "solo")
    before = uids(h.pods("solo"))
    patch(h, "solo", {"model": {"maxModelLen": 200}})
    blocked = h.wait("the rollout waits, saying why", lambda: (c := condition(h, "solo", "Progressing"))
                     and c.get("reason") == "Blocked" and c, timeout=60)
    assert "replacing it in place takes the model down (no other group serves)" in blocked["message"]
    assert "spec.rollout.maxUnavailable 1 allows that" in blocked["message"]
    assert uids(h.pods("solo")) == before  # still the same pods, serving
    assert complete(url, body).status_code == 200
    with Traffic(url, body, expected, clients=1) as traffic:
        traffic.wait_for(2)
        start = time.monotonic()
        patch(h, "solo", {"rollout": {"maxUnavailable": 1}})
        h.wait("replaced in place and serving", lambda: h.pods("solo") and not uids(h.pods("solo")) & before
               and h.ready("solo", 1), timeout=240)
        done = time.monotonic()
        h.wait("served again", lambda: any(r.ok and r.start >= done for r in traffic.results), timeout=120)
    window = traffic.during(start, done)
    report.add("rollout_single_group_in_place", model="solo (tensor=2 on its only node)",
               seconds=round(done - start, 1), traffic=traffic.summary(window))
    assert traffic.results[-1].ok


def group_events(h: Harness, name: str) -> list[str]:
    return [e.get("message", "") for e in h.call(h.cluster.emu.k8s_list, "v1/events", "default")
            if (e.get("involvedObject") or {}).get("name") == name
            and e.get("reason") in ("CreatingGroup", "DeletingGroup", "RecreatingGroup")]


def test_a_spec_the_planner_refuses_leaves_every_serving_pod_as_it_was(h, apply, report):
    apply("solo", "solo")
    url, body, expected = serve(h, "solo")
    before, events_before = uids(h.pods("solo")), group_events(h, "solo")
    with Traffic(url, body, expected, clients=1) as traffic:
        traffic.wait_for(2)
        patch(h, "solo", {"placement": {"memoryHeadroom": 0.999}, "worker": {"image": "localhost/other:2"}})
        generation = h.model("solo")["metadata"]["generation"]
        degraded = h.wait("Degraded says why, for this generation", lambda: (c := condition(h, "solo", "Degraded")).get(
            "reason") == "InsufficientCapacity" and c.get("observedGeneration") == generation and c, timeout=60)
        traffic.wait_for(6)  # several reconciles later
    assert "does not fit" in degraded["message"]
    assert uids(h.pods("solo")) == before  # not one pod replaced
    assert "localhost/other:2" not in {p["spec"]["containers"][0]["image"] for p in h.pods("solo")}
    assert group_events(h, "solo") == events_before  # no group created, deleted or recreated
    report.add("refused_spec_touches_nothing", model="solo", traffic=traffic.summary())
    assert traffic.failures() == [], traffic.summary()
