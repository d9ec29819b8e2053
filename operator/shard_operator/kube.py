"""The operator's only door to the Kubernetes API (besides kopf's own watches): thin and counted.

Objects travel as plain dicts (the builders' output, the API's JSON) so nothing is converted twice:
every call asks the client for the raw response and reads its JSON body itself, to the end, which
hands the connection back to the pool (an unread response keeps it until garbage collection closes
it mid-answer, and a real API server then logs `write: broken pipe` and aborts the request). Writes
return the object as the server wrote it. Creating what exists (409) and deleting what is gone (404)
are not errors: the reconcile is level-triggered and may race with itself, kubectl or the garbage
collector; but a 409 counts as done only when the object there is owned by the same owner as the
one we meant to create (found by name with a list, the permission the operator has): another
model's Service of the same name must never be taken for ours (`NameTaken`, a failed reconcile
and a Degraded condition that says so). A Secret cannot be read back, so its 409 is always an
error. Every request has a timeout: a connection the server dropped silently (a restart, a load
balancer) must fail the reconcile, which is retried, rather than hang the model's loop.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from .api import GROUP, PLURAL, VERSION

MERGE = "application/merge-patch+json"
KINDS = ("Pod", "Service", "ConfigMap")  # what every reconcile lists
NETWORK_POLICY = "NetworkPolicy"  # listed too with Settings.network_policies


class NameTaken(RuntimeError):
    """An object the operator would create exists already and belongs to someone else."""


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


def _body(response: Any) -> bytes:
    """All of a raw (`_preload_content=False`) response's body; its connection goes back to the pool."""
    try:
        return response.data
    finally:
        response.release_conn()  # (reading to the end has done it; this also covers a failed read)


def _json(response: Any) -> Any:
    return json.loads(_body(response))


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient, timeout: float = 30.0):
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.networking = kubernetes.client.NetworkingV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.raw: dict[str, Any] = {"_preload_content": False, "_request_timeout": timeout}
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
        return _json(self._method("list", kind)(namespace, label_selector=label_selector, **self.raw))["items"]

    def event(self, body: dict[str, Any]) -> None:
        self._count("create")
        # The client sends a dict as it would its CoreV1Event model.
        _body(self.core.create_namespaced_event(body["metadata"]["namespace"], body,  # type: ignore[arg-type]
                                                **self.raw))

    def pod_log(self, namespace: str, name: str, tail_lines: int = 200) -> str:
        self._count("get")
        return _body(self.core.read_namespaced_pod_log(name, namespace, tail_lines=tail_lines, **self.raw)) \
            .decode(errors="replace")

    # ---------------------------------------------------------------- writes
    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create `obj`; the object as created, or None when one of its owner exists already
        (else `NameTaken`)."""
        self._count("create")
        try:
            return _json(self._method("create", obj["kind"])(obj["metadata"]["namespace"], obj, **self.raw))
        except ApiException as err:
            if err.status != 409:
                raise
        kind, meta = obj["kind"], obj["metadata"]
        owners = {ref["uid"] for ref in meta.get("ownerReferences") or [] if ref.get("uid")}
        if kind != "Secret" and owners:
            self._count("list")
            found = _json(self._method("list", kind)(meta["namespace"], field_selector=f"metadata.name={meta['name']}",
                                                     **self.raw))["items"]
            if any(ref.get("uid") in owners for o in found for ref in o["metadata"].get("ownerReferences") or []):
                return None
        raise NameTaken(f"{kind} {meta['namespace']}/{meta['name']} exists and is not this model's: rename one of "
                        "the two, or delete it if it is left over") from None

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self._count("patch")
        return _json(self._method("patch", kind)(name, namespace, patch, _content_type=MERGE, **self.raw))

    def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> dict[str, Any] | None:
        """Delete an object (its dependents are collected in the background; a pod after its grace
        period, or `grace_seconds`); what the server answered (the object, now terminating, or a
        Status), or None when it was gone."""
        self._count("delete")
        grace = {"grace_period_seconds": grace_seconds} if grace_seconds is not None else {}
        try:
            return _json(self._method("delete", kind)(name, namespace, **grace, **self.raw))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """Merge `patch` into the model's status; the model as written, or None when it is gone."""
        self._count("patch")
        try:
            return _json(self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": patch}, _content_type=MERGE, **self.raw))
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing to report on
                raise
            return None
