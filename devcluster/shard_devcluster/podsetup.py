"""What a pod's process sees, as the process kubelet prepares it: its volumes (hostPath under the
host root, configMaps and Secrets written out, emptyDirs, claims as directories), its container
paths mapped onto this machine, and its environment (env values and field references, the pod's
address for the variables a process binds, its /dev/shm, a GPU's memory budget, the rendezvous
address resolved); and the pod's record (`Sandbox`: what is reported of it, its process) and why its
container cannot start (`PodError`)."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from shard_contract.env import ENV_NAMES
from shard_contract.units import MiB
from shard_operator.planning.inventory import MEMORY_LABEL

from .kubeapi import ApiStatusError, KubeApi, path, timestamp
from .kubeletserver import LogBuffer
from .network import ClusterNetwork

HOST_IP = "127.0.0.1"  # every node's address: the kubelet's endpoint listens there


class PodError(Exception):
    """Why a pod's container cannot start (its waiting reason and message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass
class Sandbox:
    """One pod this kubelet runs, and the status it reports for it."""

    uid: str
    namespace: str
    name: str
    node: str
    ip: str                    # the pod IP, as the API shows it
    local: str                 # where its processes listen on this machine
    directory: Path
    container: dict[str, Any]
    logs: LogBuffer = field(default_factory=LogBuffer)
    proc: asyncio.subprocess.Process | None = None
    phase: str = "Pending"
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    ready: bool = False
    started_at: str = ""
    start_time: str = field(default_factory=timestamp)
    reason: dict[str, str] = field(default_factory=dict)  # the pod's own reason and message
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # condition -> (status, since)
    lost: bool = False         # its node is gone: nobody reports on it any more
    deleting: bool = False     # the pod is being deleted: the process is being stopped
    killed_by: str = ""        # why the kubelet killed the process (a failed probe)
    main: asyncio.Task | None = None      # starts the process, then collects its output
    stopper: asyncio.Task | None = None   # stops it after the pod's deletion
    tasks: list[asyncio.Task] = field(default_factory=list)  # its probes
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def alive(self) -> bool:
        """Its process runs, and its node is still there."""
        return self.proc is not None and self.proc.returncode is None and not self.lost

    async def kill(self, sig: int) -> None:
        """Signal its process, if it runs; after SIGKILL, wait until it is gone."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                await proc.wait()

    def condition(self, type_: str, ok: bool) -> dict[str, Any]:
        """A pod condition whose lastTransitionTime moves only when its status does."""
        status = str(ok)
        old = self.transitions.get(type_)
        if old is None or old[0] != status:
            self.transitions[type_] = old = (status, timestamp())
        return {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": old[1]}


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references in a command or its arguments: the container's own env vars
    are substituted, unknown ones are left as written, and $$ is a literal $."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(one, value)


def requests_gpu(container: dict[str, Any]) -> bool:
    limits = (container.get("resources") or {}).get("limits") or {}
    return any(key.endswith("/gpu") and str(value) not in ("0", "") for key, value in limits.items())


@dataclass
class PodSetup:
    """The kubelet's settings a pod's process is prepared with (`ProcessKubelet` holds one)."""

    api: KubeApi
    network: ClusterNetwork
    host_root: Path
    extra_env: dict[str, str]
    bind_env: tuple[str, ...]
    shm_env: str | None
    dns_wait: float

    async def volumes(self, pod: dict, sandbox: Sandbox) -> dict[str, str]:
        """Mount path -> local directory, for the first container's volumeMounts."""
        spec, ns = pod.get("spec") or {}, pod["metadata"]["namespace"]
        local: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            vname = volume["name"]
            here = sandbox.directory / "volumes" / vname
            if "hostPath" in volume:
                where = self.host_root / volume["hostPath"]["path"].lstrip("/")
                if volume["hostPath"].get("type") == "Directory" and not where.is_dir():
                    raise PodError("CreateContainerConfigError",
                                   f"hostPath {volume['hostPath']['path']} is not a directory on the node ({where})")
                local[vname] = where
            elif "configMap" in volume or "secret" in volume:
                await self.project(volume, ns, here)
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
        mounts = {}
        for mount in sandbox.container.get("volumeMounts") or []:
            if mount["name"] in local:
                mounts[mount["mountPath"]] = str(local[mount["name"]] / mount.get("subPath", ""))
        return mounts

    async def project(self, volume: dict, ns: str, here: Path) -> None:
        """Write a configMap's or a Secret's keys (a Secret's decoded from base64) as files with the
        volume's mode (0644 unless it says otherwise), as the kubelet does."""
        if "configMap" in volume:
            source, kind, name = volume["configMap"], "configmaps", volume["configMap"]["name"]
        else:
            source, kind, name = volume["secret"], "secrets", volume["secret"]["secretName"]
        try:
            obj = await self.api.get(path(f"v1/{kind}", ns, name))
        except (TimeoutError, ApiStatusError, aiohttp.ClientError) as err:
            raise PodError("CreateContainerConfigError", f"{kind[:-1]} {name}: {err}") from None
        if obj is None:
            raise PodError("CreateContainerConfigError", f"{kind[:-1]} {name} not found")
        data = {k: v.encode() if kind == "configmaps" else base64.b64decode(v)
                for k, v in (obj.get("data") or {}).items()}
        here.mkdir(parents=True, exist_ok=True)
        for item in source.get("items") or [{"key": k, "path": k} for k in data]:
            target = here / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.get(item["key"], b""))
            target.chmod(item.get("mode", source.get("defaultMode", 0o644)))

    @staticmethod
    def path(value: str, mounts: dict[str, str]) -> str:
        """A container path as this machine sees it (the longest mount that holds it)."""
        for inside in sorted(mounts, key=len, reverse=True):
            root = inside.rstrip("/")
            if value == inside or value.startswith(root + "/"):
                return mounts[inside].rstrip("/") + value[len(root):]
        return value

    async def environment(self, pod: dict, container: dict, node: dict, sandbox: Sandbox,
                           mounts: dict[str, str]) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "status.podIP": sandbox.local, "status.hostIP": HOST_IP, "spec.nodeName": sandbox.node}
        env = {**os.environ, **self.extra_env}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = self.path(str(e["value"]), mounts)
            elif ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") in fields:
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        env.update(HOSTNAME=meta["name"], POD_NAME=meta["name"], POD_NAMESPACE=meta["namespace"],
                   POD_IP=sandbox.local, **dict.fromkeys(self.bind_env, sandbox.local))
        if self.shm_env and "/dev/shm" in mounts:
            env[self.shm_env] = mounts["/dev/shm"]
        labels = (node.get("metadata") or {}).get("labels") or {}
        if MEMORY_LABEL in labels and requests_gpu(container):
            env[ENV_NAMES["memory_budget_bytes"]] = str(int(labels[MEMORY_LABEL]) * MiB)
        if (master := ENV_NAMES["master_addr"]) in env:  # torch's rendezvous: a DNS name, resolved as the process would
            env[master] = await self.resolve(env[master])
        return env

    async def resolve(self, name: str) -> str:
        """The local address of a DNS name; waits for it to exist (its pod may start later)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.dns_wait
        while (address := self.network.resolve(name)) is None:
            if loop.time() > deadline:
                raise PodError("CreateContainerError", f"{name} did not resolve within {self.dns_wait:.0f}s")
            await asyncio.sleep(0.05)
        return self.network.local(address)
