"""The operator at scale: many ShardedModels of 8 ranks each against the emulated API server.

    .venv/bin/python bench/operator_scale.py [--models 200] [--steady 15] [--resync 5]

Two processes, like a cluster: a child serves the emulated API server (tests/support) with the
simulated kubelet and one node of 8 GPUs per model; this process runs the real operator (kopf in
its own thread) and creates the ShardedModels over HTTP (each selects its node by label,
tensor=2 x pipeline=4). Reported: time until every pod exists and every model is Ready, API
requests per reconcile while creating, the operator's CPU time, and the writes of a steady state
(there should be none). Exit status 1 when the steady state wrote anything.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kubernetes

from shard_devcluster.apiserver import SM, serve
from tests.support.cluster import gpu_node, sharded_model, write_model
from tests.support.fakekubelet import FakeKubelet
from tests.support.operator import fast_settings, running_operator

WRITES = ("POST", "PATCH", "PUT", "DELETE")
RANKS = 8


# ---------------------------------------------------------------- the API server process
async def api_server(models: int) -> None:
    """Serve, report the URL, then time the rollout and count requests on the parent's cue."""
    async with serve() as (emu, url), FakeKubelet(emu):
        for i in range(models):
            await emu.k8s_create("v1/nodes", None, gpu_node(f"node-{i}", gpus=RANKS, labels={"pool": f"p{i}"}))
        print("url", url, flush=True)
        loop = asyncio.get_running_loop()
        while await emu.k8s_count(SM) == 0:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        while await emu.k8s_count("v1/pods", None, "sharding.dev/component=rank") < models * RANKS:
            await asyncio.sleep(0.1)
        print("pods", time.monotonic() - start, flush=True)
        def ready(o):
            return (o.get("status") or {}).get("phase") == "Ready"
        while await emu.k8s_count(SM, where=ready) < models:
            await asyncio.sleep(0.1)
        print("ready", time.monotonic() - start, flush=True)
        mark = 0
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            if line == "mark":
                mark = len(emu.api_requests())
                print("marked", flush=True)
            elif line == "count":
                since = emu.api_requests()[mark:]
                writes = sum(1 for r in since if str(getattr(r.method, "value", r.method)).upper() in WRITES)
                print("count", len(since), writes, flush=True)


# ---------------------------------------------------------------- the operator process
async def bench(models: int, steady: float, resync: float) -> dict:
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", "--models", str(models),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def expect(word: str) -> list[str]:
        line = (await child.stdout.readline()).decode().split()
        if not line or line[0] != word:
            raise RuntimeError(f"API server process said {line!r}, expected {word}")
        return line[1:]

    async def say(word: str) -> None:
        child.stdin.write(f"{word}\n".encode())
        await child.stdin.drain()

    try:
        (url,) = await expect("url")
        model_dir = write_model(Path(tempfile.mkdtemp(prefix="operator-scale-")) / "tiny")
        settings = fast_settings(resync_seconds=resync, debounce_seconds=0.2, status_poll_seconds=0,
                                 settle_seconds=30, host_path_prefix="")
        async with running_operator(url, settings) as op:
            cpu0 = time.process_time()
            client = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(
                kubernetes.client.Configuration(host=url)))

            def create_all() -> None:
                for i in range(models):
                    client.create_namespaced_custom_object("sharding.dev", "v1alpha1", "default", "shardedmodels",
                                                           sharded_model(f"m{i}", model_dir, tensor=2, pipeline=4,
                                                                         placement={"nodeSelector": {"pool": f"p{i}"}}))
            creating = threading.Thread(target=create_all)
            creating.start()
            (t_pods,) = await expect("pods")
            (t_ready,) = await expect("ready")
            await asyncio.to_thread(creating.join)
            calls_creating, reconciles_creating = dict(op.kube.calls), op.reconciles
            cpu_creating = time.process_time() - cpu0

            await asyncio.sleep(1.0)  # let the last status events settle
            await say("mark")
            await expect("marked")
            calls_before, reconciles_before, cpu1 = Counter(op.kube.calls), op.reconciles, time.process_time()
            await asyncio.sleep(steady)
            await say("count")
            requests, writes = map(int, await expect("count"))
            steady_calls = Counter(op.kube.calls) - calls_before
            steady_reconciles, cpu_steady = op.reconciles - reconciles_before, time.process_time() - cpu1
    finally:
        if child.returncode is None:
            child.stdin.close()
            await child.wait()
    return {"models": models, "t_pods": float(t_pods), "t_ready": float(t_ready),
            "reconciles_creating": reconciles_creating, "calls_creating": calls_creating, "cpu_creating": cpu_creating,
            "steady_seconds": steady, "resync": resync, "steady_reconciles": steady_reconciles,
            "steady_calls": dict(steady_calls), "steady_requests": requests, "steady_writes": writes,
            "cpu_steady": cpu_steady}


def report(r: dict) -> str:
    creating, n = r["calls_creating"], max(r["reconciles_creating"], 1)
    per = {verb: creating.get(verb, 0) / n for verb in ("list", "create", "patch", "delete")}
    steady_n = max(r["steady_reconciles"], 1)
    rows = [
        ("ShardedModels x ranks", f"{r['models']} x {RANKS} = {r['models'] * RANKS} pods on {r['models']} nodes"),
        ("create all -> every pod exists", f"{r['t_pods']:.1f} s"),
        ("create all -> every model Ready", f"{r['t_ready']:.1f} s"),
        ("reconciles while creating",
         f"{r['reconciles_creating']} ({r['reconciles_creating'] / r['models']:.1f} per model)"),
        ("API requests per reconcile while creating",
         f"{sum(creating.values()) / n:.2f} (" + ", ".join(f"{v} {x:.2f}" for v, x in per.items()) + ")"),
        ("operator process CPU while creating (kopf watches included)",
         f"{r['cpu_creating']:.1f} s ({r['cpu_creating'] / n * 1e3:.0f} ms a reconcile)"),
        (f"steady state, {r['steady_seconds']:.0f} s (resync {r['resync']:.0f} s)",
         f"{r['steady_reconciles']} reconciles, {sum(r['steady_calls'].values()) / steady_n:.2f} requests each "
         f"(all lists), {r['steady_writes']} writes of {r['steady_requests']} requests at the API server"),
        ("operator process CPU in the steady state", f"{r['cpu_steady'] / steady_n * 1e3:.1f} ms a reconcile"),
    ]
    return "\n".join(["| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--steady", type=float, default=15.0, help="seconds of steady state to watch")
    parser.add_argument("--resync", type=float, default=5.0, help="seconds between two reconciles of a model")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the API server process
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.serve:
        asyncio.run(api_server(args.models))
        return 0
    result = asyncio.run(bench(args.models, args.steady, args.resync))
    print(report(result))
    return 1 if result["steady_writes"] else 0


if __name__ == "__main__":
    sys.exit(main())
