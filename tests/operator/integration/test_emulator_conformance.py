"""Conformance of the emulated API server: raw HTTP probes of the API-server behaviour that kopf,
the `kubernetes` client, kubectl and the dev cluster's kubelet rely on (shard_devcluster/emulator.py
lists them); each test says what a real kube-apiserver does. Its control plane (scheduler,
controllers) is probed in test_control_plane.py."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import aiohttp.web
import pytest

from shard_devcluster.apirules import Faults
from shard_devcluster.apiserver import serve
from shard_devcluster.kubeletserver import KubeletServer, LogBuffer
from tests.support.operator import eventually

NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"
SMS = f"/apis/sharding.dev/v1alpha1/namespaces/{NS}/shardedmodels"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
SMP = {"Content-Type": "application/strategic-merge-patch+json"}


def pod(name, labels=None, **meta):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}, **meta},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def sm(name="m1", replicas=2):
    return {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "metadata": {"name": name},
            "spec": {"model": {"path": "x"}, "replicas": replicas}, "status": {"phase": "Bogus"}}


class Api:
    def __init__(self, session: aiohttp.ClientSession):
        self.s = session

    async def __call__(self, method, url, **kw):
        async with self.s.request(method, url, **kw) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def watch(self, url, seconds=60.0, headers=None, count=None, until=None):
        """The watch's events until `count` of them are not bookmarks, or `until(events)` holds; a
        generous `seconds` bounds the wait (what came by then is returned, for the test to judge)."""
        events = []
        try:
            async with self.s.get(url, timeout=aiohttp.ClientTimeout(total=seconds), headers=headers) as r:
                async for line in r.content:
                    if line.strip():
                        e = json.loads(line)
                        events.append((e["type"], e["object"].get("metadata", {}).get("name"), e["object"]))
                        if count is not None and sum(t != "BOOKMARK" for t, _, _ in events) >= count:
                            break
                        if until is not None and until(events):
                            break
        except (TimeoutError, aiohttp.ClientPayloadError):
            pass
        return events


@pytest.fixture
async def api():
    async with serve(control_plane=False, bookmark_interval=0.1, check_namespaces=True) as (_, url):
        async with aiohttp.ClientSession(base_url=url) as session:
            yield Api(session)


def names(items):
    return sorted(i["metadata"]["name"] for i in items)


async def test_create_populates_metadata_and_rejects_duplicates(api):
    st, b = await api("POST", PODS, json=pod("p1"))
    assert st == 201
    assert {"uid", "resourceVersion", "creationTimestamp", "namespace"} <= set(b["metadata"])
    st, b = await api("POST", PODS, json=pod("", generateName="gen-"))
    assert st == 201 and b["metadata"]["name"].startswith("gen-") and len(b["metadata"]["name"]) > 4
    st, b = await api("POST", PODS, json=pod("p1"))
    assert (st, b["reason"]) == (409, "AlreadyExists")


async def test_label_and_field_selectors_on_list_and_watch(api):
    for name, labels in (("p1", {"app": "a", "tier": "x"}), ("p2", {"app": "b"}), ("p3", {"app": "a", "tier": "y"})):
        await api("POST", PODS, json=pod(name, labels))
    for sel, expected in [("app=a", ["p1", "p3"]), ("app!=a", ["p2"]), ("app in (a,b),tier=x", ["p1"]),
                          ("tier", ["p1", "p3"]), ("!tier", ["p2"])]:
        _, b = await api("GET", PODS, params={"labelSelector": sel})
        assert names(b["items"]) == expected, sel
    _, b = await api("GET", PODS, params={"fieldSelector": "metadata.name=p2"})
    assert names(b["items"]) == ["p2"]
    events = await api.watch(f"{PODS}?watch=true&labelSelector=app%3Db", count=1)
    assert {n for _, n, _ in events} == {"p2"}


async def test_lists_carry_kind_version_and_pages(api):
    for name in ("p1", "p2"):
        await api("POST", PODS, json=pod(name))
    _, b = await api("GET", PODS)
    assert b["kind"] == "PodList" and b["metadata"]["resourceVersion"]
    _, b = await api("GET", PODS, params={"limit": "1"})
    assert len(b["items"]) == 1 and b["metadata"]["continue"]
    _, b2 = await api("GET", PODS, params={"limit": "1", "continue": b["metadata"]["continue"]})
    assert names(b["items"] + b2["items"]) == ["p1", "p2"]


async def test_resource_versions_and_optimistic_concurrency(api):
    st, b = await api("POST", PODS, json=pod("p1"))
    rv0 = b["metadata"]["resourceVersion"]
    st, b = await api("PATCH", f"{PODS}/p1", json={"metadata": {"labels": {"x": "1"}}}, headers=MERGE)
    assert b["metadata"]["resourceVersion"] != rv0
    st, _ = await api("PATCH", f"{PODS}/p1", json={"metadata": {"resourceVersion": rv0, "labels": {"y": "1"}}},
                      headers=MERGE)
    assert st == 409
    st, current = await api("GET", f"{PODS}/p1")
    stale = {**current, "metadata": {**current["metadata"], "resourceVersion": "1"}}
    st, _ = await api("PUT", f"{PODS}/p1", json=stale)
    assert st == 409
    fresh = {**current, "metadata": {**current["metadata"], "labels": {"replaced": "yes"}}}
    st, b = await api("PUT", f"{PODS}/p1", json=fresh)
    assert st == 200 and b["metadata"]["labels"] == {"replaced": "yes"}


async def test_patch_flavours(api):
    await api("POST", PODS, json=pod("p1", {"app": "a"}))
    st, b = await api("PATCH", f"{PODS}/p1", json={"metadata": {"labels": {"app": None, "new": "n"}}}, headers=MERGE)
    assert b["metadata"]["labels"] == {"new": "n"}
    deployments = f"/apis/apps/v1/namespaces/{NS}/deployments"
    template = {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    await api("POST", deployments, json={"metadata": {"name": "d"}, "spec": {"template": template}})
    st, b = await api("PATCH", f"{deployments}/d", json={"spec": {"template": {"spec": {"containers": [
        {"name": "sidecar", "image": "x"}]}}}}, headers=SMP)
    assert sorted(c["name"] for c in b["spec"]["template"]["spec"]["containers"]) == ["c", "sidecar"]
    st, b = await api("PATCH", f"{PODS}/p1", json=[{"op": "add", "path": "/metadata/annotations", "value": {"a": "b"}}],
                      headers=JSON_PATCH)
    assert st == 200 and b["metadata"]["annotations"] == {"a": "b"}
    st, _ = await api("PATCH", f"{PODS}/p1", json=[{"op": "test", "path": "/metadata/resourceVersion", "value": "no"}],
                      headers=JSON_PATCH)
    assert st == 422  # kopf's finalizer patches start with this test
    st, _ = await api("PATCH", f"{PODS}/absent", json={"metadata": {}}, headers=MERGE)
    assert st == 404
    st, b = await api("PATCH", f"/api/v1/namespaces/{NS}/configmaps/cm?fieldManager=t&force=true",
                      data="apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm\ndata:\n  k: v\n",
                      headers={"Content-Type": "application/apply-patch+yaml"})
    assert st in (200, 201) and b["data"] == {"k": "v"}
    await api("POST", SMS, json=sm())
    st, _ = await api("PATCH", f"{SMS}/m1", json={"spec": {"replicas": 1}}, headers=SMP)
    assert st == 415  # strategic merge is for built-in kinds only


async def test_secrets_as_the_api_server_stores_them(api):
    """stringData folds into base64 data, type defaults to Opaque, bad keys and base64 are refused,
    and an immutable Secret's data cannot change (a real kube-apiserver's Secret strategy)."""
    secrets = f"/api/v1/namespaces/{NS}/secrets"
    st, b = await api("POST", secrets, json={"metadata": {"name": "s"}, "data": {"a": "eA=="},
                                             "stringData": {"b": "y", "a": "z"}})
    assert st == 201 and b["data"] == {"a": "eg==", "b": "eQ=="} and "stringData" not in b and b["type"] == "Opaque"
    st, b = await api("POST", secrets, json={"metadata": {"name": "bad"}, "data": {"a": "not base64!"}})
    assert (st, b["reason"]) == (400, "BadRequest")
    st, b = await api("POST", secrets, json={"metadata": {"name": "bad"}, "data": {"a/b": "eA=="}})
    assert (st, b["reason"]) == (422, "Invalid") and "a valid config key" in b["message"]
    st, b = await api("PATCH", f"{secrets}/s", json={"type": "kubernetes.io/tls"}, headers=MERGE)
    assert st == 422 and "type: Invalid value" in b["message"]
    st, b = await api("POST", secrets, json={"metadata": {"name": "fixed"}, "immutable": True, "data": {"k": "eA=="}})
    assert st == 201
    st, b = await api("PATCH", f"{secrets}/fixed", json={"data": {"k": "eQ=="}}, headers=MERGE)
    assert st == 422 and "data: Forbidden: field is immutable when `immutable` is set" in b["message"]
    st, b = await api("PATCH", f"{secrets}/fixed", json={"metadata": {"labels": {"x": "1"}}}, headers=MERGE)
    assert st == 200 and b["data"] == {"k": "eA=="}  # its metadata may change
    st, _ = await api("DELETE", f"{secrets}/fixed")
    assert st == 200


async def test_custom_resource_generation_status_and_scale(api):
    st, b = await api("POST", SMS, json=sm())
    assert st == 201 and b.get("status") != {"phase": "Bogus"}  # status subresource: ignored on create
    g0 = b["metadata"]["generation"]
    st, b = await api("PATCH", f"{SMS}/m1", json={"spec": {"replicas": 3}}, headers=MERGE)
    g1 = b["metadata"]["generation"]
    st, b = await api("PATCH", f"{SMS}/m1", json={"metadata": {"labels": {"l": "1"}}}, headers=MERGE)
    assert (g0, g1, b["metadata"]["generation"]) == (1, 2, 2)
    st, b = await api("PATCH", f"{SMS}/m1/status", json={"spec": {"replicas": 99}, "status": {"phase": "Ready"}},
                      headers=MERGE)
    assert b["spec"]["replicas"] == 3 and b["status"]["phase"] == "Ready"
    st, b = await api("PATCH", f"{SMS}/m1", json={"status": {"phase": "Hacked"}}, headers=MERGE)
    assert b["status"]["phase"] == "Ready"
    st, b = await api("GET", f"{SMS}/m1/status")
    assert st == 200 and b["kind"] == "ShardedModel"
    st, b = await api("GET", f"{SMS}/m1/scale")
    assert b["kind"] == "Scale" and b["spec"]["replicas"] == 3
    st, b = await api("PATCH", f"{SMS}/m1/scale", json={"spec": {"replicas": 5}}, headers=MERGE)
    assert b["kind"] == "Scale"
    st, b = await api("GET", f"{SMS}/m1")
    assert b["spec"]["replicas"] == 5 and b["metadata"]["generation"] == 3


async def test_finalizers_and_deletion(api):
    await api("POST", PODS, json=pod("pf", finalizers=["x/y"]))
    await api("DELETE", f"{PODS}/pf")
    st, b = await api("GET", f"{PODS}/pf")
    assert st == 200 and b["metadata"]["deletionTimestamp"]
    st, _ = await api("PATCH", f"{PODS}/pf", json={"metadata": {"finalizers": ["x/y", "new/one"]}}, headers=MERGE)
    assert st == 422  # no new finalizers while deleting
    await api("PATCH", f"{PODS}/pf", json={"metadata": {"finalizers": None}}, headers=MERGE)
    st, _ = await api("GET", f"{PODS}/pf")
    assert st == 404
    await api("POST", PODS, json=pod("pf3"))
    await api("PATCH", f"{PODS}/pf3", json={"metadata": {"deletionTimestamp": "2020-01-01T00:00:00Z"}}, headers=MERGE)
    st, b = await api("GET", f"{PODS}/pf3")
    assert st == 200 and "deletionTimestamp" not in b["metadata"]  # clients cannot set it
    st, _ = await api("DELETE", PODS)
    assert st == 200
    st, b = await api("GET", PODS)
    assert b["items"] == []


async def test_owner_references_are_garbage_collected(api):
    st, owner = await api("POST", SMS, json=sm())
    ref = {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "name": "m1",
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    await api("POST", PODS, json=pod("child", ownerReferences=[ref]))
    await api("DELETE", f"{SMS}/m1")
    deadline = time.monotonic() + 60
    while (st := (await api("GET", f"{PODS}/child"))[0]) != 404 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the garbage collector deletes it in the background
    assert st == 404


async def test_an_object_created_with_only_absent_owners_is_garbage_collected(api):
    """What a kubelet does when it renews the Lease of a Node deleted a moment before (it has not
    seen the deletion yet): it creates the Lease again, owned by a Node that is gone. The garbage
    collector deletes it, as it deletes what a deleted owner held; a live owner keeps its own."""
    _, owner = await api("POST", SMS, json=sm())
    ref = {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel", "name": "m1", "controller": True}
    await api("POST", PODS, json=pod("kept", ownerReferences=[{**ref, "uid": owner["metadata"]["uid"]}]))
    await api("POST", PODS, json=pod("late", ownerReferences=[{**ref, "uid": "the-uid-of-a-deleted-owner"}]))

    async def collected():
        return (await api("GET", f"{PODS}/late"))[0] == 404
    await eventually(collected, timeout=60)
    assert (await api("GET", f"{PODS}/kept"))[0] == 200


async def test_watch_resumes_bookmarks_times_out_and_follows_selectors(api):
    _, b = await api("GET", PODS)
    events = await api.watch(f"{PODS}?watch=true&resourceVersion={b['metadata']['resourceVersion']}"
                             f"&allowWatchBookmarks=true", until=lambda ev: any(t == "BOOKMARK" for t, _, _ in ev))
    assert [t for t, _, _ in events if t != "BOOKMARK"] == [] and any(t == "BOOKMARK" for t, _, _ in events)
    # The server closes it after timeoutSeconds: the stream ends, long before the client would give up.
    async with api.s.get(f"{PODS}?watch=true&timeoutSeconds=1", timeout=aiohttp.ClientTimeout(total=60)) as r:
        async for _ in r.content:
            pass

    async def live(url, count):  # from the list's resourceVersion: nothing written after it is missed
        _, listed = await api("GET", PODS)
        return asyncio.create_task(api.watch(f"{url}&resourceVersion={listed['metadata']['resourceVersion']}",
                                             count=count))
    task = await live(f"{PODS}?watch=true", 3)
    await api("POST", PODS, json=pod("w1"))
    await api("PATCH", f"{PODS}/w1", json={"metadata": {"labels": {"q": "1"}}}, headers=MERGE)
    await api("DELETE", f"{PODS}/w1")
    events = await task
    assert [t for t, n, _ in events if n == "w1"] == ["ADDED", "MODIFIED", "DELETED"]
    assert all(o["metadata"]["resourceVersion"] for _, n, o in events if n == "w1")

    _, b = await api("GET", PODS)
    await api("POST", PODS, json=pod("missed"))
    events = await api.watch(f"{PODS}?watch=true&resourceVersion={b['metadata']['resourceVersion']}", count=1)
    assert [(t, n) for t, n, _ in events] == [("ADDED", "missed")]

    task = await live(f"{PODS}?watch=true&labelSelector=sel%3Dyes", 2)
    await api("POST", PODS, json=pod("relabel", {"sel": "yes"}))
    await api("PATCH", f"{PODS}/relabel", json={"metadata": {"labels": {"sel": "no"}}}, headers=MERGE)
    assert [(t, n) for t, n, _ in await task] == [("ADDED", "relabel"), ("DELETED", "relabel")]


async def test_scopes_namespaces_and_errors(api):
    st, b = await api("POST", "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
                                                      "status": {"allocatable": {"cpu": "1"}}})
    assert st == 201 and "namespace" not in b["metadata"] and b["status"]["allocatable"] == {"cpu": "1"}
    st, _ = await api("GET", f"/api/v1/namespaces/{NS}/nodes")
    assert st == 404
    st, _ = await api("POST", "/api/v1/pods", json=pod("nons"))
    assert st >= 400
    st, _ = await api("POST", "/api/v1/namespaces/nonexistent/pods", json=pod("ghost"))
    assert st == 404
    st, b = await api("GET", "/api/v1/namespaces")
    assert st == 200 and "default" in names(b["items"])
    await api("POST", "/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns2"}})
    st, b = await api("GET", "/api/v1/namespaces/ns2")
    assert st == 200 and b["metadata"]["name"] == "ns2"
    st, b = await api("GET", "/apis/nope.example.io/v1/widgets")
    assert st == 404 and b["kind"] == "Status"
    st, b = await api("GET", f"{PODS}/nonexistent")
    assert (st, b["reason"]) == (404, "NotFound")
    st, b = await api("GET", "/api/v1")
    assert b["groupVersion"] == "v1"


TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}


async def test_server_side_tables_for_every_kind_in_lists_gets_and_watches(api):
    """kube-apiserver answers `Accept: ...;as=Table` with the columns of its printer for the kind
    (pkg/printers/internalversion), a CRD's additionalPrinterColumns, else NAME and CREATED AT; in a
    watch, each event's object is a one-row Table (columns in the first event only), which is what
    makes `kubectl get -w` print whole rows."""
    await api("POST", SMS, json=sm())
    await api("PATCH", f"{SMS}/m1/status", json={"status": {"phase": "Ready", "ready": "2/2"}}, headers=MERGE)
    _, b = await api("GET", SMS, headers=TABLE)
    assert b["kind"] == "Table"
    assert [(c["name"], c["priority"]) for c in b["columnDefinitions"]] == [
        ("Name", 0), ("Phase", 0), ("TP", 0), ("PP", 0), ("Ready", 0), ("URL", 0), ("Reason", 0), ("Replicas", 1),
        ("Age", 0)]
    assert b["rows"][0]["cells"][:8] == ["m1", "Ready", None, None, "2/2", "", "", 2]
    await api("POST", f"/api/v1/namespaces/{NS}/services", json={"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80, "protocol": "TCP"}]}})
    _, b = await api("GET", f"/api/v1/namespaces/{NS}/services/web", headers=TABLE)
    cells = dict(zip([c["name"] for c in b["columnDefinitions"]], b["rows"][0]["cells"], strict=False))
    assert cells["Type"] == "ClusterIP" and cells["Cluster-IP"].startswith("10.") and cells["Port(s)"] == "80/TCP"
    assert cells["Selector"] == "app=web"
    await api("POST", f"/api/v1/namespaces/{NS}/events", json={"metadata": {"name": "e1"}, "type": "Warning",
                                                              "reason": "Boom", "message": "it broke",
                                                              "involvedObject": {"kind": "Pod", "name": "p1"}})
    _, b = await api("GET", f"/api/v1/namespaces/{NS}/events", headers=TABLE)
    columns = [c["name"] for c in b["columnDefinitions"] if c["priority"] == 0]
    assert columns == ["Last Seen", "Type", "Reason", "Object", "Message"]
    assert b["rows"][0]["cells"][1:4] == ["Warning", "Boom", "pod/p1"]
    _, b = await api("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles", headers=TABLE)
    assert [c["name"] for c in b["columnDefinitions"]] == ["Name", "Created At"]

    _, listed = await api("GET", PODS)
    task = asyncio.create_task(api.watch(f"{PODS}?watch=true&includeObject=Object&resourceVersion="
                                         f"{listed['metadata']['resourceVersion']}", headers=TABLE, count=2))
    await api("POST", PODS, json=pod("p1"))
    await api("PATCH", f"{PODS}/p1/status", json={"status": {"phase": "Running"}}, headers=MERGE)
    (kind1, _, first), (kind2, _, second) = await task
    assert (kind1, kind2, first["kind"], second["kind"]) == ("ADDED", "MODIFIED", "Table", "Table")
    assert [c["name"] for c in first["columnDefinitions"]][:5] == ["Name", "Ready", "Status", "Restarts", "Age"]
    assert second["columnDefinitions"] == [] and second["rows"][0]["cells"][:3] == ["p1", "0/1", "Running"]
    assert second["rows"][0]["object"]["kind"] == "Pod"


async def test_version_and_openapi_for_kubectl(api):
    """/version names a release within kubectl's supported skew (the tests' kubectl is v1.33);
    /openapi/v3 lists a document per group-version, in which a CRD's kind has its schema (what
    `kubectl explain` reads) and every write declares fieldValidation (so kubectl lets the server
    validate); /openapi/v2 answers in protobuf, as kubectl asks it to."""
    _, b = await api("GET", "/version")
    assert (b["major"], b["minor"], b["gitVersion"]) == ("1", "33", "v1.33.0")
    _, b = await api("GET", "/openapi/v3")
    url = b["paths"]["apis/sharding.dev/v1alpha1"]["serverRelativeURL"]
    _, doc = await api("GET", url)
    schema = doc["components"]["schemas"]["dev.sharding.v1alpha1.ShardedModel"]
    assert schema["x-kubernetes-group-version-kind"] == [{"group": "sharding.dev", "version": "v1alpha1",
                                                          "kind": "ShardedModel"}]
    assert "tensor" in schema["properties"]["spec"]["properties"]["parallelism"]["properties"]
    post = doc["paths"]["/apis/sharding.dev/v1alpha1/namespaces/{namespace}/shardedmodels"]["post"]
    assert {"name": "fieldValidation", "in": "query",
            "schema": {"type": "string", "uniqueItems": True}} in post["parameters"]
    async with api.s.get("/openapi/v2") as r:
        assert r.status == 200 and "protobuf" in r.headers["Content-Type"] and (await r.read()).startswith(b"\n\x032.0")


async def test_custom_resources_get_their_schema_defaults_and_lose_unknown_fields(api):
    """A CRD's structural schema prunes what it does not declare (unless
    x-kubernetes-preserve-unknown-fields) and fills in its defaults, on every write, spec and
    status alike; apiVersion, kind and metadata are the server's."""
    body = sm()
    body["spec"]["typo"] = 1
    body["spec"]["model"]["maxModelLenn"] = 4096
    st, b = await api("POST", SMS, json=body)
    assert st == 201 and "typo" not in b["spec"] and "maxModelLenn" not in b["spec"]["model"]
    assert b["spec"]["parallelism"] == {"tensor": "auto", "pipeline": "auto"}  # defaults, nested ones too
    assert b["spec"]["rollout"] == {"maxSurge": 1, "maxUnavailable": 0}
    st, b = await api("PATCH", f"{SMS}/m1/status", json={"status": {"phase": "Ready", "bogus": True}}, headers=MERGE)
    assert b["status"]["phase"] == "Ready" and "bogus" not in b["status"] and b["status"]["readyReplicas"] == 0


