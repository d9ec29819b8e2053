"""The one-machine cluster itself (shard_devcluster), with small stand-in pods: addresses,
DNS and the rendezvous port, volumes, device memory budgets, probes, graceful deletion, node loss,
Services, the gateway, and the kubelet and proxies attached to another API server."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import stat
from pathlib import Path

import httpx
import pytest

from shard_devcluster.cluster import DevCluster
from shard_devcluster.network import ClusterNetwork
from shard_devcluster.processkubelet import expand
from tests.support.cluster import gpu_node
from tests.support.k8s_binaries import rows
from tests.support.operator import eventually

pytestmark = pytest.mark.e2e

SIM = {"sharding.dev/device-kind": "cpu"}
# A stand-in container: prints what it was given, then serves the files of its /data mount on the
# address it is told to bind (SHARD_HOST), port 8000: /ready and /alive answer while those files exist.
SERVE = ("import os, sys, functools, http.server as h\n"
         "print('|'.join(os.environ.get(k, '-') for k in ('POD_IP', 'MASTER_ADDR', 'MASTER_PORT', "
         "'SHARD_MEMORY_BUDGET', 'PLAN', 'SHARD_SHM_DIR', 'SHARD_OPERATOR_BIND_ADDRESS')), flush=True)\n"
         "print('plan:', open(os.environ['PLAN']).read() if 'PLAN' in os.environ else '-', flush=True)\n"
         "h.ThreadingHTTPServer((os.environ['SHARD_HOST'], 8000), "
         "functools.partial(h.SimpleHTTPRequestHandler, directory=sys.argv[1])).serve_forever()\n")


def pod(name: str, node: str, *, labels=None, env=(), probes=None, subdomain="grp", gpu=True, volumes=(),
        mounts=()) -> dict:
    """A stand-in pod bound to `node` at creation (no scheduler involved)."""
    container = {"name": "c", "image": "none", "command": ["python", "-c", SERVE, "/data"],
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, *env],
                 "ports": [{"name": "http", "containerPort": 8000}, {"name": "rendezvous", "containerPort": 29500}],
                 "resources": {"limits": {"nvidia.com/gpu": "1"}} if gpu else {},
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}, *mounts], **(probes or {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"app": "grp", **(labels or {})}},
            "spec": {"hostname": name, "subdomain": subdomain, "nodeName": node, "restartPolicy": "Never",
                     "containers": [container], "volumes": [{"name": "data", "emptyDir": {}}, *volumes]}}


# The headless Service that gives the stand-in pods their names, as the operator's group Services do.
GROUP_SERVICE = {"metadata": {"name": "grp"}, "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                                                       "selector": {"app": "grp"}}}


@pytest.fixture
async def cluster(tmp_path):
    nodes = [gpu_node("a", gpus=2, memory_mib=160, labels=SIM), gpu_node("b", gpus=2, memory_mib=96, labels=SIM)]
    async with DevCluster(tmp_path, nodes=nodes, run_operator=False, probe_period=0.2, grace=2,
                          pod_gc_quarantine=1.0) as c:
        await c.emu.k8s_create("v1/services", "default", GROUP_SERVICE)
        yield c


async def status(c: DevCluster, name: str) -> dict:
    return ((await c.emu.k8s_get("v1/pods", "default", name)) or {}).get("status") or {}


def ready(st: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in st.get("conditions") or [])


async def first_line(c: DevCluster, name: str) -> list[str]:
    async def printed():
        log = c.kubelet.logs("default", name).decode()
        return log.splitlines()[:2] if log.count("\n") >= 2 else None
    return await eventually(printed, timeout=30)


def data_dir(c: DevCluster, name: str) -> Path:
    return c.kubelet.sandboxes[("default", name)].directory / "volumes" / "data"


def test_network_maps_cluster_addresses_onto_loopback_and_answers_dns():
    net = ClusterNetwork("10.200.0.0/16")
    a, b = net.pod_address(), net.pod_address()
    assert a != b and ipaddress.ip_address(a) in ipaddress.ip_network("10.200.0.0/16")
    assert net.local(a) == "127." + a.split(".", 1)[1] and net.local("127.0.0.1") == "127.0.0.1"
    assert net.local("10.96.3.4") == "127.96.3.4"
    with pytest.raises(ValueError, match=r"both map to 127\.96\.3\.4"):
        net.local("172.96.3.4")
    # a node's podCIDR
    assert ipaddress.ip_address(net.pod_address("10.1.2.0/24")) in ipaddress.ip_network("10.1.2.0/24")
    net.set_records("default/g", {"x.g.default.svc": a, "x.g.default.svc.cluster.local": a})
    assert net.resolve("X.g.default.svc.") == a and net.resolve("x.g.default.svc.cluster.local") == a
    assert net.resolve("10.1.2.3") == "10.1.2.3" and net.resolve("nope.default.svc") is None
    net.set_records("default/g", {"x.g.default.svc": b})  # the Service's endpoints changed
    assert net.resolve("x.g.default.svc") == b and net.resolve("x.g.default.svc.cluster.local") is None


def test_command_references_expand_like_kubernetes():
    assert expand("--bind=$(POD_IP) $$(POD_IP) $(NOPE)", {"POD_IP": "127.10.0.2"}) == \
        "--bind=127.10.0.2 $(POD_IP) $(NOPE)"


async def test_pods_get_own_addresses_a_resolved_rendezvous_volumes_and_the_device_budget(cluster):
    await cluster.emu.k8s_create("v1/configmaps", "default",
                                 {"metadata": {"name": "plan"}, "data": {"plan.json": '{"x": 1}'}})
    leader_name = "r0.grp.default.svc"
    common = dict(env=[{"name": "MASTER_ADDR", "value": leader_name}, {"name": "MASTER_PORT", "value": "29500"},
                       {"name": "PLAN", "value": "/etc/plan/plan.json"}],
                  volumes=[{"name": "plan",
                            "configMap": {"name": "plan", "items": [{"key": "plan.json", "path": "plan.json"}]}},
                           {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                  mounts=[{"name": "plan", "mountPath": "/etc/plan"}, {"name": "dshm", "mountPath": "/dev/shm"}])
    # The follower first: it waits for the leader's name to resolve, as a resolver would retry.
    await cluster.emu.k8s_create("v1/pods", "default", pod("r1", "b", **common))
    await asyncio.sleep(0.3)
    await cluster.emu.k8s_create("v1/pods", "default", pod("r0", "a", **common))
    (l0, p0), (l1, p1) = await first_line(cluster, "r0"), await first_line(cluster, "r1")
    ip0, addr0, port0, budget0, plan0, shm0, bind0 = l0.split("|")
    ip1, addr1, port1, budget1, _, shm1, _ = l1.split("|")
    pod_ips = {(await status(cluster, n))["podIP"] for n in ("r0", "r1")}  # what the API shows: the cluster's
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("10.128.0.0/9") for ip in pod_ips)
    assert ip0 != ip1 and {ip0, ip1} == {cluster.network.local(ip) for ip in pod_ips}  # what the processes see
    leader = cluster.network.resolve(leader_name)                  # (from the headless Service's slices)
    assert addr0 == addr1 == ip0 == cluster.network.local(leader)  # MASTER_ADDR: the leader's address
    assert port0 == port1 == "29500"                               # as the pods say: each leader binds its own address
    assert (budget0, budget1) == (str(160 * 2**20), str(96 * 2**20))  # each node's GPU memory
    assert plan0.startswith(str(cluster.workdir)) and p0 == p1 == 'plan: {"x": 1}'
    assert bind0 == ip0  # (what the chart's operator binds its health and metrics endpoints to)
    # Each pod's /dev/shm is its own (the worker's shared-memory collectives go there)
    assert (shm0, shm1) == tuple(str(cluster.kubelet.sandboxes[("default", n)].directory / "volumes" / "dshm")
                                 for n in ("r0", "r1"))
    # Both serve on port 8000, each on its own address.
    (data_dir(cluster, "r0") / "who").write_text("r0")
    (data_dir(cluster, "r1") / "who").write_text("r1")
    async with httpx.AsyncClient() as http:
        assert [(await http.get(f"http://{ip}:8000/who")).text for ip in (ip0, ip1)] == ["r0", "r1"]


async def test_secret_volumes_hold_the_decoded_keys_with_the_volume_mode(cluster):
    await cluster.emu.k8s_create("v1/secrets", "default", {"metadata": {"name": "s"}, "stringData": {"k": "v\n"}})
    await cluster.emu.k8s_create("v1/pods", "default", pod(
        "p", "a", volumes=[{"name": "key", "secret": {"secretName": "s", "defaultMode": 0o440}}],
        mounts=[{"name": "key", "mountPath": "/etc/key", "readOnly": True}]))
    await first_line(cluster, "p")
    key = cluster.kubelet.sandboxes[("default", "p")].directory / "volumes" / "key" / "k"
    assert key.read_bytes() == b"v\n" and stat.S_IMODE(key.stat().st_mode) == 0o440


async def test_probes_set_readiness_and_a_failed_liveness_probe_kills_the_container(cluster):
    probes = {"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                                 "failureThreshold": 2},
              "livenessProbe": {"httpGet": {"path": "/alive", "port": 8000}, "periodSeconds": 1, "failureThreshold": 2},
              "terminationMessagePolicy": "FallbackToLogsOnError"}
    await cluster.emu.k8s_create("v1/pods", "default", pod("p", "a", probes=probes))
    await first_line(cluster, "p")
    data = data_dir(cluster, "p")
    (data / "alive").write_text("ok")
    await asyncio.sleep(1.0)
    running = await status(cluster, "p")
    assert running["phase"] == "Running" and not ready(running)
    await asyncio.sleep(1.0)  # (so that a transition time a second later would differ)
    (data / "ready").write_text("ok")
    await eventually(lambda: _is(cluster, "p", True), timeout=60)
    became = await status(cluster, "p")
    since = {c["type"]: c["lastTransitionTime"] for c in became["conditions"]}
    transitions = {c["type"]: c["lastTransitionTime"] for c in running["conditions"]}
    assert since["Ready"] > since["Initialized"] == transitions["Initialized"]
    # The process started when it started, whenever it turned Ready.
    assert became["containerStatuses"][0]["state"] == running["containerStatuses"][0]["state"]
    (data / "ready").unlink()
    await eventually(lambda: _is(cluster, "p", False), timeout=60)
    (data / "alive").unlink()
    st = await eventually(lambda: _phase(cluster, "p", "Failed"), timeout=60)
    term = st["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == -signal.SIGKILL and term["message"] == "Liveness probe failed 2 times"


async def _is(c, name, want: bool):
    return ready(await status(c, name)) == want


async def _phase(c, name, phase):
    st = await status(c, name)
    return st if st.get("phase") == phase else None


async def test_a_lost_node_takes_its_processes_and_its_pods_go_after_the_quarantine(cluster):
    await cluster.emu.k8s_create("v1/pods", "default", pod("on-b", "b"))
    nowhere = pod("nowhere", "c")
    del nowhere["spec"]["nodeName"]
    nowhere["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "c"}
    await cluster.emu.k8s_create("v1/pods", "default", nowhere)
    await first_line(cluster, "on-b")
    proc = cluster.kubelet.process("default", "on-b")
    await cluster.emu.k8s_delete("v1/nodes", None, "b")
    await asyncio.wait_for(proc.wait(), 10)  # the machine is gone, and its processes with it
    st = await status(cluster, "on-b")
    assert st["phase"] == "Running"  # nobody is left to report on it ...

    async def collected():  # ... until the pod GC deletes it
        return await cluster.emu.k8s_get("v1/pods", "default", "on-b") is None
    await eventually(collected, timeout=60)
    await eventually(lambda: cluster.network.resolve("on-b.grp.default.svc") is None, timeout=60)
    st = await status(cluster, "nowhere")  # the scheduler's account of why it waits
    assert st["phase"] == "Pending" and st["conditions"][0]["message"] == \
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."


async def test_a_deleted_pod_is_stopped_then_deleted_for_good_and_a_missing_host_path_is_reported(cluster):
    await cluster.emu.k8s_create("v1/pods", "default", pod("p", "a"))
    await first_line(cluster, "p")
    proc = cluster.kubelet.process("default", "p")
    started = (await status(cluster, "p"))["containerStatuses"][0]["state"]["running"]["startedAt"]
    deleting = await cluster.emu.k8s_delete("v1/pods", "default", "p")
    assert deleting["metadata"]["deletionGracePeriodSeconds"] == 30  # the API server keeps it, Terminating
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGTERM

    await eventually(gone_pod(cluster, "p"), timeout=60)  # the kubelet's final delete, with grace 0
    assert started

    missing = pod("q", "a", volumes=[{"name": "m", "hostPath": {"path": "/no/such", "type": "Directory"}}],
                  mounts=[{"name": "m", "mountPath": "/models"}])
    await cluster.emu.k8s_create("v1/pods", "default", missing)

    async def waiting():
        st = await status(cluster, "q")
        return ((st.get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting", {}).get("message")
    assert "hostPath /no/such is not a directory" in await eventually(waiting, timeout=60)
    sandbox = cluster.kubelet.sandboxes[("default", "q")]
    await cluster.emu.k8s_delete("v1/pods", "default", "q")  # never started: it goes with its sandbox
    await eventually(gone_pod(cluster, "q"), timeout=60)
    assert ("default", "q") not in cluster.kubelet.sandboxes and not sandbox.directory.exists()


def gone_pod(c: DevCluster, name: str):
    async def gone():
        return await c.emu.k8s_get("v1/pods", "default", name) is None and ("default", name) not in c.kubelet.sandboxes
    return gone


async def test_a_service_routes_to_ready_endpoints_and_retries_a_dead_one(cluster):
    service = {"metadata": {"name": "web"}, "spec": {"selector": {"app": "web"},
                                                      "ports": [{"port": 80, "targetPort": "http"}]}}
    created = await cluster.emu.k8s_create("v1/services", "default", service)
    assert ipaddress.ip_address(created["spec"]["clusterIP"]) in ipaddress.ip_network("10.96.0.0/12")
    probes = {"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "failureThreshold": 30}}
    for name in ("w0", "w1", "w2"):
        await cluster.emu.k8s_create("v1/pods", "default", pod(name, "a", labels={"app": "web"}, probes=probes))
        await first_line(cluster, name)
    # w3 is Ready (no probe) but listens nowhere: every try on it is refused.
    deaf = pod("w3", "a", labels={"app": "web"})
    deaf["spec"]["containers"][0]["command"] = ["python", "-c", "import time; time.sleep(600)"]
    await cluster.emu.k8s_create("v1/pods", "default", deaf)
    for name in ("w0", "w1"):  # w2 never becomes ready: it gets no traffic
        (data_dir(cluster, name) / "ready").write_text(name)
    for name in ("w0", "w1", "w3"):
        await eventually(lambda: _is(cluster, name, True), timeout=60)
    # A Service without a selector (as the `kubernetes` one) has endpoints the proxy does not know of.
    await cluster.emu.k8s_create("v1/services", "default", {"metadata": {"name": "manual"}, "spec": {
        "ports": [{"port": 443}]}})
    url = await eventually(lambda: cluster.service_url("web"), timeout=60)
    assert url == f"http://{cluster.network.local(created['spec']['clusterIP'])}:80"
    assert {key[1] for _, key in cluster.proxy.listeners.values()} == {"web"}  # headless: names only
    async with httpx.AsyncClient() as http:
        answers = [(await http.get(url + "/ready")) for _ in range(6)]
        assert {r.text for r in answers} == {"w0", "w1"} and all(r.status_code == 200 for r in answers)
        assert {r.headers["x-upstream-pod"] for r in answers} == {"w0", "w1"}
        stats = cluster.proxy.stats
        assert stats.failed == 0 and stats.retried >= 1 and set(stats.upstream_errors) == {"ClientConnectorError"}
        # w0 dies: a retry, or its Failed phase, keeps it from answering.
        await cluster.kubelet.kill("default", "w0", signal.SIGKILL)
        answers = [(await http.get(url + "/ready")) for _ in range(4)]
        assert [r.text for r in answers] == ["w1"] * 4
    assert stats.failed == 0
    # From outside the pods, the cluster network's proxy takes a Service's name and a pod's IP.
    w1 = (await status(cluster, "w1"))["podIP"]
    async with httpx.AsyncClient(proxy=cluster.gateway.url) as http:
        assert (await http.get("http://web.default.svc.cluster.local/ready")).text == "w1"
        assert (await http.get(f"http://{w1}:8000/ready")).text == "w1"

async def output_line(proc: asyncio.subprocess.Process, seen: list[str], text: str) -> str:
    """The next line of `dev-cluster`'s output that holds `text` (each line read is kept in `seen`)."""
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line, "dev-cluster ended early:\n" + "".join(seen)
        seen.append(line)
        if text in line:
            return line



