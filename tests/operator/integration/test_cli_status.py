"""`shardctl status NAME`: a ShardedModel on a cluster, read through the Kubernetes client with a
kubeconfig, as kubectl reads it, while the real operator runs against the emulated API server; each
group leader's time shares and decode step through the API server's pod proxy."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import pytest
from aiohttp import web

from shard_devcluster.apiserver import SM, serve, write_kubeconfig
from tests.operator.conftest import RESIDENT
from tests.support.cluster import gpu_node, sharded_model, write_model
from tests.support.fakekubelet import FakeKubelet
from tests.support.operator import eventually, fast_settings, running_operator

from .conftest import fake_leaders


async def shardctl_status(kubeconfig, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "shard_operator.cli", "status", *args,
                                                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow
async def test_status_of_a_model_on_the_cluster_shows_every_group_rank_by_rank(tmp_path):
    model_dir = write_model(tmp_path / "models" / "tiny")
    # The pods' IPs lead to the fake leaders' server, as the dev cluster maps them onto loopback.
    async with serve(pod_address=lambda ip: "127.0.0.1") as (emu, url), fake_leaders() as leaders, FakeKubelet(emu):
        for name in ("gpu-a", "gpu-b"):
            await emu.k8s_create("v1/nodes", None, gpu_node(name))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        settings = fast_settings(leader_url=leaders + "/{namespace}/{pod}")
        async with running_operator(url, settings):
            port = int(leaders.rsplit(":", 1)[1])  # the leaders serve /v1/shards on spec.worker.port
            await emu.k8s_create(SM, "default", sharded_model("m1", model_dir, replicas=2, tensor=2,
                                                              worker={"port": port}))

            async def measured():
                status = ((await emu.k8s_get(SM, "default", "m1")) or {}).get("status") or {}
                return status if status.get("phase") == "Ready" and status.get("shards") and \
                    all("residentBytes" in s for s in status["shards"]) else None
            status = await eventually(measured, timeout=30)
            code, out, err = await shardctl_status(kubeconfig, "m1", "-n", "default")
            missing = await shardctl_status(kubeconfig, "nope")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"ShardedModel default/m1: Ready, 2/2 groups ready, plan {status['plan']['hash']}"
    header = re.split(r"\s{2,}", lines[1].strip())
    # A GPU rank's prediction holds its 1 GiB of runtime: the table is in GiB.
    assert header == ["group", "rank", "stage", "tp", "where", "layers", "state", "predicted GiB", "measured GiB",
                      "capacity GiB", "compute", "comm", "idle"]
    rows = [dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=False)) for line in lines[2:6]]
    by_pod = {s["pod"]: s for s in status["shards"]}
    assert [(r["group"], r["rank"], r["layers"], r["state"]) for r in rows] == \
        [(g, k, "0-3 (4 layers)", "Ready") for g in ("0", "1") for k in ("0", "1")]
    for row in rows:
        shard = by_pod[row["where"]]
        assert float(row["predicted GiB"]) == round(shard["predictedBytes"] / 2**30, 2)
        assert float(row["measured GiB"]) == round((RESIDENT + int(row["rank"]) * 2**20) / 2**30, 2)
        # from the leader's /v1/shards (leader_report): a 1 GiB device, 3 s computing and 1 s communicating
        assert (row["capacity GiB"], row["compute"], row["comm"], row["idle"]) == ("1.00", "75%", "25%", "0%")
    step = status["plan"]["predictedStepSeconds"]
    assert step > 0 and f"decode step: predicted {step * 1e3:.2f} ms (the plan's critical path), measured " \
        "20.00 ms (the latest batch)" in out  # the leader's last batch: 0.5 s over 25 steps
    assert "time shares" not in out
    assert missing[0] == 3 and missing[2] == "shardctl: ShardedModel default/nope not found\n"


async def test_status_refused_the_pod_proxy_shows_the_status_table_and_says_why(tmp_path):
    """A user whom RBAC grants the ShardedModel but not `get pods/proxy`: kube-apiserver's
    authorizer answers 403 Forbidden with this Status (a server that plays exactly that: the
    emulator has no RBAC). The table from the status stays, with one line saying why."""
    pod = "m1-0-abc-0"
    model = {"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel",
             "metadata": {"name": "m1", "namespace": "default"}, "spec": {"replicas": 1},
             "status": {"phase": "Ready", "readyReplicas": 1, "plan": {"hash": "h", "predictedStepSeconds": 0.01},
                        "shards": [{"group": 0, "rank": 0, "pod": pod, "layers": [0, 4], "predictedBytes": 2**30,
                                    "residentBytes": 2**29, "state": "Ready"}]}}
    forbidden = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
                 "message": f'pods "{pod}" is forbidden: User "alice" cannot get resource "pods/proxy" in API '
                            'group "" in the namespace "default"', "details": {"name": pod, "kind": "pods"},
                 "code": 403}
    proxied = []

    async def get_model(request: web.Request) -> web.Response:
        return web.json_response(model)

    async def refuse(request: web.Request) -> web.Response:
        proxied.append(request.path)
        return web.json_response(forbidden, status=403)
    app = web.Application()
    app.router.add_get("/apis/sharding.dev/v1alpha1/namespaces/default/shardedmodels/m1",
                       get_model)
    app.router.add_get("/api/v1/namespaces/default/pods/{pod}/proxy/{path:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        code, out, err = await shardctl_status(kubeconfig, "m1")
    finally:
        await runner.cleanup()
    assert code == 0, err
    assert proxied == [f"/api/v1/namespaces/default/pods/{pod}:8000/proxy/v1/shards"]  # spec.worker.port's default
    lines = out.splitlines()
    assert lines[0] == "ShardedModel default/m1: Ready, 1/1 groups ready, plan h"
    assert re.split(r"\s{2,}", lines[2].strip()) == ["0", "0", "0", "0", pod, "0-3 (4 layers)", "Ready", "1.00", "0.50",
                                                     "-", "-", "-", "-"]
    assert lines[3:] == ["decode step: predicted 10.00 ms (the plan's critical path), measured - (no batch yet) "
                         "(the latest batch)",
                         "no time shares or measured step from the leaders: the cluster refuses the pod proxy (it "
                         f"needs get on pods/proxy in default): {forbidden['message']}"]