async def test_graceful_deletion_holds_a_running_pod_until_its_kubelet_deletes_it(api):
    """DELETE of a pod a kubelet runs sets deletionTimestamp (now + grace) and
    deletionGracePeriodSeconds (DeleteOptions, else spec.terminationGracePeriodSeconds, else 30):
    the pod stays, Terminating, through status updates, until a DELETE with grace 0 (the kubelet's,
    once its containers stopped). A shorter grace shortens a pending one; a longer one changes
    nothing. A pod no kubelet runs (unbound, or Succeeded/Failed) goes at once."""
    bound = {**pod("p1"), "spec": {"nodeName": "n1", "terminationGracePeriodSeconds": 20,
                                   "containers": [{"name": "c", "image": "x"}]}}
    await api("POST", PODS, json=bound)
    st, b = await api("DELETE", f"{PODS}/p1")
    assert st == 200 and b["metadata"]["deletionGracePeriodSeconds"] == 20 and b["metadata"]["deletionTimestamp"]
    st, b = await api("PATCH", f"{PODS}/p1/status", json={"status": {"phase": "Running"}}, headers=MERGE)
    assert st == 200 and b["metadata"]["deletionGracePeriodSeconds"] == 20  # still there
    st, b = await api("DELETE", f"{PODS}/p1", json={"gracePeriodSeconds": 60})
    assert b["metadata"]["deletionGracePeriodSeconds"] == 20
    st, b = await api("DELETE", f"{PODS}/p1?gracePeriodSeconds=5")
    assert b["metadata"]["deletionGracePeriodSeconds"] == 5
    st, b = await api("DELETE", f"{PODS}/p1", json={"gracePeriodSeconds": 0, "preconditions": {"uid": "someone-else"}})
    assert st == 409
    uid = (await api("GET", f"{PODS}/p1"))[1]["metadata"]["uid"]
    st, _ = await api("DELETE", f"{PODS}/p1", json={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
    assert st == 200 and (await api("GET", f"{PODS}/p1"))[0] == 404
    await api("POST", PODS, json=pod("unbound"))
    await api("DELETE", f"{PODS}/unbound")
    assert (await api("GET", f"{PODS}/unbound"))[0] == 404
    await api("POST", PODS,
              json={**pod("done"), "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}})
    await api("PATCH", f"{PODS}/done/status", json={"status": {"phase": "Succeeded"}}, headers=MERGE)
    await api("DELETE", f"{PODS}/done")
    assert (await api("GET", f"{PODS}/done"))[0] == 404


async def test_a_pod_is_bound_through_pods_binding_and_its_spec_is_not_updated(api):
    """spec.nodeName is set at creation or through the pods/binding subresource, which also turns
    PodScheduled True; binding a bound pod is a 409. A pod's spec cannot be changed by an update
    except for images, activeDeadlineSeconds and added tolerations (ValidatePodUpdate)."""
    await api("POST", PODS, json=pod("p1"))
    st, b = await api("PATCH", f"{PODS}/p1", json={"spec": {"nodeName": "n1"}}, headers=MERGE)
    assert st == 422 and "pod updates may not change fields" in b["message"]
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p1"},
               "target": {"kind": "Node", "name": "n1"}}
    st, b = await api("POST", f"{PODS}/p1/binding", json=binding)
    assert (st, b["status"]) == (201, "Success")
    st, b = await api("GET", f"{PODS}/p1")
    assert b["spec"]["nodeName"] == "n1"
    assert [(c["type"], c["status"]) for c in b["status"]["conditions"]] == [("PodScheduled", "True")]
    st, b = await api("POST", f"{PODS}/p1/binding", json={**binding, "target": {"kind": "Node", "name": "n2"}})
    assert st == 409 and 'already assigned to node "n1"' in b["message"]
    st, b = await api("PATCH", f"{PODS}/p1", json={"spec": {"containers": [{"name": "c", "image": "busybox:2"}],
                                                            "tolerations": [{"key": "k", "operator": "Exists"}]}},
                      headers=SMP)
    assert st == 200 and b["spec"]["containers"][0]["image"] == "busybox:2"


async def test_pod_logs_come_from_the_kubelet_of_the_pods_node(api, tmp_path):
    """pods/log is the kubelet's answer: kube-apiserver asks the node's kubelet at the address and
    port of the Node's status (daemonEndpoints.kubeletEndpoint) over HTTPS (its certificate
    unchecked without --kubelet-certificate-authority), passing tailLines, limitBytes and follow;
    a pod without a node has no logs."""
    buffers = {("default", "p1", "c"): LogBuffer(bytearray(b"one\ntwo\nthree\n"), ended=True)}
    kubelet = KubeletServer(lambda ns, name, container: buffers.get((ns, name, container)), tmp_path)
    await kubelet.start()
    try:
        await api("POST", "/api/v1/nodes", json={"metadata": {"name": "n1"}, "status": {
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet.port}}}})
        await api("POST", PODS,
                  json={**pod("p1"), "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}})
        assert await api("GET", f"{PODS}/p1/log") == (200, "one\ntwo\nthree\n")
        assert await api("GET", f"{PODS}/p1/log?tailLines=1") == (200, "three\n")
        assert await api("GET", f"{PODS}/p1/log?container=c&limitBytes=3") == (200, "one")
        st, b = await api("GET", f"{PODS}/p1/log?container=nope")
        assert st == 400 and "container nope is not valid" in b["message"]
        await api("POST", PODS, json=pod("unbound"))
        st, b = await api("GET", f"{PODS}/unbound/log")
        assert st == 400 and "does not have a host assigned" in b["message"]
    finally:
        await kubelet.stop()


async def test_pod_proxy_forwards_a_get_to_the_pods_ip_and_port_and_returns_its_answer():
    """pods/proxy as kube-apiserver serves it (`kubectl get --raw .../pods/NAME:PORT/proxy/PATH`):
    the GET goes to the pod's IP at PORT (none named: its first container port) with the query,
    and the pod's status code and body come back as they are; an unknown pod is 404, a pod without
    an IP 400 "address not allowed", a port nothing listens on 503 "error trying to reach service"."""
    async def answer(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"path": request.path, "query": dict(request.query)},
                                         status=int(request.query.get("status", 200)))
    app = aiohttp.web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    # The pod's IP is a pod network's; this machine reaches it on loopback (as the dev cluster maps it).
    async with serve(control_plane=False, pod_address=lambda ip: "127.0.0.1") as (_, url), \
            aiohttp.ClientSession(base_url=url) as session:
        api = Api(session)
        try:
            await api("POST", PODS, json={**pod("p1"), "spec": {"containers": [
                {"name": "c", "image": "x", "ports": [{"containerPort": port}]}]}})
            assert (await api("GET", f"{PODS}/p1:{port}/proxy/v1/shards"))[0] == 400  # no IP yet
            assert (await api("GET", f"{PODS}/p1:{port}/proxy/v1/shards"))[1]["message"] == "address not allowed"
            await api("PATCH", f"{PODS}/p1/status", json={"status": {"podIP": "10.9.0.5"}}, headers=MERGE)
            assert await api("GET", f"{PODS}/p1:{port}/proxy/v1/shards?x=1") == \
                (200, {"path": "/v1/shards", "query": {"x": "1"}})
            assert await api("GET", f"{PODS}/p1/proxy/a/b") == (200, {"path": "/a/b", "query": {}})
            assert await api("GET", f"{PODS}/p1:{port}/proxy/v1/x?status=418") == \
                (418, {"path": "/v1/x", "query": {"status": "418"}})  # the pod's own status code
            st, body = await api("GET", f"{PODS}/nope:{port}/proxy/v1/shards")
            assert (st, body["reason"]) == (404, "NotFound")
        finally:
            await runner.cleanup()
        st, body = await api("GET", f"{PODS}/p1:{port}/proxy/v1/shards")
        assert (st, body["reason"]) == (503, "ServiceUnavailable")
        assert body["message"].startswith(f"error trying to reach service: dial tcp 10.9.0.5:{port}: ")


# ---------------------------------------------------------------- injected faults
@pytest.fixture
async def faulty():
    """An emulator (and a raw client of it) whose faults a test sets."""
    async with serve(control_plane=False) as (emu, url):
        async with aiohttp.ClientSession(base_url=url) as session:
            yield emu, Api(session)


async def test_injected_errors_and_conflicts_change_nothing(faulty):
    emu, api = faulty
    await api("POST", PODS, json=pod("p1"))
    emu.faults = Faults(error=1.0)
    st, b = await api("POST", PODS, json=pod("p2"))
    assert (st, b["reason"], b["code"]) == (500, "InternalError", 500)
    st, _ = await api("GET", "/api/v1")  # discovery is spared
    assert st == 200
    emu.faults = Faults(conflict=1.0)
    st, b = await api("PATCH", f"{PODS}/p1", json={"metadata": {"labels": {"x": "1"}}}, headers=MERGE)
    assert (st, b["reason"]) == (409, "Conflict") and "the object has been modified" in b["message"]
    st, _ = await api("POST", PODS, json=pod("p3"))  # only updates conflict
    assert st == 201
    emu.faults = None
    st, b = await api("GET", PODS)
    assert names(b["items"]) == ["p1", "p3"] and not b["items"][0]["metadata"].get("labels")
    assert emu.api_requests()  # (served over HTTP: the in-process API is never faulted)


async def test_an_injected_timeout_answers_504_after_the_write_has_landed(faulty):
    emu, api = faulty
    emu.faults = Faults(timeout=1.0, delay=0.2)
    start = time.monotonic()
    st, b = await api("POST", PODS, json=pod("p1"))
    assert (st, b["reason"]) == (504, "Timeout") and time.monotonic() - start >= 0.2
    emu.faults = Faults(slow=1.0, delay=0.2)
    start = time.monotonic()
    st, b = await api("GET", f"{PODS}/p1")  # it is there
    assert st == 200 and time.monotonic() - start >= 0.2
    assert emu.faults.injected == {"slow": 1}


async def test_an_injected_watch_drop_cuts_the_connection_mid_stream(faulty):
    emu, api = faulty
    await api("POST", PODS, json=pod("p1"))
    with pytest.raises(aiohttp.ClientPayloadError):  # cut: no clean end of the chunked stream, no client timeout
        async with api.s.get(f"{PODS}?watch=true", timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert json.loads(await r.content.readline())["type"] == "ADDED"
            emu.faults = Faults(drop_watch=1.0)  # streams already open are cut too (a restart)
            async for _ in r.content:
                pass
    assert emu.faults.injected == {"drop_watch": 1}


def test_faults_are_drawn_from_their_seed():
    def sequence(seed):
        faults = Faults.parse(f"error=0.2,conflict=0.2,slow=0.2,drop_watch=0.5,seed={seed}")
        requests = [faults.draw(method, "/api/v1/pods", watch)
                    for method, watch in [("PATCH", False), ("GET", True), ("POST", False)] * 30]
        return requests, [faults.cut() for _ in range(30)]
    assert sequence(7) == sequence(7) != sequence(8)
    requests, cuts = sequence(7)
    assert set(requests) == {"error", "conflict", "slow", None} and set(cuts) == {True, False}
    with pytest.raises(ValueError, match="unknown fault 'eror'"):
        Faults.parse("eror=0.1")
    aimed = Faults(error=1.0, paths=r"/status$")
    assert (aimed.draw("PATCH", "/apis/g/v1/namespaces/n/things/t/status", False),
            aimed.draw("PATCH", "/apis/g/v1/namespaces/n/things/t", False)) == ("error", None)


async def test_pod_streams_are_refused_with_the_reason(api):
    """Not emulated, and said so: kube-apiserver upgrades pods/portforward, exec and attach to a SPDY
    or WebSocket stream to the pod's kubelet; here each is a 400 naming what to use instead, which
    kubectl prints ("error upgrading connection: ...")."""
    await api("POST", PODS, json=pod("p1"))
    for sub in ("portforward", "exec", "attach"):
        st, b = await api("POST", f"{PODS}/p1/{sub}", headers={"Connection": "Upgrade", "Upgrade": "SPDY/3.1"})
        assert (st, b["reason"]) == (400, "BadRequest") and "HTTP proxy" in b["message"], sub
