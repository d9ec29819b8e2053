"""The operator's only door to the Kubernetes API (besides kopf's own watches): thin and counted.

Objects travel as plain dicts (the builders' output, the API's JSON) so nothing is converted twice.
Creating what exists (409) and deleting what is gone (404) are not errors: the reconcile is
level-triggered and may race with itself, kubectl or the garbage collector.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any, Callable

import kubernetes
from kubernetes.client import ApiException

from .api import GROUP, PLURAL, VERSION

MERGE = "application/merge-patch+json"
KINDS = ("Pod", "Service", "ConfigMap")  # what every reconcile lists
NETWORK_POLICY = "NetworkPolicy"  # listed too with Settings.network_policies


def load_client() -> kubernetes.client.ApiClient:
    """Connect like every Kubernetes tool: the in-cluster service account, else KUBECONFIG."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=config)
    return client_for(config)


def client_for(config: kubernetes.client.Configuration) -> kubernetes.client.ApiClient:
    config.connection_pool_maxsize = max(config.connection_pool_maxsize or 0, 32)
    return kubernetes.client.ApiClient(config)


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient):
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.networking = kubernetes.client.NetworkingV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.calls: Counter = Counter()  # verb -> requests made (benchmarks, tests)
        self._lock = threading.Lock()

    def _count(self, verb: str) -> None:
        with self._lock:
            self.calls[verb] += 1

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.calls.items() if verb in ("create", "patch", "delete"))

    def _method(self, action: str, kind: str) -> Callable[..., Any]:
        api, snake = {"Pod": (self.core, "pod"), "Service": (self.core, "service"),
                      "ConfigMap": (self.core, "config_map"), "Secret": (self.core, "secret"),
                      NETWORK_POLICY: (self.networking, "network_policy")}[kind]
        return getattr(api, f"{action}_namespaced_{snake}")

    # ---------------------------------------------------------------- reads
    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self._count("list")
        response = self._method("list", kind)(namespace, label_selector=label_selector, _preload_content=False)
        return json.loads(response.data)["items"]

    def pod_log(self, namespace: str, name: str, tail_lines: int = 200) -> str:
        self._count("get")
        response = self.core.read_namespaced_pod_log(name, namespace, tail_lines=tail_lines, _preload_content=False)
        return response.data.decode(errors="replace")

    # ---------------------------------------------------------------- writes
    def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj`; False when it already exists."""
        self._count("create")
        try:
            self._method("create", obj["kind"])(obj["metadata"]["namespace"], obj, _preload_content=False)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        return True

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._count("patch")
        self._method("patch", kind)(name, namespace, patch, _content_type=MERGE, _preload_content=False)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete an object (its dependents are collected in the background); False when gone."""
        self._count("delete")
        try:
            self._method("delete", kind)(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._count("patch")
        try:
            self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": patch},
                                                              _content_type=MERGE, _preload_content=False)
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing to report on
                raise
