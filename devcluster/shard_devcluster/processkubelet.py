"""ProcessKubelet: the dev cluster's kubelet, which runs every Pod as a local process.

What a kubelet on each Node would do, for all Nodes of the one-machine cluster at once:

* schedule: a pod pinned to a Node (spec.nodeName or a `metadata.name` node-affinity term) is bound
  there; one pinned to a Node that does not exist stays Pending/Unschedulable;
* network: the pod gets its own loopback address and DNS names (network.py). A pod has its own
  network namespace and binds "every address"; here that would collide, so `SHARD_HOST` (the
  worker's bind address) is the pod's address. `MASTER_ADDR` (a DNS name) is resolved before the
  process starts;
* volumes: hostPath lies under `host_root` (the "node's" filesystem), configMap and secret volumes
  are written out, emptyDirs are fresh directories; env values and arguments under a mount path
  point there;
* devices: a container that requests a GPU gets its node's GPU memory (label
  `nvidia.com/gpu.memory`) as `SHARD_MEMORY_BUDGET`, which the worker enforces (per rank: each
  rank of a pod holding several GPUs has one);
* /dev/shm: a pod's own, shared by its processes only: with `shm_env`, that variable names the
  directory of the pod's volume mounted at /dev/shm (the processes here share the machine's);
* runs the first container's command (`python` is this interpreter; `$(VAR)` references to its
  env expanded), and its output is the pod's log (`kubectl logs`);
* probes over HTTP: startup and readiness (the pod's Ready condition) every `probe_period`
  seconds at most, so pods serve soon; liveness (a failing rank is killed) at the pod's own period;
* lifecycle: restartPolicy Never: an exit makes the pod Succeeded or Failed with the exit code and,
  under FallbackToLogsOnError, the log's tail as message; a deleted pod gets SIGTERM, then SIGKILL
  after its grace period (at most `grace` seconds);
* a Node that is deleted takes its processes with it: they are killed, and its pods lose their
  Ready condition (the node controller's part) but keep their last phase, as on a real cluster.

Not done: restarting containers (restartPolicy Always), init containers, resource limits other than
the GPU memory, exec/tcp probes.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock

from shard_contract.units import MiB
from shard_operator.inventory import MEMORY_LABEL

from .kubelet import NODES, PODS, FakeKubelet, _now, required_node
from .network import ClusterNetwork, PodAddress, container_port, pod_dns_names, taken_ports

CONFIGMAPS = "v1/configmaps"
SECRETS = "v1/secrets"
LOG_TAIL_BYTES = 2048  # what FallbackToLogsOnError keeps of the log as the termination message


class PodError(Exception):
    """Why a pod's container cannot start (its waiting reason and message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass
class Sandbox:
    """One pod this kubelet runs."""

    uid: str
    node: str
    address: PodAddress
    directory: Path
    proc: asyncio.subprocess.Process | None = None
    lost: bool = False         # its node is gone: nobody reports on it any more
    deleted: bool = False      # the pod was deleted: the process is being stopped
    killed_by: str = ""        # why the kubelet killed the process (a failed probe)
    tasks: list[asyncio.Task] = field(default_factory=list)


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the kubelet's process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references in a command or its arguments: the container's own env vars
    are substituted, unknown ones are left as written, and $$ is a literal $."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(one, value)


def _requests_gpu(container: dict[str, Any]) -> bool:
    limits = (container.get("resources") or {}).get("limits") or {}
    return any(key.endswith("/gpu") and str(value) not in ("0", "") for key, value in limits.items())


