"""The real kubectl against the emulated API server while the real operator runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shard_devcluster.apiserver import serve, write_kubeconfig
from shard_devcluster.kubelet import FakeKubelet
from tests.support.cluster import gpu_node, write_model
from tests.support.k8s_binaries import binary
from tests.support.operator import eventually, fast_settings, running_operator

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "shardedmodel.yaml"


async def kubectl(kubeconfig: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(str(binary("kubectl")), "--kubeconfig", str(kubeconfig), *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
    return out.decode()


@pytest.mark.slow
async def test_kubectl_applies_the_example_and_reads_the_printer_columns(tmp_path):
    # The example's hostPath (/var/lib/shard-operator/models) as the operator sees it: under a prefix.
    host = tmp_path / "host"
    write_model(host / "var/lib/shard-operator/models/tiny-llama")
    async with serve() as (emu, url), FakeKubelet(emu):
        for name in ("gpu-a", "gpu-b"):
            await emu.k8s_create("v1/nodes", None, gpu_node(name, gpus=1))
        config = write_kubeconfig(tmp_path / "kubeconfig", url)
        async with running_operator(url, fast_settings(host_path_prefix=str(host), status_poll_seconds=0)):
            assert "shardedmodel.sharding.dev/tiny-llama created" in await kubectl(config, "apply", "-f", str(EXAMPLE))

            async def row(ready: str):
                lines = (await kubectl(config, "get", "shardedmodels")).splitlines()
                columns = dict(zip(lines[0].split(), lines[1].split()))
                return columns if columns["PHASE"] == "Ready" and columns["READY"] == ready else None
            columns = await eventually(lambda: row("1"), timeout=30)
            assert list(columns) == ["NAME", "PHASE", "TP", "PP", "READY", "REPLICAS", "AGE"]
            assert (columns["NAME"], columns["TP"], columns["PP"], columns["REPLICAS"]) == ("tiny-llama", "1", "1", "1")

            await kubectl(config, "scale", "sm/tiny-llama", "--replicas=2")
            columns = await eventually(lambda: row("2"), timeout=30)
            assert columns["REPLICAS"] == "2"
            pods = await kubectl(config, "get", "pods", "-l", "sharding.dev/model=tiny-llama,sharding.dev/role=leader",
                                 "-o", "name")
            assert len(pods.split()) == 2
