"""An in-memory stand-in for the operator's API edge (`shard_operator.kube.Kube`): objects as dicts.

For the reconcile's table tier: no HTTP, no kopf. It keeps the API server behaviours the reconcile
relies on, as a real kube-apiserver has them: creating what exists is a 409 (Kube answers None),
deleting what is gone a 404 (None), a patch is a JSON merge patch (RFC 7386), and deleting a pod
bound to a node only marks it (deletionTimestamp) until its kubelet lets go (`Store.kubelet`).
Every write is logged in order, and a request can be made to fail (`Store.fail`).
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiException

from shard_devcluster.patches import merge_patch
from shard_operator.objects.manifests import NODE_ANNOTATION

MODEL = "ShardedModel"


@dataclass
class Fault:
    verb: str          # create | patch | delete | list | patch_status
    kind: str | None   # None: any kind
    landed: bool       # the write took effect before the answer was lost (a 504 after the write)


class Store:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name) -> object
        self.logs: dict[tuple[str, str], str] = {}                       # a pod's log
        self.calls: Counter = Counter()                                   # as Kube.calls
        self.log: list[str] = []                                          # the writes, "verb Kind name"
        self.faults: list[Fault] = []
        self._uids = itertools.count(1)

    # ---------------------------------------------------------------- the Kube interface
    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self._request("list", kind)
        wanted = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and ns == namespace
                and all((o["metadata"].get("labels") or {}).get(key) == v for key, v in wanted.items())]

    def pod_log(self, namespace: str, name: str, tail_lines: int = 200) -> str:
        self._request("get", "Pod")
        return "\n".join(self.logs.get((namespace, name), "").splitlines()[-tail_lines:])

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:  # 409: Kube answers None
            self._write("create", key, lambda: None)
            self.log[-1] += " (409)"
            return None
        self._write("create", key, lambda: self.put(obj))
        return copy.deepcopy(self.objects[key])

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        key = (kind, namespace, name)
        if key not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        self._write("patch", key, lambda: self.objects.__setitem__(key, merge_patch(self.objects[key], patch)))
        return copy.deepcopy(self.objects[key])

    def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> dict[str, Any] | None:
        key = (kind, namespace, name)
        if key not in self.objects:  # 404: Kube answers None
            self._write("delete", key, lambda: None)
            self.log[-1] += " (404)"
            return None
        self._write("delete", key, lambda: self._delete(key, grace_seconds))
        if grace_seconds is not None:
            self.log[-1] += f" (grace {grace_seconds})"
        return copy.deepcopy(self.objects.get(key))

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        key = (MODEL, namespace, name)
        self._write("patch_status", key, lambda: self.objects.__setitem__(
            key, merge_patch(self.objects[key], {"status": patch})) if key in self.objects else None)
        return copy.deepcopy(self.objects.get(key))

    @property
    def writes(self) -> int:
        return sum(n for verb, n in self.calls.items() if verb in ("create", "patch", "delete"))

    # ---------------------------------------------------------------- arranging and reading
    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store `obj` as the API server would have created it."""
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{next(self._uids)}")
        obj["metadata"].setdefault("namespace", "default")
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return obj

    def get(self, kind: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for (k, _, _), o in sorted(self.objects.items()) if k == kind]

    def fail(self, verb: str, kind: str | None = None, landed: bool = False) -> None:
        """The next `verb` request (on `kind`) fails with a 500, or a 504 after it landed."""
        self.faults.append(Fault(verb, kind, landed))

    def take_log(self) -> list[str]:
        log, self.log = self.log, []
        return log

    # ---------------------------------------------------------------- the kubelet
    def kubelet(self, ready: bool = True, nodes: set[str] | None = None) -> None:
        """What the scheduler and kubelets do between two reconciles: pods being deleted go (but on
        a node that is not in `nodes`: no kubelet is left there), new pods are bound to their
        planned node and run (Ready when `ready`)."""
        for key, pod in list(self.objects.items()):
            if key[0] != "Pod":
                continue
            if pod["metadata"].get("deletionTimestamp"):
                if nodes is None or pod["spec"].get("nodeName") in nodes:
                    del self.objects[key]
            elif not pod["spec"].get("nodeName"):
                pod["spec"]["nodeName"] = pod["metadata"]["annotations"][NODE_ANNOTATION]
                pod["status"] = {"phase": "Running", "podIP": "10.0.0.1",
                                 "conditions": [{"type": "Ready", "status": str(ready)}],
                                 "containerStatuses": [{"name": "worker", "ready": ready, "restartCount": 0,
                                                        "state": {"running": {}}}]}
            elif ready and pod["status"].get("phase") == "Running":
                pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    def fail_pod(self, name: str, exit_code: int = 1, reason: str = "Error", namespace: str = "default") -> None:
        """A rank dies: its pod fails with the container's exit code."""
        self.objects[("Pod", namespace, name)]["status"] = {
            "phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"name": "worker", "ready": False, "restartCount": 0,
                                   "state": {"terminated": {"exitCode": exit_code, "reason": reason}}}]}

    # ---------------------------------------------------------------- internals
    def _request(self, verb: str, kind: str) -> Fault | None:
        """Count a request; the fault it meets, if any."""
        self.calls["patch" if verb == "patch_status" else verb] += 1
        fault = next((f for f in self.faults if f.verb == verb and f.kind in (None, kind)), None)
        if fault is not None:
            self.faults.remove(fault)
            if not fault.landed and verb in ("list", "get"):
                raise ApiException(status=500, reason="Internal Server Error")
        return fault

    def _write(self, verb: str, key: tuple[str, str, str], apply: Any) -> None:
        """Log a write as "verb Kind name" (a status write as "status <phase>"), apply it and answer."""
        fault = self._request(verb, key[0])
        if fault is not None and not fault.landed:
            self.log.append(f"{verb} {key[0]} {key[2]} (500)")
            raise ApiException(status=500, reason="Internal Server Error")
        apply()
        if verb == "patch_status":
            self.log.append(f"status {((self.objects.get(key) or {}).get('status') or {}).get('phase')}")
        else:
            self.log.append(f"{verb} {key[0]} {key[2]}")
        if fault is not None:  # it landed, but the answer was lost
            self.log[-1] += " (504)"
            raise ApiException(status=504, reason="Gateway Timeout")

    def _delete(self, key: tuple[str, str, str], grace_seconds: int | None) -> None:
        obj = self.objects.get(key)
        if obj is None:
            return
        if key[0] == "Pod" and obj["spec"].get("nodeName") and grace_seconds != 0:  # graceful: the kubelet lets go
            obj["metadata"].setdefault("deletionTimestamp", "2026-01-01T00:00:00Z")
        else:
            del self.objects[key]
