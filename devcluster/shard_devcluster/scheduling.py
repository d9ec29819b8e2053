"""Where a pod may run: kube-scheduler's filter plugins, as pure functions of a pod and the Nodes.

Each filter says why a node is not feasible in the scheduler's own words, so an unschedulable pod's
PodScheduled condition reads as on a cluster ("0/3 nodes are available: 1 Insufficient
nvidia.com/gpu, 2 node(s) didn't match Pod's node affinity/selector."). The filters, in the
scheduler's order: NodeUnschedulable, NodeName, TaintToleration, NodeAffinity (nodeSelector and
required node affinity), NodeResourcesFit (the pod itself against the node's allocatable `pods`,
less the pods bound to it: "Too many pods", so a Node that declares no `pods` takes none; then every
resource the pod requests, extended resources such as nvidia.com/gpu included, against the node's
allocatable less what the pods bound to it request). Among the feasible nodes the least allocated one
wins (ties by name); the real scheduler's scoring (spreading, image locality, ...) is not emulated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from shard_contract.units import quantity


def requests(pod: dict[str, Any]) -> Counter:
    """What a pod requests: each container's requests (its limits where it sets no request, as the
    API server defaults them), summed; an init container's, where larger, counts instead; and one of
    its node's `pods`."""
    def of(container: dict[str, Any]) -> Counter:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return Counter({name: quantity(v) for name, v in merged.items()})
    spec = pod.get("spec") or {}
    total: Counter = Counter({"pods": Decimal(1)})
    for container in spec.get("containers") or []:
        total.update(of(container))
    for container in spec.get("initContainers") or []:
        for name, value in of(container).items():
            total[name] = max(total[name], value)
    return total


def holds_resources(pod: dict[str, Any]) -> bool:
    """A pod bound to a node holds what it requests until it finishes or is gone (terminating included)."""
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def tolerates(tolerations: Iterable[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if not t.get("key"):
            if t.get("operator") == "Exists":
                return True
            continue
        if t["key"] != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression(expr: dict[str, Any], value: str | None) -> bool:
    op, values = expr.get("operator"), expr.get("values") or []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        except ValueError:
            return False
    return False


def matches_affinity(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    """spec.nodeSelector and the required node affinity (terms ORed, expressions ANDed)."""
    spec, meta = pod.get("spec") or {}, node["metadata"]
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms")
    if not terms:
        return True
    fields = {"metadata.name": meta["name"]}
    return any(all(_expression(e, labels.get(e["key"])) for e in term.get("matchExpressions") or []) and
               all(_expression(e, fields.get(e["key"])) for e in term.get("matchFields") or [])
               for term in terms if term.get("matchExpressions") or term.get("matchFields"))


def why_not(pod: dict[str, Any], node: dict[str, Any], used: Counter) -> str | None:
    """Why `pod` cannot run on `node`, whose bound pods request `used` (and number `used["pods"]`);
    None if it can."""
    spec, nspec = pod.get("spec") or {}, node.get("spec") or {}
    tolerations = spec.get("tolerations") or []
    if nspec.get("unschedulable") and not tolerates(tolerations, {"key": "node.kubernetes.io/unschedulable",
                                                                   "effect": "NoSchedule"}):
        return "node(s) were unschedulable"
    for taint in nspec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"
    if not matches_affinity(pod, node):
        return "node(s) didn't match Pod's node affinity/selector"
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    if used["pods"] + 1 > quantity(allocatable.get("pods", 0)):
        return "Too many pods"
    for name, amount in sorted(requests(pod).items()):
        if name != "pods" and amount > 0 and amount + used[name] > quantity(allocatable.get(name, 0)):
            return f"Insufficient {name}"
    return None


def named_nodes(pod: dict[str, Any]) -> set[str] | None:
    """The nodes a required node affinity names by metadata.name in every term (NodeAffinity's
    PreFilter: the others cannot match); None when it names none."""
    required = ((((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    names: set[str] = set()
    for term in required.get("nodeSelectorTerms") or []:
        fields = [e for e in term.get("matchFields") or []
                  if e.get("key") == "metadata.name" and e.get("operator") == "In"]
        if not fields:
            return None
        names |= set(fields[0].get("values") or [])
    return names or None


def place(pod: dict[str, Any], nodes: list[dict[str, Any]], used: dict[str, Counter]) -> tuple[str | None, str]:
    """(the node to bind `pod` to, "") or (None, the scheduler's message why none fits)."""
    feasible: list[dict[str, Any]] = []
    reasons: Counter[str] = Counter()
    named = named_nodes(pod)
    for node in nodes:
        name = node["metadata"]["name"]
        why = "node(s) didn't match Pod's node affinity/selector" if named is not None and name not in named \
            else why_not(pod, node, used.get(name, Counter()))
        if why is None:
            feasible.append(node)
        else:
            reasons[why] += 1
    if feasible:
        asked = requests(pod)

        def load(node: dict[str, Any]) -> tuple:
            allocatable = (node.get("status") or {}).get("allocatable") or {}
            share = max((used.get(node["metadata"]["name"], Counter())[r] / quantity(allocatable[r])
                         for r in asked if r != "pods" and quantity(allocatable.get(r, 0)) > 0), default=Decimal(0))
            return share, node["metadata"]["name"]
        return min(feasible, key=load)["metadata"]["name"], ""
    if not nodes:
        return None, "no nodes available to schedule pods"
    detail = ", ".join(sorted(f"{n} {why}" for why, n in reasons.items()))  # (as the scheduler sorts them)
    return None, f"0/{len(nodes)} nodes are available: {detail}."
