"""`shardctl status NAME`: a ShardedModel on a cluster, read through the Kubernetes client with a
kubeconfig, as kubectl reads it, while the real operator runs against the emulated API server."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import pytest

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
    async with serve() as (emu, url), fake_leaders() as leaders, FakeKubelet(emu):
        for name in ("gpu-a", "gpu-b"):
            await emu.k8s_create("v1/nodes", None, gpu_node(name))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        settings = fast_settings(leader_url=leaders + "/{namespace}/{pod}")
        async with running_operator(url, settings):
            await emu.k8s_create(SM, "default", sharded_model("m1", model_dir, replicas=2, tensor=2))

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
    rows = [dict(zip(header, re.split(r"\s{2,}", line.strip()))) for line in lines[2:6]]
    by_pod = {s["pod"]: s for s in status["shards"]}
    assert [(r["group"], r["rank"], r["layers"], r["state"]) for r in rows] == \
        [(g, k, "0-3 (4 layers)", "Ready") for g in ("0", "1") for k in ("0", "1")]
    for row in rows:
        shard = by_pod[row["where"]]
        assert float(row["predicted GiB"]) == round(shard["predictedBytes"] / 2**30, 2)
        assert float(row["measured GiB"]) == round((RESIDENT + int(row["rank"]) * 2**20) / 2**30, 2)
        assert (row["capacity GiB"], row["compute"]) == ("-", "-")  # not in a ShardedModel's status
    step = status["plan"]["predictedStepSeconds"]
    assert step > 0 and f"decode step: predicted {step * 1e3:.2f} ms (the plan's critical path)" in out
    assert "`shardctl status --port 8000`" in out  # where the time shares are
    assert missing[0] == 3 and missing[2] == "shardctl: ShardedModel default/nope not found\n"
