"""DevCluster: a Kubernetes cluster on one machine, assembled from the pieces of this package.

    emulated API server on 127.0.0.1 (a kubeconfig for kubectl), with the ShardedModel CRD, and its
      control plane: scheduler, node lifecycle, pod GC, endpoints (controlplane.py)
      -- or any other API server, named by a kubeconfig (`attach`)
    + the cluster network: pod IPs and ClusterIPs mapped onto loopback, DNS (network.py, dns.py)
    + a kubelet that runs every Pod as a local process (processkubelet.py)
    + a Service proxy on every ClusterIP (proxy.py)
    + an HTTP proxy into the cluster network for processes outside the pods (gateway.py)
    + the real operator: `python -m shard_operator`, a process configured by its environment

The kubelet, the proxies and DNS use only the Kubernetes HTTP API, so attached to a real control
plane (kube-apiserver, kube-scheduler, kube-controller-manager) they run its pods just the same.

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
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from shard_contract.env import HOST_ENV, SHM_DIR_ENV
from shard_operator.planning.inventory import COUNT_LABEL, KIND_LABEL, MEMORY_LABEL, PRODUCT_LABEL, SPEED_LABEL

from .dns import ClusterDNS
from .gateway import Gateway
from .kubeapi import KubeApi, path
from .network import DEFAULT_POD_CIDR, ClusterNetwork
from .processkubelet import ProcessKubelet, _die_with_parent
from .proxy import ServiceProxy

if TYPE_CHECKING:  # the emulator is loaded only when the cluster runs one (not when attached)
    from .apirules import Faults
    from .controlplane import ControlPlane

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
# What a pod's process binds instead of "every address", which here would take the port from every
# other pod and the Service proxy: the worker's HTTP server and the operator's health and metrics
# endpoints (the chart's operator Deployment, run by this kubelet).
BIND_ENV = (HOST_ENV, "SHARD_OPERATOR_BIND_ADDRESS")
POOL_LABEL = "sharding.dev/pool"


def sim_node(name: str, *, gpus: int = 2, memory_mib: int = 200, pool: str = "dev",
             speed: float | None = None) -> dict[str, Any]:
    """A Node as GPU feature discovery would label it, whose GPUs are CPU memory budgets."""
    labels = {"kubernetes.io/hostname": name, POOL_LABEL: pool, PRODUCT_LABEL: "sim-cpu",
              MEMORY_LABEL: str(memory_mib), COUNT_LABEL: str(gpus), KIND_LABEL: "cpu"}
    if speed is not None:
        labels[SPEED_LABEL] = str(speed)
    # `pods`: what a kubelet declares (110 by default, --max-pods); kube-scheduler places no pod on a
    # Node without it ("Too many pods").
    resources = {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": str(gpus), "pods": "110"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {},
            "status": {"capacity": resources, "allocatable": dict(resources),
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}


# What `shardctl dev-cluster` starts with (examples/dev-cluster/nodes.yaml holds the same): two
# nodes of two 200 MiB "GPUs", room for the demo model at TP=2 x PP=2 and nothing smaller.
DEFAULT_NODES = (("sim-a", 2, 200), ("sim-b", 2, 200))


def default_nodes() -> list[dict[str, Any]]:
    return [sim_node(name, gpus=gpus, memory_mib=memory) for name, gpus, memory in DEFAULT_NODES]


class DevCluster:
    """The cluster. `attach`: a kubeconfig of another API server, whose control plane is used
    instead of starting the emulated one (`faults` and the timings below are the emulator's)."""

    def __init__(self, workdir: str | os.PathLike[str], *, host_root: str | os.PathLike[str] | None = None,
                 nodes: Iterable[dict[str, Any]] = (), operator_env: dict[str, str] | None = None,
                 probe_period: float = 1.0, grace: float = 5.0, run_operator: bool = True,
                 faults: Faults | None = None, attach: str | os.PathLike[str] | None = None,
                 node_monitor_grace: float = 40.0, pod_gc_quarantine: float = 40.0, renew_seconds: float = 10.0,
                 pod_cidr: str = DEFAULT_POD_CIDR, node_selector: str = ""):
        self.workdir = Path(workdir).resolve()
        self.host_root = Path(host_root).resolve() if host_root else self.workdir / "host"
        self.attach = Path(attach).resolve() if attach else None
        self.kubeconfig = self.attach or self.workdir / "kubeconfig"
        self.operator_log = self.workdir / "operator.log"
        self.nodes = list(nodes)
        self.operator_env = {**OPERATOR_ENV, **(operator_env or {})}
        self.probe_period, self.grace, self.run_operator = probe_period, grace, run_operator
        self.faults = faults  # failures the API server injects (emulator.Faults)
        self.node_monitor_grace, self.pod_gc_quarantine = node_monitor_grace, pod_gc_quarantine
        self.renew_seconds = renew_seconds
        self.node_selector = node_selector  # the Nodes this cluster's kubelet serves (all: "")
        self.network = ClusterNetwork(pod_cidr)
        self.url = ""
        self.emu: Any = None
        self.control_plane: ControlPlane | None = None
        self.api: KubeApi | None = None
        self.kubelet: ProcessKubelet | None = None
        self.proxy: ServiceProxy | None = None
        self.gateway = Gateway(self.network)
        self.operator: asyncio.subprocess.Process | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> DevCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.workdir / "pods", ignore_errors=True)  # a previous run's pods are gone
        try:
            if self.attach is None:
                from .apiserver import serve, write_kubeconfig
                from .controlplane import ControlPlane

                self.emu, self.url = await self._stack.enter_async_context(serve(control_plane=False,
                                                                                 faults=self.faults,
                                                                               pod_address=self.network.local))
                self.control_plane = await self._stack.enter_async_context(ControlPlane(
                    self.emu, node_monitor_grace=self.node_monitor_grace, pod_gc_quarantine=self.pod_gc_quarantine))
                write_kubeconfig(self.kubeconfig, self.url)
                self.api = KubeApi(self.url)
            else:
                self.api = KubeApi.from_kubeconfig(self.attach)
                self.url = self.api.server
                await self._install_crd()
            self._stack.push_async_callback(self.api.close)
            for node in self.nodes:
                await self.add_node(node)
            dns = ClusterDNS(self.api, self.network)
            tasks = [asyncio.create_task(run) for run in dns.runners()]
            self._stack.callback(lambda: [task.cancel() for task in tasks])
            self.kubelet = ProcessKubelet(self.api, self.network, self.workdir / "pods", host_root=str(self.host_root),
                                          probe_period=self.probe_period, grace=self.grace, extra_env=RANK_ENV,
                                          renew_seconds=self.renew_seconds, node_selector=self.node_selector,
                                          shm_env=SHM_DIR_ENV, bind_env=BIND_ENV)
            await self._stack.enter_async_context(self.kubelet)
            self.proxy = ServiceProxy(self.api, self.network)
            await self.proxy.start()
            self._stack.push_async_callback(self.proxy.stop)
            await self.gateway.start()
            self._stack.push_async_callback(self.gateway.stop)
            if self.run_operator:
                await self.start_operator()
        except BaseException:
            await self.stop()
            raise

    async def _install_crd(self) -> None:
        """The ShardedModel CRD on the attached API server, created unless it exists: an existing one
        is left as it is (Helm's, say, which owns it and would find it changed)."""
        from shard_operator.api.crd import build_crd

        assert self.api is not None
        await self.api.create(path("apiextensions.k8s.io/v1/customresourcedefinitions"), build_crd())

    async def stop(self) -> None:
        await self.stop_operator()
        await self._stack.aclose()

    # ---------------------------------------------------------------- the operator process
    def operator_environment(self) -> dict[str, str]:
        # The operator reaches leaders at their pod IPs through the gateway; the API server directly.
        direct = ",".join(filter(None, ["127.0.0.1", "localhost", urlsplit(self.url).hostname]))
        ours = {"KUBECONFIG": str(self.kubeconfig), "SHARD_OPERATOR_HOST_PATH_PREFIX": str(self.host_root),
                "SHARD_OPERATOR_PVC_ROOT": str(self.host_root / "pvc"), "http_proxy": self.gateway.url,
                "no_proxy": direct, "NO_PROXY": direct}
        return {**os.environ, **ours, **{f"SHARD_OPERATOR_{k}": v for k, v in self.operator_env.items()}}

    async def start_operator(self) -> None:
        with open(self.operator_log, "ab") as log:  # noqa: ASYNC230 -- opened once, to hand to the child
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
        """Register a Node (as `kubectl apply` of it would); its kubelet is this cluster's."""
        assert self.api is not None
        await self.api.create(path("v1/nodes"), node)

    def service_url(self, name: str, namespace: str = "default") -> str | None:
        """http://ADDRESS:PORT where this machine reaches a Service the proxy serves, or None."""
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

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, timeout: float | None = None) -> T:
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
