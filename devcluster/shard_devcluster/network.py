"""The cluster network of the one-machine cluster: pod IPs, Service IPs, DNS names.

Every address in 127.0.0.0/8 is loopback on Linux, so each pod gets an address of its own in
127.10.0.0/16 and each ClusterIP Service one in 127.96.0.0/16 (like a cluster's pod and service
CIDRs). A process that binds its pod's address can use the port its container declares, beside
every other pod: the worker's HTTP server (SHARD_HOST) and rank 0's rendezvous store
(SHARD_BIND_ADDR, the pod IP from the downward API) both do.

Cluster DNS is a table: `hostname.subdomain.namespace.svc[.cluster.local]` of every running pod
that has both, and `service.namespace.svc[.cluster.local]` of every Service with a ClusterIP. A real
resolver is not involved: the kubelet resolves `MASTER_ADDR` before it starts a process, and the
Service proxy and tests ask this table. Bookkeeping only: no sockets.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import Any, Iterator

POD_CIDR = "127.10.0.0/16"
SERVICE_CIDR = "127.96.0.0/16"
DOMAIN = "cluster.local"


def taken_ports(address: "PodAddress", container: dict[str, Any]) -> list[int]:
    """The container's declared ports that cannot be bound on the pod's address: another process
    of this machine listens on them on every address (e.g. `python -m http.server` on 8000)."""
    taken = []
    for p in container.get("ports") or []:
        port = int(p["containerPort"])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As servers do (uvicorn, http.server): closed connections in TIME_WAIT do not count.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address.ip, port))
            except OSError:
                taken.append(port)
    return taken


def _addresses(cidr: str) -> Iterator[str]:
    for host in ipaddress.ip_network(cidr).hosts():
        if not str(host).endswith((".0", ".1", ".255")):  # keep them for gateways, as clusters do
            yield str(host)


@dataclass(frozen=True)
class PodAddress:
    """Where a pod's processes listen."""

    ip: str


def pod_dns_names(pod: dict[str, Any]) -> list[str]:
    """The pod's DNS names: hostname.subdomain.namespace.svc (and .cluster.local), when it has both."""
    spec, meta = pod.get("spec") or {}, pod["metadata"]
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain:
        return []
    short = f"{hostname}.{subdomain}.{meta.get('namespace') or 'default'}.svc"
    return [short, f"{short}.{DOMAIN}"]


def service_dns_names(service: dict[str, Any]) -> list[str]:
    meta = service["metadata"]
    short = f"{meta['name']}.{meta.get('namespace') or 'default'}.svc"
    return [short, f"{short}.{DOMAIN}"]


def container_port(container: dict[str, Any], port: int | str) -> int | None:
    """A port as a Service or probe names it (a number, or a container port's name)."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    return None


class ClusterNetwork:
    """Allocates addresses and answers DNS questions; safe to share between threads."""

    def __init__(self) -> None:
        self._pod_ips, self._service_ips = _addresses(POD_CIDR), _addresses(SERVICE_CIDR)
        self._names: dict[str, tuple[str, PodAddress]] = {}  # DNS name -> (owner uid, address)
        self._ips: dict[str, tuple[str, PodAddress]] = {}    # IP -> (owner uid, address)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- allocation
    def pod_address(self) -> PodAddress:
        """A fresh address for a pod that is about to start."""
        with self._lock:
            return PodAddress(next(self._pod_ips))

    def service_ip(self) -> str:
        with self._lock:
            return next(self._service_ips)

    # ---------------------------------------------------------------- DNS
    def register(self, names: list[str], uid: str, address: PodAddress) -> None:
        with self._lock:
            self._ips[address.ip] = (uid, address)
            for name in names:
                self._names[name.rstrip(".").lower()] = (uid, address)

    def unregister(self, uid: str) -> None:
        """Drop every name of a pod or Service (a newer owner of a name keeps it)."""
        with self._lock:
            for table in (self._names, self._ips):
                for key in [k for k, (owner, _) in table.items() if owner == uid]:
                    del table[key]

    def resolve(self, name: str) -> PodAddress | None:
        """A DNS name's address (an IP: its pod's, with the port mappings); None when nothing answers."""
        with self._lock:
            found = self._names.get(name.rstrip(".").lower()) or self._ips.get(name)
        if found:
            return found[1]
        try:
            return PodAddress(str(ipaddress.ip_address(name)))
        except ValueError:
            return None