class ProcessKubelet(FakeKubelet):
    def __init__(self, emu, network: ClusterNetwork, workdir: str | os.PathLike[str], *, host_root: str = "/",
                 probe_period: float = 1.0, grace: float = 5.0, dns_wait: float = 120.0,
                 extra_env: dict[str, str] | None = None, bind_env: tuple[str, ...] = ("SHARD_HOST",),
                 shm_env: str | None = None):
        super().__init__(emu, run_processes=True, extra_env=extra_env)
        # Env vars set to the pod's address: what a process binds instead of "every address",
        # which in a pod means its own network namespace and here would collide with other pods.
        self.bind_env = bind_env
        # Env var set to the directory of the pod's /dev/shm volume: what a process uses instead of
        # the machine's /dev/shm, which here every pod would share.
        self.shm_env = shm_env
        self.network, self.workdir, self.host_root = network, Path(workdir), Path(host_root)
        self.probe_period, self.grace, self.dns_wait = probe_period, grace, dns_wait
        self.sandboxes: dict[tuple[str, str], Sandbox] = {}
        self._session: aiohttp.ClientSession | None = None
        self._nodes_task: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        bus = self.emu._buses[kmock.resource(NODES)]
        mark = await bus.mark()
        self._nodes_task = asyncio.create_task(self._watch_nodes(bus, mark))
        await super().start()

    async def stop(self) -> None:
        if self._nodes_task:
            self._nodes_task.cancel()
        if self._main:
            self._main.cancel()
        for t in list(self._tasks):
            t.cancel()
        for sandbox in list(self.sandboxes.values()):
            for task in sandbox.tasks:
                task.cancel()
            await self._kill(sandbox, signal.SIGKILL)
        if self._session:
            await self._session.close()

    # ---------------------------------------------------------------- what tests and users do
    def process(self, namespace: str, name: str) -> asyncio.subprocess.Process | None:
        sandbox = self.sandboxes.get((namespace, name))
        return sandbox.proc if sandbox else None

    async def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Send a signal to a pod's process (a rank crashes); returns its pid."""
        proc = self.process(namespace, name)
        if proc is None or proc.returncode is not None:
            raise LookupError(f"pod {namespace}/{name} runs no process")
        proc.send_signal(sig)
        return proc.pid

    # ---------------------------------------------------------------- events
    async def _loop(self, bus, mark) -> None:
        async for ev in bus.stream(since=mark):
            pod = ev["object"]
            meta = pod["metadata"]
            key = (meta.get("namespace"), meta["name"])
            if ev["type"] == "ADDED":
                self._spawn(self._on_added(pod))
            elif ev["type"] == "DELETED" or meta.get("deletionTimestamp"):
                sandbox = self.sandboxes.get(key)
                if sandbox is not None and sandbox.uid == meta.get("uid") and not sandbox.deleted:
                    sandbox.deleted = True
                    self.network.unregister(sandbox.uid)  # no longer an endpoint, no longer a name
                    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                    self._spawn(self._terminate(key, sandbox, min(float(grace), self.grace)))

    async def _watch_nodes(self, bus, mark) -> None:
        async for ev in bus.stream(since=mark):
            if ev["type"] == "DELETED":
                await self._node_gone(ev["object"]["metadata"]["name"])

    async def _node_gone(self, node: str) -> None:
        for (ns, name), sandbox in list(self.sandboxes.items()):
            if sandbox.node != node or sandbox.lost:
                continue
            sandbox.lost = True
            self.network.unregister(sandbox.uid)
            await self._kill(sandbox, signal.SIGKILL)
            await self._set_status(ns, name, {"conditions": [
                {"type": "Ready", "status": "False", "reason": "NodeLost", "message": f"node {node} is gone"},
                {"type": "ContainersReady", "status": "False", "reason": "NodeLost"}]})

    # ---------------------------------------------------------------- one pod
    async def _on_added(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns, name, uid = meta.get("namespace"), meta["name"], meta.get("uid", "")
        if (pod.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed"):
            return
        node_name = required_node(pod)
        node = await self.emu.k8s_get(NODES, None, node_name) if node_name else None
        if node is None:
            why = f"node {node_name} does not exist" if node_name else "no node pinned (this scheduler needs one)"
            await self._set_status(ns, name, {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": f"0/1 nodes are available: {why}"}]})
            return
        if not spec.get("nodeName"):
            try:
                await self.emu.k8s_patch(PODS, ns, name, {"spec": {"nodeName": node_name}})
            except Exception:
                return  # gone already
        container = (spec.get("containers") or [{}])[0]
        address = self.network.pod_address()
        sandbox = Sandbox(uid=uid, node=node_name, address=address, directory=self.workdir / ns / f"{name}-{uid[:8]}")
        self.sandboxes[(ns, name)] = sandbox
        self.network.register(pod_dns_names(pod), uid, address)
        await self._set_status(ns, name, {
            "phase": "Pending", "hostIP": "127.0.0.1", "podIP": address.ip, "podIPs": [{"ip": address.ip}],
            "startTime": _now(), "conditions": [{"type": "PodScheduled", "status": "True"},
                                                {"type": "Ready", "status": "False"}],
            "containerStatuses": [self._cstatus(container, False, {"waiting": {"reason": "ContainerCreating"}})]})
        taken = taken_ports(address, container)
        if taken:  # on a real node each pod has its own ports; here one stray listener blocks them all
            message = (f"port {', '.join(map(str, taken))} is taken on every address of this machine by another "
                       f"process; stop it: the dev cluster's pods listen on their own addresses ({address.ip})")
            await self._set_status(ns, name, {"phase": "Failed", "reason": "PortInUse", "message": message,
                                              "containerStatuses": [self._cstatus(container, False, {"terminated": {
                                                  "exitCode": 1, "reason": "PortInUse", "message": message,
                                                  "finishedAt": _now()}})]})
            self.network.unregister(uid)
            del self.sandboxes[(ns, name)]
            return
        try:
            mounts = await self._volumes(pod, sandbox)
            env = await self._environment(pod, container, node, sandbox, mounts)
            defined = {e["name"]: env[e["name"]] for e in container.get("env") or [] if e.get("name") in env}
            argv = [self._path(expand(a, defined), mounts)
                    for a in list(container.get("command") or []) + list(container.get("args") or [])]
            if not argv:
                raise PodError("CreateContainerConfigError", "the container has no command (no image to run here)")
            if argv[0] == "python":
                argv[0] = sys.executable
        except PodError as err:
            await self._set_status(ns, name, {"containerStatuses": [self._cstatus(container, False, {
                "waiting": {"reason": err.reason, "message": err.message}})]})
            return
        if sandbox.deleted or sandbox.lost:
            return
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=self._path(container.get("workingDir") or "", mounts) or str(sandbox.directory),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent)
        except (OSError, ValueError) as err:
            await self._set_status(ns, name, {"phase": "Failed", "reason": "StartError", "message": str(err)})
            return
        sandbox.proc = proc
        if sandbox.deleted or sandbox.lost:  # deleted while it started
            await self._kill(sandbox, signal.SIGKILL)
        probed = any(container.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        await self._set_status(ns, name, {
            "phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"},
                                               {"type": "Ready", "status": str(not probed)},
                                               {"type": "ContainersReady", "status": str(not probed)}],
            "containerStatuses": [self._cstatus(container, not probed, {"running": {"startedAt": _now()}})]})
        if probed:
            sandbox.tasks.append(asyncio.create_task(self._probe(ns, name, sandbox, container)))
        await self._run(ns, name, sandbox, container)

    async def _run(self, ns: str, name: str, sandbox: Sandbox, container: dict) -> None:
        """Collect the output until the process exits, then report how it ended."""
        proc = sandbox.proc
        assert proc is not None and proc.stdout is not None
        logs = self.emu.pod_logs.setdefault((ns, name), bytearray())
        while line := await proc.stdout.readline():
            logs += line
        code = await proc.wait()
        for task in sandbox.tasks:
            task.cancel()
        if self.sandboxes.get((ns, name)) is sandbox:
            del self.sandboxes[(ns, name)]
        self.network.unregister(sandbox.uid)
        shutil.rmtree(sandbox.directory, ignore_errors=True)  # its volumes; the log stays with the pod
        if sandbox.lost or sandbox.deleted:
            return  # no kubelet left to tell, or no pod left to tell about
        message = sandbox.killed_by
        if not message and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = bytes(logs[-LOG_TAIL_BYTES:]).decode(errors="replace")
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now(),
                      **({"message": message} if message else {})}
        await self._set_status(ns, name, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}],
            "containerStatuses": [self._cstatus(container, False, {"terminated": terminated})]})

    async def _terminate(self, key: tuple[str, str], sandbox: Sandbox, grace: float) -> None:
        await self._kill(sandbox, signal.SIGTERM)
        proc = sandbox.proc
        if proc is None:
            return
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            await self._kill(sandbox, signal.SIGKILL)

    @staticmethod
    async def _kill(sandbox: Sandbox, sig: int) -> None:
        proc = sandbox.proc
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                await proc.wait()

    # ---------------------------------------------------------------- what the process sees
    async def _volumes(self, pod: dict, sandbox: Sandbox) -> dict[str, str]:
        """Mount path -> local directory, for the first container's volumeMounts."""
        spec, ns = pod.get("spec") or {}, pod["metadata"].get("namespace")
        local: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            vname = volume["name"]
            here = sandbox.directory / "volumes" / vname
            if "hostPath" in volume:
                path = self.host_root / volume["hostPath"]["path"].lstrip("/")
                if volume["hostPath"].get("type") == "Directory" and not path.is_dir():
                    raise PodError("CreateContainerConfigError",
                                   f"hostPath {volume['hostPath']['path']} is not a directory on the node ({path})")
                local[vname] = path
            elif "configMap" in volume or "secret" in volume:
                await self._project(volume, ns, here)
                local[vname] = here
            elif "emptyDir" in volume:
                here.mkdir(parents=True, exist_ok=True)
                local[vname] = here
            elif "persistentVolumeClaim" in volume:  # claims are directories under the host root
                local[vname] = self.host_root / "pvc" / volume["persistentVolumeClaim"]["claimName"]
            else:
                raise PodError("CreateContainerConfigError", f"volume {vname}: only hostPath, configMap, secret, "
                               "emptyDir and persistentVolumeClaim volumes run here")
        sandbox.directory.mkdir(parents=True, exist_ok=True)
        container = (spec.get("containers") or [{}])[0]
        mounts = {}
        for mount in container.get("volumeMounts") or []:
            if mount["name"] in local:
                mounts[mount["mountPath"]] = str(local[mount["name"]] / mount.get("subPath", ""))
        return mounts

    async def _project(self, volume: dict, ns: str, here: Path) -> None:
        """Write a configMap's or a Secret's keys (a Secret's decoded from base64) as files with the
        volume's mode (0644 unless it says otherwise), as the kubelet does."""
        if "configMap" in volume:
            source, kind, name = volume["configMap"], "configmap", volume["configMap"]["name"]
        else:
            source, kind, name = volume["secret"], "secret", volume["secret"]["secretName"]
        obj = await self.emu.k8s_get(CONFIGMAPS if kind == "configmap" else SECRETS, ns, name)
        if obj is None:
            raise PodError("CreateContainerConfigError", f"{kind} {name} not found")
        data = {k: v.encode() if kind == "configmap" else base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        here.mkdir(parents=True, exist_ok=True)
        for item in source.get("items") or [{"key": k, "path": k} for k in data]:
            target = here / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.get(item["key"], b""))
            target.chmod(item.get("mode", source.get("defaultMode", 0o644)))

    @staticmethod
    def _path(value: str, mounts: dict[str, str]) -> str:
        """A container path as this machine sees it (the longest mount that holds it)."""
        for inside in sorted(mounts, key=len, reverse=True):
            root = inside.rstrip("/")
            if value == inside or value.startswith(root + "/"):
                return mounts[inside].rstrip("/") + value[len(root):]
        return value

    async def _environment(self, pod: dict, container: dict, node: dict, sandbox: Sandbox,
                           mounts: dict[str, str]) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace") or "",
                  "status.podIP": sandbox.address.ip, "spec.nodeName": sandbox.node}
        env = {**os.environ, **self.extra_env}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = self._path(str(e["value"]), mounts)
            elif ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") in fields:
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        env.update(HOSTNAME=meta["name"], POD_NAME=meta["name"], POD_NAMESPACE=meta.get("namespace") or "",
                   POD_IP=sandbox.address.ip, **dict.fromkeys(self.bind_env, sandbox.address.ip))
        if self.shm_env and "/dev/shm" in mounts:
            env[self.shm_env] = mounts["/dev/shm"]
        labels = (node.get("metadata") or {}).get("labels") or {}
        if MEMORY_LABEL in labels and _requests_gpu(container):
            env["SHARD_MEMORY_BUDGET"] = str(int(labels[MEMORY_LABEL]) * MiB)
        if "MASTER_ADDR" in env:  # torch's rendezvous: a DNS name, resolved as the process would
            env["MASTER_ADDR"] = (await self._resolve(env["MASTER_ADDR"], sandbox)).ip
        return env

    async def _resolve(self, name: str, sandbox: Sandbox) -> PodAddress:
        """Wait for a DNS name to answer (its pod may start later), as a resolver's retries would."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.dns_wait
        while (address := self.network.resolve(name)) is None:
            if sandbox.deleted or sandbox.lost:
                raise PodError("ContainerCreating", "deleted while waiting")
            if loop.time() > deadline:
                raise PodError("CreateContainerError", f"{name} did not resolve within {self.dns_wait:.0f}s")
            await asyncio.sleep(0.05)
        return address

    # ---------------------------------------------------------------- probes
    async def _get(self, sandbox: Sandbox, container: dict, probe: dict) -> bool:
        http = probe.get("httpGet") or {}
        port = container_port(container, http.get("port", 80))
        if port is None:
            return False
        url = f"http://{http.get('host') or sandbox.address.ip}:{port}{http.get('path', '/')}"
        assert self._session is not None
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=probe.get("timeoutSeconds", 1))) as r:
                return 200 <= r.status < 400
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _alive(self, sandbox: Sandbox) -> bool:
        return sandbox.proc is not None and sandbox.proc.returncode is None and not sandbox.lost

    def _fast(self, probe: dict) -> float:
        """Startup and readiness decide how soon a pod serves: at most `probe_period` apart."""
        return min(float(probe.get("periodSeconds", 10)), self.probe_period)

    async def _probe(self, ns: str, name: str, sandbox: Sandbox, container: dict) -> None:
        """The startup probe, then readiness and liveness side by side, as a kubelet runs them."""
        startup, readiness, liveness = (container.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        if startup is not None:
            failures = 0
            while not await self._get(sandbox, container, startup):
                failures += 1
                if failures >= int(startup.get("failureThreshold", 3)):
                    await self._kill_for(sandbox, f"Startup probe failed {failures} times")
                    return
                await asyncio.sleep(self._fast(startup))
                if not self._alive(sandbox):
                    return
        checks = [self._readiness(ns, name, sandbox, container, readiness)]
        if liveness is not None:
            checks.append(self._liveness(sandbox, container, liveness))
        await asyncio.gather(*checks)

    async def _readiness(self, ns: str, name: str, sandbox: Sandbox, container: dict, probe: dict | None) -> None:
        """The pod's Ready condition: at the first success; lost after failureThreshold failures."""
        ready, failures = None, 0
        while self._alive(sandbox) and not sandbox.deleted:
            ok = probe is None or await self._get(sandbox, container, probe)
            failures = 0 if ok else failures + 1
            now_ready = ok or (bool(ready) and failures < int(probe.get("failureThreshold", 3)))
            if now_ready != ready and self._alive(sandbox) and not sandbox.deleted:
                ready = now_ready
                await self._set_status(ns, name, {
                    "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": str(ready)},
                                   {"type": "ContainersReady", "status": str(ready)}],
                    "containerStatuses": [self._cstatus(container, ready, {"running": {"startedAt": _now()}})]})
            if probe is None:
                return
            await asyncio.sleep(self._fast(probe))

    async def _liveness(self, sandbox: Sandbox, container: dict, probe: dict) -> None:
        """Kill the container after failureThreshold failures in a row. At the pod's own period: a
        busy machine must not kill ranks that a cluster would keep."""
        failures = 0
        while self._alive(sandbox):
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))
            failures = 0 if await self._get(sandbox, container, probe) else failures + 1
            if failures >= int(probe.get("failureThreshold", 3)):
                await self._kill_for(sandbox, f"Liveness probe failed {failures} times")
                return

    async def _kill_for(self, sandbox: Sandbox, reason: str) -> None:
        sandbox.killed_by = reason
        await self._kill(sandbox, signal.SIGKILL)
