"""The cluster network of the one-machine cluster: pod and Service addresses, and cluster DNS.

The API server sees a real cluster's addresses: pod IPs from a pod CIDR (the kubelet's IPAM:
a random free address of the node's `spec.podCIDR`, else of its own `pod_cidr`) and ClusterIPs
from the API server's service CIDR (whatever that server assigns). Every process of the dev
cluster, though, runs on this machine, where only loopback addresses are its own. So each cluster
address is *mapped* onto loopback, keeping its last three octets: 10.128.4.7 is 127.128.4.7 on this
machine (`local()`). Every address in 127.0.0.0/8 is loopback on Linux, so a pod binds its own
mapped address and can use the ports its container declares beside every other pod. Two cluster
addresses that differ only in their first octet would map to one (a pod CIDR of 10.1.0.0/16 beside
a service CIDR of 172.1.0.0/16): `local()` refuses the second. The processes see their mapped
address as their pod IP (downward API `status.podIP`, POD_IP, SHARD_HOST); the API shows the
cluster one. Processes outside the pods (the operator, curl) reach cluster addresses and names
through the dev cluster's HTTP proxy (gateway.py).

Cluster DNS is a table, filled from Services and EndpointSlices as CoreDNS fills its records
(dns.py): `service.namespace.svc[.cluster.local]` of a Service with a ClusterIP, and
`hostname.service.namespace.svc[.cluster.local]` of each endpoint with a hostname (a pod whose
subdomain is a headless Service's name). No resolver is involved: the kubelet resolves
`MASTER_ADDR` before it starts a process, and the proxies ask the table.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import threading
from collections.abc import Iterable
from typing import Any

DEFAULT_POD_CIDR = "10.128.0.0/9"  # 8M addresses drawn at random: dev clusters side by side rarely meet
DOMAIN = "cluster.local"


def taken_ports(local_ip: str, container: dict[str, Any]) -> list[int]:
    """The container's declared ports that cannot be bound on the pod's address: another process
    of this machine listens on them on every address (e.g. `python -m http.server` on 8000)."""
    taken = []
    for p in container.get("ports") or []:
        port = int(p["containerPort"])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As servers do (uvicorn, http.server): closed connections in TIME_WAIT do not count.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((local_ip, port))
            except OSError:
                taken.append(port)
    return taken


def container_port(container: dict[str, Any], port: int | str) -> int | None:
    """A port as a Service or probe names it (a number, or a container port's name)."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    return None


def service_names(namespace: str, service: str, hostname: str | None = None) -> list[str]:
    short = ".".join(filter(None, (hostname, service, namespace, "svc")))
    return [short, f"{short}.{DOMAIN}"]


class ClusterNetwork:
    """Address mapping, pod address allocation and the DNS table; safe to share between threads."""

    def __init__(self, pod_cidr: str = DEFAULT_POD_CIDR) -> None:
        self.pod_cidr = pod_cidr
        self._mapped: dict[str, str] = {}                    # local address -> the cluster address it maps
        self._records: dict[str, dict[str, str]] = {}        # owner -> {DNS name: cluster address}
        self._names: dict[str, str] = {}                     # DNS name -> cluster address
        self._pods: set[str] = set()                         # pod addresses handed out
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- addresses
    def local(self, address: str) -> str:
        """The loopback address a cluster address is on this machine (one in 127/8: itself)."""
        ip = ipaddress.ip_address(address)
        if ip.version != 4:
            raise ValueError(f"{address}: the dev cluster's network is IPv4")
        if ip.is_loopback:
            return address
        local = "127." + address.split(".", 1)[1]
        with self._lock:
            if self._mapped.setdefault(local, address) != address:
                raise ValueError(f"{address} and {self._mapped[local]} both map to {local} on this machine: "
                                 "use pod and service CIDRs that differ beyond their first octet")
        return local

    def pod_address(self, cidr: str | None = None) -> str:
        """A free address of `cidr` (the node's podCIDR; default: this network's) for a new pod."""
        network = ipaddress.ip_network(cidr or self.pod_cidr)
        with self._lock:
            for _ in range(1000):
                ip = str(network[random.randrange(1, network.num_addresses - 1)])
                if ip not in self._pods and not ip.endswith((".0", ".1", ".255")):
                    self._pods.add(ip)
                    return ip
        raise RuntimeError(f"no free pod address in {network}")

    def release(self, ip: str) -> None:
        with self._lock:
            self._pods.discard(ip)

    # ---------------------------------------------------------------- DNS
    def set_records(self, owner: str, records: dict[str, str]) -> None:
        """The DNS names one Service (or its EndpointSlices) answers, replacing what it had."""
        with self._lock:
            self._records[owner] = {name.lower(): ip for name, ip in records.items()}
            if not records:
                del self._records[owner]
            self._names = {name: ip for table in self._records.values() for name, ip in table.items()}

    def resolve(self, name: str) -> str | None:
        """A DNS name's cluster address (an address: itself); None when nothing answers."""
        try:
            return str(ipaddress.ip_address(name))
        except ValueError:
            pass
        with self._lock:
            return self._names.get(name.rstrip(".").lower())

    def names(self) -> Iterable[str]:
        with self._lock:
            return list(self._names)
