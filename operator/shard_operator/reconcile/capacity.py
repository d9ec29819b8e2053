"""GPU accounting on the nodes, from the pods that request them. Pure.

The planner sees each node's allocatable GPUs; GPUs held by pods of other workloads (other
ShardedModels included) are not ours to plan on, and a replacement group can only surge beside a
running one where GPUs are still free.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..planning.inventory import Inventory
from .rollout import pod_node


class GpuUse(NamedTuple):
    node: str
    namespace: str
    model: str  # the sharding.dev/model label, "" for other workloads
    resources: tuple[tuple[str, int], ...]  # extended resource -> count
    scheduled: bool  # bound to the node; otherwise only pinned there by a plan


def extended_requests(pod: dict[str, Any]) -> dict[str, int]:
    """Extended resources (names with a "/") a pod holds: the larger of request and limit."""
    out: Counter = Counter()
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        names = set(res.get("requests") or {}) | set(res.get("limits") or {})
        for name in names:
            if "/" in name:
                values = [int(str(v)) for v in ((res.get("requests") or {}).get(name),
                                                (res.get("limits") or {}).get(name))
                          if v is not None and str(v).isdigit()]
                out[name] += max(values, default=0)
    return dict(out)


def gpu_use(pod: dict[str, Any], model_label: str) -> GpuUse | None:
    """What a pod holds or is about to hold, or None (finished, unplaced, no extended resources).

    A rank pod counts on its planned node before the scheduler binds it.
    """
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    requests = extended_requests(pod)
    scheduled = bool((pod.get("spec") or {}).get("nodeName"))
    node = pod_node(pod) if model_label else (pod.get("spec") or {}).get("nodeName", "")
    if not requests or not node:
        return None
    return GpuUse(node=node, namespace=pod["metadata"].get("namespace", ""), model=model_label,
                  resources=tuple(sorted(requests.items())), scheduled=scheduled)


def used_per_node(uses: Iterable[GpuUse], resource: str, exclude: tuple[str, str] | None = None) -> dict[str, int]:
    """GPUs of `resource` held on each node by workloads other than model `exclude` (ns, label).

    With `exclude`, only bound pods count: when two models pin pods to the same GPUs, the
    scheduler binds one and the other, seeing those GPUs taken, plans elsewhere.
    """
    out: Counter = Counter()
    for use in uses:
        if exclude is not None and ((use.namespace, use.model) == exclude or not use.scheduled):
            continue
        n = dict(use.resources).get(resource, 0)
        if n:
            out[use.node] += n
    return dict(out)


def allocatable(nodes: Iterable[dict[str, Any]], resource: str) -> dict[str, int]:
    out = {}
    for node in nodes:
        value = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
        if value is not None and str(value).isdigit():
            out[node["metadata"]["name"]] = int(str(value))
    return out


def free_gpus(nodes: Iterable[dict[str, Any]], uses: Iterable[GpuUse], resource: str) -> dict[str, int]:
    used = used_per_node(uses, resource)
    return {node: n - used.get(node, 0) for node, n in allocatable(nodes, resource).items()}


def node_names(nodes: Iterable[dict[str, Any]]) -> set[str]:
    """Nodes that exist: a pod bound elsewhere will never run again (its node is gone)."""
    return {node["metadata"]["name"] for node in nodes}


def healthy_nodes(nodes: Iterable[dict[str, Any]]) -> set[str]:
    """Nodes that exist and are Ready: pods elsewhere are lost."""
    out = set()
    for node in nodes:
        conditions = (node.get("status") or {}).get("conditions") or []
        ready: dict[str, Any] = next((c for c in conditions if c.get("type") == "Ready"), {})
        if ready.get("status") == "True":
            out.add(node["metadata"]["name"])
    return out


def slim_node(node: dict[str, Any]) -> dict[str, Any]:
    """The parts of a Node the operator reads (kept in memory for every node)."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {k: spec[k] for k in ("unschedulable", "taints") if k in spec},
            "status": {"allocatable": dict(status.get("allocatable") or {}),
                       "conditions": [{"type": c.get("type"), "status": c.get("status")}
                                      for c in status.get("conditions") or []]}}


def fingerprint(inventory: Inventory) -> str:
    """Identity of the pool as the planner sees it."""
    data = [d.model_dump() for d in inventory.devices] + [s.model_dump() for s in inventory.skipped]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