# A stand-in endpoint that records every request it receives (in /data/seen) and answers as
# /data/mode says: "drop" closes the connection without an answer, "503" answers 503, else 200.
RECORDER = ("import os, socket, sys, http.server as h\n"
            "d = sys.argv[1]\n"
            "class H(h.BaseHTTPRequestHandler):\n"
            "    def answer(self):\n"
            "        self.rfile.read(int(self.headers.get('Content-Length') or 0))\n"
            "        open(os.path.join(d, 'seen'), 'a').write(self.command + '\\n')\n"
            "        mode = open(os.path.join(d, 'mode')).read() if os.path.exists(os.path.join(d, 'mode')) else ''\n"
            "        if mode == 'drop':\n"
            "            self.close_connection = True\n"
            "            return self.connection.shutdown(socket.SHUT_RDWR)\n"
            "        self.send_response(503 if mode == '503' else 200)\n"
            "        self.send_header('Content-Length', '0')\n"
            "        self.end_headers()\n"
            "    do_GET = do_POST = answer\n"
            "h.ThreadingHTTPServer((os.environ['SHARD_HOST'], 8000), H).serve_forever()\n")


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as http:
            return (await http.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


async def test_a_service_never_replays_a_post_that_reached_an_endpoint(cluster):
    """As kube-proxy: a POST that reached an endpoint is not sent to another, whether that one drops
    the connection or answers 503 (a completion that fails its group would fail the next one
    too); it is sent elsewhere only when no connection could be made. A GET is still retried."""
    service = {"metadata": {"name": "api"}, "spec": {"selector": {"app": "api"},
                                                      "ports": [{"port": 80, "targetPort": "http"}]}}
    await cluster.emu.k8s_create("v1/services", "default", service)
    for name in ("e0", "e1"):
        endpoint = pod(name, "a", labels={"app": "api"})
        endpoint["spec"]["containers"][0]["command"] = ["python", "-c", RECORDER, "/data"]
        await cluster.emu.k8s_create("v1/pods", "default", endpoint)
        await eventually(lambda: _is(cluster, name, True), timeout=60)
        ip = cluster.network.local((await status(cluster, name))["podIP"])
        await eventually(lambda: _answers(f"http://{ip}:8000/"), timeout=30)
    url = await eventually(lambda: cluster.service_url("api"), timeout=60)

    def seen(name: str) -> list[str]:
        path = data_dir(cluster, name) / "seen"
        return path.read_text().split() if path.exists() else []

    async with httpx.AsyncClient(timeout=30) as http:
        for mode, failed in (("drop", 502), ("503", 503)):
            (data_dir(cluster, "e0") / "mode").write_text(mode)
            before = {n: len(seen(n)) for n in ("e0", "e1")}
            answers = [(await http.post(url + "/v1/completions", json={"prompt": "x"})).status_code for _ in range(6)]
            got = {n: seen(n)[before[n]:] for n in ("e0", "e1")}
            assert got["e0"] == ["POST"] * answers.count(failed) and got["e1"] == ["POST"] * answers.count(200)
            assert sorted(set(answers)) == [200, failed]  # each went to one endpoint, once
        before = len(seen("e1"))
        answers = [(await http.get(url + "/")).status_code for _ in range(4)]  # e0 still answers 503
        assert answers == [200] * 4 and seen("e1")[before:] == ["GET"] * 4
        # e2 is Ready (no probe) but listens nowhere: a POST it refused goes to another endpoint
        (data_dir(cluster, "e0") / "mode").unlink()
        deaf = pod("e2", "a", labels={"app": "api"})
        deaf["spec"]["containers"][0]["command"] = ["python", "-c", "import time; time.sleep(600)"]
        await cluster.emu.k8s_create("v1/pods", "default", deaf)
        await eventually(lambda: _is(cluster, "e2", True), timeout=60)
        before = len(seen("e0")) + len(seen("e1"))
        answers = [(await http.post(url + "/v1/completions", json={"prompt": "x"})).status_code for _ in range(6)]
        assert answers == [200] * 6 and len(seen("e0")) + len(seen("e1")) - before == 6
    stats = cluster.proxy.stats
    assert stats.upstream_errors["ServerDisconnectedError"] >= 1 and stats.upstream_errors["HTTP 503"] >= 1
    assert stats.upstream_errors["ClientConnectorError"] >= 1


def _children(pid: int) -> set[int]:
    """Every descendant process of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat_file.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.slow
async def test_shardctl_dev_cluster_starts_a_cluster_kubectl_can_use_and_stops_every_process(tmp_path):
    import os
    import sys

    from tests.support.k8s_binaries import binary

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shard_operator.cli", "dev-cluster", "--dir", str(tmp_path), "--demo-model",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    seen: list[str] = []

    async def line_with(text: str) -> str:
        return await output_line(proc, seen, text)

    async def kubectl(*args: str) -> str:
        run = await asyncio.create_subprocess_exec(str(binary("kubectl")), *args,
                                                   env={**os.environ, "KUBECONFIG": kubeconfig},
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out = (await run.communicate())[0].decode()
        assert run.returncode == 0, out
        return out
    try:
        kubeconfig = (await line_with("export KUBECONFIG=")).split("=", 1)[1].strip()
        assert (tmp_path / "host/var/lib/shard-operator/models/demo-llama/config.json").is_file()
        assert (await kubectl("get", "nodes", "-o", "name")).split() == ["node/sim-a", "node/sim-b"]
        example = Path(__file__).resolve().parents[2] / "examples" / "dev-cluster" / "shardedmodel.yaml"
        await kubectl("apply", "-f", str(example))
        service = await line_with("service default/demo: http://127.")
        assert service.strip().endswith(":8000")

        async def ranks_running():
            return len(_children(proc.pid)) >= 5  # the operator and four ranks (and their threads' kin)
        await eventually(ranks_running, timeout=60)
        started = _children(proc.pid)
        pods = rows(await kubectl("get", "pods", "-o", "wide"))
        assert list(pods[0]) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED NODE",
                                 "READINESS GATES"]
        assert len(pods) == 4
        assert all(ipaddress.ip_address(p["IP"]) in ipaddress.ip_network("10.128.0.0/9") for p in pods)
        assert sorted(p["NODE"] for p in pods) == ["sim-a", "sim-a", "sim-b", "sim-b"]

        async def logged():  # kubectl logs: the API server asks the kubelet's endpoint
            return await kubectl("logs", pods[0]["NAME"])
        await eventually(logged, timeout=60)

        # A node added and removed while it runs.
        add = await asyncio.create_subprocess_exec(sys.executable, "-m", "shard_operator.cli", "dev-cluster",
                                                   "add-node",
                                                   "sim-c", "--dir", str(tmp_path), stdout=asyncio.subprocess.PIPE)
        assert (await add.communicate())[0].decode().strip() == "node/sim-c created" and add.returncode == 0

        async def node_ready():  # its kubelet (this cluster's) posts its status
            nodes = {n["NAME"]: n for n in rows(await kubectl("get", "nodes", "-o", "wide"))}
            return nodes.get("sim-c", {}).get("STATUS") == "Ready" and nodes["sim-c"]["INTERNAL-IP"] == "127.0.0.1"
        await eventually(node_ready, timeout=30)
        await kubectl("delete", "node", "sim-c")
        assert "sim-c" not in await kubectl("get", "nodes", "-o", "name")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)
    assert proc.returncode == 0, "".join(seen)
    def no_process_left_behind() -> bool:
        return not [pid for pid in started if Path(f"/proc/{pid}").exists()]
    await eventually(no_process_left_behind, timeout=60)


async def test_each_nodes_lease_is_owned_by_it_and_its_ready_condition_says_since_when(cluster):
    """The kubelet keeps its Node's Lease in kube-node-lease with an ownerReference to the Node, so
    the garbage collector deletes the Lease with the Node; its Ready condition carries the time it
    turned True (lastTransitionTime), as a kubelet reports it. The Lease is gone for good even when
    the kubelet renews it between the Node's deletion and its hearing of it (it creates the Lease
    again, owned by the deleted Node: the garbage collector deletes that one too). Each wait is a
    generous bound on a condition: on a busy machine the kubelet's first report can take seconds."""
    node = await cluster.emu.k8s_get("v1/nodes", None, "a")

    async def lease():
        return await cluster.emu.k8s_get("coordination.k8s.io/v1/leases", "kube-node-lease", "a")
    owned = await eventually(lease, timeout=120)
    assert owned["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "a",
                                                     "uid": node["metadata"]["uid"]}]

    async def reported():
        ready = next(c for c in (await cluster.emu.k8s_get("v1/nodes", None, "a"))["status"]["conditions"]
                     if c["type"] == "Ready")
        return ready if ready.get("lastHeartbeatTime") else None
    ready = await eventually(reported, timeout=120)
    assert ready["status"] == "True" and ready["lastTransitionTime"] <= ready["lastHeartbeatTime"]
    await cluster.emu.k8s_delete("v1/nodes", None, "a")

    async def collected():
        return await lease() is None
    await eventually(collected, timeout=120)


