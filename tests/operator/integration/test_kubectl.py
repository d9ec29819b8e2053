"""The real kubectl against the emulated API server while the real operator runs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import yaml

from shard_devcluster.apiserver import serve, write_kubeconfig
from tests.support.cluster import gpu_node, write_model
from tests.support.fakekubelet import FakeKubelet
from tests.support.k8s_binaries import binary, rows
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
                (columns,) = rows(await kubectl(config, "get", "shardedmodels", "-o", "wide"))
                return columns if columns["PHASE"] == "Ready" and columns["READY"] == ready else None
            columns = await eventually(lambda: row("1/1"), timeout=30)
            assert list(columns) == ["NAME", "PHASE", "TP", "PP", "READY", "URL", "REASON", "REPLICAS", "AGE"]
            assert (columns["NAME"], columns["TP"], columns["PP"], columns["REASON"], columns["REPLICAS"]) == (
                "tiny-llama", "1", "1", "", "1")
            assert columns["URL"] == "http://tiny-llama.default.svc:8000"

            await kubectl(config, "scale", "sm/tiny-llama", "--replicas=2")
            columns = await eventually(lambda: row("2/2"), timeout=30)
            assert columns["REPLICAS"] == "2"
            pods = await kubectl(config, "get", "pods", "-l", "sharding.dev/model=tiny-llama,sharding.dev/role=leader",
                                 "-o", "name")
            assert len(pods.split()) == 2


FOUR_NODES = ROOT / "examples" / "dev-cluster" / "four-nodes.yaml"
DEV_MODEL = ROOT / "examples" / "dev-cluster" / "shardedmodel.yaml"


class Watch:
    """`kubectl get ... -w` running in the background, its output kept."""

    def __init__(self, kubeconfig: Path, *args: str):
        self.args = [str(binary("kubectl")), "--kubeconfig", str(kubeconfig), "get", *args, "-w"]
        self.lines: list[str] = []

    async def __aenter__(self) -> Watch:
        self.proc = await asyncio.create_subprocess_exec(*self.args, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.STDOUT)
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode().rstrip("\n"))

    async def __aexit__(self, *exc) -> None:
        self.proc.terminate()
        await self.proc.wait()
        await self.reader


@pytest.mark.slow
async def test_kubectls_everyday_verbs_behave_as_on_a_cluster(tmp_path):
    """Issue 13's dev-cluster items with the real kubectl: no version skew; a Node List applies
    with validation on; `get -w` prints whole rows on every update; services, events and endpoints
    have their columns; explain reads the CRD's schema; logs come from the kubelet; nodes come and
    go live; the operator's Events say what it did, with an action."""
    import json

    from shard_devcluster.kubeletserver import LogBuffer

    write_model(tmp_path / "host" / "var/lib/shard-operator/models/demo-llama")
    async with serve() as (emu, url), FakeKubelet(emu) as kubelet:
        config = write_kubeconfig(tmp_path / "kubeconfig", url)
        proc = await asyncio.create_subprocess_exec(str(binary("kubectl")), "--kubeconfig", str(config), "version",
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert "Server Version: v1.33" in out.decode() and not err, err.decode()  # no skew warning

        applied = await kubectl(config, "apply", "-f", str(FOUR_NODES))  # a Node List, validated
        assert applied.split("\n")[:4] == [f"node/sim-{x} created" for x in "abcd"]
        explained = await kubectl(config, "explain", "shardedmodel.spec.parallelism")
        assert "tensor" in explained and "Tensor-parallel degree, or auto." in explained

        settings = fast_settings(host_path_prefix=str(tmp_path / "host"), status_poll_seconds=0)
        async with running_operator(url, settings), Watch(config, "shardedmodels") as models, \
                Watch(config, "pods") as pods:
            await kubectl(config, "apply", "-f", str(DEV_MODEL))

            async def ready():
                (row,) = rows(await kubectl(config, "get", "sm", "demo"))
                return row if row["PHASE"] == "Ready" else None
            row = await eventually(ready, timeout=60)

            def printed() -> bool:  # the watches print the last updates: demo Ready, its pods Running
                return any(line.split()[:2] == ["demo", "Ready"] for line in models.lines[1:]) and \
                    any(len(line.split()) == 5 and line.split()[2] == "Running" for line in pods.lines[1:])
            await eventually(printed, timeout=60)
        assert (row["READY"], row["URL"], row["REASON"]) == ("1/1", "http://demo.default.svc:8000", "")
        # Every update is a whole row: the phase changes are seen (before: NAME and AGE only).
        assert models.lines[0].split() == ["NAME", "PHASE", "TP", "PP", "READY", "URL", "REASON", "AGE"]
        before = [line for line in models.lines[1:] if len(line.split()) == 2]  # no status yet: empty cells
        updates = [line for line in models.lines[1:] if line not in before]
        assert before and all(line.split()[0] == "demo" for line in before), "\n".join(models.lines)
        assert [line.split()[1] for line in updates][-2:] == ["Loading", "Ready"], "\n".join(models.lines)
        assert all(re.search(r" [0-9]+/1 +http://demo.default.svc:8000 ", line) for line in updates), \
            "\n".join(models.lines)
        assert pods.lines[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
        assert all(len(line.split()) == 5 for line in pods.lines[1:]) and \
            {"Pending", "Running"} <= {line.split()[2] for line in pods.lines[1:]}, pods.lines

        services = {r["NAME"]: r for r in rows(await kubectl(config, "get", "svc", "-o", "wide"))}
        assert services["demo"]["TYPE"] == "ClusterIP" and services["demo"]["PORT(S)"] == "8000/TCP"
        assert services["demo"]["CLUSTER-IP"].startswith("10.")
        assert "sharding.dev/role=leader" in services["demo"]["SELECTOR"]
        events = rows(await kubectl(config, "get", "events"))
        assert list(events[0]) == ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
        assert {("Normal", "GroupReady", "shardedmodel/demo"), ("Normal", "Planned", "shardedmodel/demo")} <= \
            {(e["TYPE"], e["REASON"], e["OBJECT"]) for e in events}
        assert any(e["REASON"] == "Scheduled" and e["OBJECT"].startswith("pod/demo-0-") for e in events)
        ours = [e for e in json.loads(await kubectl(config, "get", "events", "-o", "json"))["items"]
                if e["involvedObject"]["kind"] == "ShardedModel"]
        assert ours and all(e["action"] != "Action?" and e["reportingComponent"] == "sharding.dev/shard-operator"
                            for e in ours)
        endpoints = {r["NAME"]: r for r in rows(await kubectl(config, "get", "endpoints"))}
        leaders = await kubectl(config, "get", "pods", "-l", "sharding.dev/role=leader", "-o", "json")
        leader = json.loads(leaders)["items"]
        assert endpoints["demo"]["ENDPOINTS"] == f"{leader[0]['status']['podIP']}:8000"  # the ready leader's

        rank = next(r["NAME"] for r in rows(await kubectl(config, "get", "pods")) if r["NAME"].startswith("demo-0-"))
        kubelet.logs[("default", rank)] = LogBuffer(bytearray(b"loading\nready\n"), ended=True)
        assert await kubectl(config, "logs", rank, "--tail=1") == "ready\n"

        await kubectl(config, "delete", "node", "sim-d")
        assert [r["NAME"] for r in rows(await kubectl(config, "get", "nodes"))] == ["sim-a", "sim-b", "sim-c"]

        bad = yaml.safe_load(DEV_MODEL.read_text())
        bad["metadata"]["name"], bad["spec"]["parallelism"] = "bad", {"tensor": 3, "pipeline": 1}
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        async with running_operator(url, settings):
            await kubectl(config, "apply", "-f", str(tmp_path / "bad.yaml"))

            async def failed():
                row = {r["NAME"]: r for r in rows(await kubectl(config, "get", "sm"))}.get("bad") or {}
                return row if row.get("PHASE") == "Failed" else None
            row = await eventually(failed, timeout=30)
        assert (row["READY"], row["REASON"]) == ("0/1", "InvalidParallelism")  # why, on the row


async def test_kubectl_meets_the_servers_validation_of_shardedmodels(tmp_path):
    """kubectl leaves validation to the server (it sends fieldValidation=Strict): a spec the CRD's
    schema or CEL rules refuse is "invalid" with every field named, an unknown field fails strict
    decoding; with --validate=warn it is dropped and kubectl prints the server's warning."""
    async def run(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(str(binary("kubectl")), "--kubeconfig", str(config), *args,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        return await proc.wait(), (await proc.stdout.read()).decode()

    def manifest(name: str, **spec) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel",
                                        "metadata": {"name": name}, "spec": {"model": {"path": "m"}, **spec}}))
        return path
    async with serve(control_plane=False) as (emu, url):
        config = write_kubeconfig(tmp_path / "kubeconfig", url)
        code, out = await run("apply", "-f", str(manifest("bad", parallelism={"tensor": 0}, replicas=-1)))
        assert code == 1 and 'The ShardedModel "bad" is invalid' in out, out
        assert 'spec.parallelism.tensor: Invalid value: 0: must be a positive integer or "auto"' in out
        assert "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0" in out
        code, out = await run("apply", "-f", str(manifest("typo", replica=2)))
        assert code == 1 and 'strict decoding error: unknown field "spec.replica"' in out, out
        code, out = await run("apply", "--validate=warn", "-f", str(manifest("typo", replica=2)))
        assert code == 0 and 'Warning: unknown field "spec.replica"' in out, out
        assert (await emu.k8s_get("sharding.dev/v1alpha1/shardedmodels", "default", "typo"))["spec"]["replicas"] == 1
