"""DevCluster: a Kubernetes cluster on one machine, assembled from the pieces of this package.

    emulated API server on 127.0.0.1 (a kubeconfig for kubectl), with the ShardedModel CRD
    + the cluster network: pod IPs, DNS names, ClusterIPs (network.py)
    + a kubelet that runs every Pod as a local process (processkubelet.py)
    + a Service proxy on every ClusterIP (proxy.py)
    + the real operator: `python -m shard_operator`, a process configured by its environment

Nodes are Node objects: what GPU feature discovery would label, with `sharding.dev/device-kind:
cpu`, so each "GPU" is a CPU memory budget that the worker on it enforces. The operator reads model
files under `host_root`, the nodes' shared filesystem, where hostPath volumes lie.

`DevCluster` runs in an asyncio loop; `BackgroundCluster` runs one in a thread of its own, for
synchronous callers (`shardctl dev-cluster`, the end-to-end tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from shard_operator.inventory import COUNT_LABEL, KIND_LABEL, MEMORY_LABEL, PRODUCT_LABEL, SPEED_LABEL

from .apiserver import serve, write_kubeconfig
from .emulator import Faults
from .network import ClusterNetwork
from .processkubelet import ProcessKubelet, _die_with_parent
from .proxy import ServiceProxy

T = TypeVar("T")

# The operator's settings in the dev cluster: quick reactions on a small cluster. Each is
# SHARD_OPERATOR_<NAME> (settings.py); `operator_env` overrides them.
OPERATOR_ENV = {
    "SETTLE_SECONDS": "2",         # a node change takes effect after 2 s without further changes
    "STATUS_POLL_SECONDS": "2",    # measured memory from each leader every 2 s
    "RESYNC_SECONDS": "5",
    "DEBOUNCE_SECONDS": "0.1",
    "POLL_TIMEOUT_SECONDS": "2",
    "HEALTH_PORT": "0",
    "RESTART_BUDGET": "3",
    "WORKER_IMAGE": "localhost/shard-worker:dev",  # no images here: the kubelet runs the command
}
# Each rank is one process on a machine that also runs every other rank: one thread each.
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Pods share no /dev/shm (each mounts its own): the worker's shared-memory collectives go through
# this directory, which the kubelet points at the pod's own /dev/shm volume. Tensor-parallel peers
# in one pod share memory, as the processes of `shardctl run` do; peers in different pods use gloo.
SHM_DIR_ENV = "SHARD_SHM_DIR"
POOL_LABEL = "sharding.dev/pool"


def sim_node(name: str, *, gpus: int = 2, memory_mib: int = 200, pool: str = "dev",
             speed: float | None = None) -> dict[str, Any]:
    """A Node as GPU feature discovery would label it, whose GPUs are CPU memory budgets."""
    labels = {"kubernetes.io/hostname": name, POOL_LABEL: pool, PRODUCT_LABEL: "sim-cpu",
              MEMORY_LABEL: str(memory_mib), COUNT_LABEL: str(gpus), KIND_LABEL: "cpu"}
    if speed is not None:
        labels[SPEED_LABEL] = str(speed)
    resources = {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": str(gpus)}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"capacity": resources, "allocatable": dict(resources),
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}


# What `shardctl dev-cluster` starts with (examples/dev-cluster/nodes.yaml holds the same): two
# nodes of two 200 MiB "GPUs", room for the demo model at TP=2 x PP=2 and nothing smaller.
DEFAULT_NODES = (("sim-a", 2, 200), ("sim-b", 2, 200))


def default_nodes() -> list[dict[str, Any]]:
    return [sim_node(name, gpus=gpus, memory_mib=memory) for name, gpus, memory in DEFAULT_NODES]


class DevCluster:
    def __init__(self, workdir: str | os.PathLike[str], *, host_root: str | os.PathLike[str] | None = None,
                 nodes: Iterable[dict[str, Any]] = (), operator_env: dict[str, str] | None = None,
                 probe_period: float = 1.0, grace: float = 5.0, run_operator: bool = True,
                 faults: Faults | None = None):
        self.workdir = Path(workdir).resolve()
        self.host_root = Path(host_root).resolve() if host_root else self.workdir / "host"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.operator_log = self.workdir / "operator.log"
        self.nodes = list(nodes)
        self.operator_env = {**OPERATOR_ENV, **(operator_env or {})}
        self.probe_period, self.grace, self.run_operator = probe_period, grace, run_operator
        self.faults = faults  # failures the API server injects (emulator.Faults)
        self.network = ClusterNetwork()
        self.url = ""
        self.emu: Any = None
        self.kubelet: ProcessKubelet | None = None
        self.proxy: ServiceProxy | None = None
        self.operator: asyncio.subprocess.Process | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "DevCluster":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.workdir / "pods", ignore_errors=True)  # a previous run's pods are gone
        try:
            self.emu, self.url = await self._stack.enter_async_context(
                serve(allocate_cluster_ip=self.network.service_ip, faults=self.faults))
            write_kubeconfig(self.kubeconfig, self.url)
            for node in self.nodes:
                await self.emu.k8s_create("v1/nodes", None, node)
            self.kubelet = ProcessKubelet(self.emu, self.network, self.workdir / "pods", host_root=str(self.host_root),
                                          probe_period=self.probe_period, grace=self.grace, extra_env=RANK_ENV,
                                          shm_env=SHM_DIR_ENV)
            await self._stack.enter_async_context(self.kubelet)
            self.proxy = ServiceProxy(self.emu, self.network)
            await self.proxy.start()
            self._stack.push_async_callback(self.proxy.stop)
            if self.run_operator:
                await self.start_operator()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await self.stop_operator()
        await self._stack.aclose()

    # ---------------------------------------------------------------- the operator process
    def operator_environment(self) -> dict[str, str]:
        ours = {"KUBECONFIG": str(self.kubeconfig), "SHARD_OPERATOR_HOST_PATH_PREFIX": str(self.host_root),
                "SHARD_OPERATOR_PVC_ROOT": str(self.host_root / "pvc")}
        return {**os.environ, **ours, **{f"SHARD_OPERATOR_{k}": v for k, v in self.operator_env.items()}}

    async def start_operator(self) -> None:
        with open(self.operator_log, "ab") as log:
            self.operator = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "shard_operator", env=self.operator_environment(), stdout=log,
                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL, preexec_fn=_die_with_parent)

    async def stop_operator(self, timeout: float = 20.0) -> None:
        proc, self.operator = self.operator, None
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    # ---------------------------------------------------------------- what users and tests do
    async def add_node(self, node: dict[str, Any]) -> None:
        await self.emu.k8s_create("v1/nodes", None, node)

    def service_url(self, name: str, namespace: str = "default") -> str | None:
        """http://CLUSTER-IP:PORT of a Service the proxy serves, or None."""
        assert self.proxy is not None
        for (ip, port), (_, owner) in self.proxy.listeners.items():
            if owner == (namespace, name):
                return f"http://{ip}:{port}"
        return None


class BackgroundCluster:
    """A DevCluster in a thread with its own event loop; `call` runs a coroutine function there."""

    def __init__(self, cluster: DevCluster):
        self.cluster = cluster
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="dev-cluster")

    def __enter__(self) -> DevCluster:
        self.start()
        return self.cluster

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> DevCluster:
        self._thread.start()
        try:
            self.call(self.cluster.start)
        except BaseException:
            self._end()
            raise
        return self.cluster

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result(timeout)

    def stop(self) -> None:
        try:
            self.call(self.cluster.stop, timeout=60)
        finally:
            self._end()

    def _end(self) -> None:
        try:
            self.call(_cancel_the_rest, timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()


async def _cancel_the_rest() -> None:
    """Cancel what is still pending on this loop (watch streams, probes) and let it unwind."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