async def test_a_port_taken_on_every_address_fails_the_pod_with_the_reason(cluster):
    import socket

    with socket.socket() as squatter:  # what `python -m http.server` does: every address
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        blocked = pod("blocked", "a")
        blocked["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": port}]
        await cluster.emu.k8s_create("v1/pods", "default", blocked)
        st = await eventually(lambda: _phase(cluster, "blocked", "Failed"), timeout=60)
    assert st["reason"] == "PortInUse" and f"port {port} is taken on every address" in st["message"]
    assert st["containerStatuses"][0]["state"]["terminated"]["reason"] == "PortInUse"
    assert cluster.network.resolve("blocked.grp.default.svc") is None


ATTACHED = """import sys
sys.modules["shard_devcluster.emulator"] = None  # the emulator cannot be imported: only the HTTP API is used
from shard_operator.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
async def test_the_kubelet_and_proxies_attach_to_another_api_server_without_the_emulator(tmp_path):
    """`shardctl dev-cluster --kubeconfig FILE --no-operator` runs the kubelet, the Service proxy and
    DNS against another API server (here an emulator in this process, with its scheduler and
    controllers), in a process where the emulator cannot even be imported, beside the operator that
    cluster runs (none here): a pod is scheduled by that control plane, run, served through its
    Service, logged through the API server, and deleted gracefully; the CRD it finds (Helm's) is left
    as it was."""
    import sys

    import yaml

    from shard_devcluster.apiserver import serve, write_kubeconfig
    from shard_operator.api.crd import build_crd
    from tests.support.k8s_binaries import binary

    async with serve() as (emu, url):
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        crds = "apiextensions.k8s.io/v1/customresourcedefinitions"
        helms = await emu.k8s_create(crds, None, {**build_crd(), "metadata": {
            "name": "shardedmodels.sharding.dev", "labels": {"app.kubernetes.io/managed-by": "Helm"}}})
        nodes = tmp_path / "nodes.yaml"
        nodes.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [
            gpu_node("a", gpus=2, memory_mib=160, labels=SIM), gpu_node("real", gpus=2)]}))  # (a real kubelet's)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ATTACHED, "dev-cluster", "--kubeconfig", str(kubeconfig), "--nodes", str(nodes),
            "--no-operator",
            "--node-selector", "sharding.dev/device-kind=cpu", "--dir", str(tmp_path / "state"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out: list[str] = []

        async def line_with(text: str) -> str:
            return await output_line(proc, out, text)
        try:
            assert "no operator (--no-operator)" in await line_with("attached to the API server")
            assert await emu.k8s_get(crds, None, "shardedmodels.sharding.dev") == helms  # untouched
            await emu.k8s_create("v1/services", "default", GROUP_SERVICE)
            web = await emu.k8s_create("v1/services", "default", {"metadata": {"name": "web"}, "spec": {
                "selector": {"app": "grp"}, "ports": [{"port": 80, "targetPort": "http"}]}})
            unbound = pod("w", "a")
            del unbound["spec"]["nodeName"]  # the control plane's scheduler binds it
            await emu.k8s_create("v1/pods", "default", unbound)
            service = await line_with("service default/web: ")
            local = service.split(": ", 1)[1].strip()
            assert local == f"http://127.{web['spec']['clusterIP'].split('.', 1)[1]}:80"

            async def logged():
                run = await asyncio.create_subprocess_exec(str(binary("kubectl")), "--kubeconfig", str(kubeconfig),
                                                           "logs", "w", stdout=asyncio.subprocess.PIPE)
                return (await run.communicate())[0].decode()
            first = (await eventually(logged, timeout=60)).splitlines()[0]
            ip = (await emu.k8s_get("v1/pods", "default", "w"))["status"]["podIP"]
            assert first.split("|")[0] == "127." + ip.split(".", 1)[1]  # POD_IP: its address on this machine
            async with httpx.AsyncClient() as http:
                r = await http.get(local + "/")  # the stand-in serves its /data directory
            assert r.status_code == 200 and r.headers["x-upstream-pod"] == "w"
            await emu.k8s_create("v1/pods", "default", pod("elsewhere", "real"))  # not its node: not its pod
            await emu.k8s_delete("v1/pods", "default", "w")

            async def gone():  # the attached kubelet stopped it and deleted it with grace 0
                return await emu.k8s_get("v1/pods", "default", "w") is None
            await eventually(gone, timeout=30)
            assert not (await emu.k8s_get("v1/pods", "default", "elsewhere")).get("status")
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)
        assert proc.returncode == 0, "".join(out) + (await proc.stdout.read()).decode()
        assert not (tmp_path / "state" / "operator.log").exists()  # no operator was started


def test_the_node_components_need_no_emulator():
    """The kubelet, the proxies and DNS import without the emulator (or kmock) and call nothing of it:
    they speak the Kubernetes HTTP API only (the attach test above runs them so)."""
    import subprocess
    import sys

    modules = ["processkubelet", "kubeletstatus", "probes", "proxy", "dns", "gateway", "kubeapi", "kubeletserver",
               "network", "cluster"]
    code = ("import sys; sys.modules['shard_devcluster.emulator'] = None; sys.modules['kmock'] = None\n"
            + "".join(f"import shard_devcluster.{m}\n" for m in modules))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    root = Path(__file__).resolve().parents[2] / "devcluster" / "shard_devcluster"
    for module in modules[:-1]:
        source = (root / f"{module}.py").read_text()
        assert "emu" not in source.replace("emulated", "").replace("emulator", "") and "kmock" not in source, module
