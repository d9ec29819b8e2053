"""Cluster DNS for the dev cluster: the records CoreDNS's kubernetes plugin serves, kept in the
network's table (network.py) from Services and EndpointSlices read through the Kubernetes API.

* `service.namespace.svc[.cluster.local]`: the Service's ClusterIP; a headless Service's first
  ready endpoint (CoreDNS answers all of them);
* `hostname.service.namespace.svc[.cluster.local]`: each ready endpoint with a hostname, i.e. a
  pod whose `subdomain` is the headless Service's name (with publishNotReadyAddresses, before it is
  Ready: that is how ranks find their leader while they load).
"""

from __future__ import annotations

from .kubeapi import Informer, KubeApi
from .network import ClusterNetwork, service_names

SERVICES, SLICES = "v1/services", "discovery.k8s.io/v1/endpointslices"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def records(service: dict | None, slices: list[dict]) -> dict[str, str]:
    """DNS name -> address of one Service and its EndpointSlices."""
    if service is None:
        return {}
    meta, spec = service["metadata"], service.get("spec") or {}
    ns, name = meta["namespace"], meta["name"]
    ready = [e for s in slices for e in s.get("endpoints") or []
             if (e.get("conditions") or {}).get("ready") and e.get("addresses")]
    out: dict[str, str] = {}
    cluster_ip = spec.get("clusterIP")
    if cluster_ip and cluster_ip != "None":
        out.update(dict.fromkeys(service_names(ns, name), cluster_ip))
    elif ready:
        out.update(dict.fromkeys(service_names(ns, name), ready[0]["addresses"][0]))
    for endpoint in ready:
        if endpoint.get("hostname"):
            out.update(dict.fromkeys(service_names(ns, name, endpoint["hostname"]), endpoint["addresses"][0]))
    return out


class ClusterDNS:
    def __init__(self, api: KubeApi, network: ClusterNetwork):
        self.network = network
        self.services = Informer(api, SERVICES, self._service)
        self.slices = Informer(api, SLICES, self._slice)

    def runners(self) -> list:
        return [self.services.run(), self.slices.run()]

    async def _service(self, kind: str, service: dict, old: dict | None) -> None:
        self._update(service["metadata"]["namespace"], service["metadata"]["name"])

    async def _slice(self, kind: str, endpoint_slice: dict, old: dict | None) -> None:
        meta = endpoint_slice["metadata"]
        name = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if name:
            self._update(meta["namespace"], name)

    def _update(self, ns: str, name: str) -> None:
        slices = [s for (sns, _), s in self.slices.objects.items()
                  if sns == ns and (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == name]
        self.network.set_records(f"{ns}/{name}", records(self.services.objects.get((ns, name)), slices))
