"""What a reconcile asks of the API, as values, and the one function that sends them.

A reconcile returns its creates, patches and deletes in order; the model's loop sends them with
`send`. `changes` is the apply step's decision: create what is missing, merge-patch what drifted,
delete what the rollout decision drops (a pod whose node no longer exists with grace 0: no kubelet
is left to end it, and the pod GC would wait 40 s). Pure but for the random group keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from shard_contract.env import new_group_key
from shard_contract.plan import Plan

from ..objects.manifests import (
    GROUP_LABEL,
    REVISION_LABEL,
    Context,
    drift_patch,
    group_name,
    group_objects,
    group_secret,
    model_objects,
)
from .rollout import Decision, GroupKey, deletion_grace


@dataclass(frozen=True)
class Write:
    verb: Literal["create", "patch", "delete"]
    kind: str
    namespace: str
    name: str
    body: dict[str, Any] | None = None  # the object to create, or the merge patch
    grace: int | None = None            # a deletion's grace period (None: the object's own)

    @classmethod
    def create(cls, obj: dict[str, Any]) -> Write:
        return cls("create", obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"], obj)

    def __str__(self) -> str:
        return f"{self.verb} {self.kind} {self.name}" + (f" (grace {self.grace})" if self.grace is not None else "")


class Writer(Protocol):
    """The write half of kube.Kube."""

    def create(self, obj: dict[str, Any]) -> Any: ...
    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> Any: ...
    def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> Any: ...


def send(kube: Writer, writes: list[Write]) -> None:
    """Make each request in order; the first that fails raises (the reconcile runs again, and being
    level-triggered does what is still missing: names are deterministic, so a repeated create is a
    409, never a duplicate)."""
    for w in writes:
        if w.verb == "create":
            kube.create(w.body or {})
        elif w.verb == "patch":
            kube.patch(w.kind, w.namespace, w.name, w.body or {})
        else:
            kube.delete(w.kind, w.namespace, w.name, w.grace)


def changes(ctx: Context, plan: Plan, decision: Decision, listing: dict[str, list[dict[str, Any]]],
            nodes: set[str] | None = None, new_key: Callable[[], bytes] = new_group_key) -> list[Write]:
    """Create what is missing, patch what drifted, delete what the decision drops.

    Pods are never patched: what shapes them is in their revision. A group's Secret (its key) is
    never listed or read: each incarnation of the group gets a new key, so a heartbeat record
    sealed in one does not open in the next. When none of the group's pods exists (a new group, or
    one recreated after a rank failed), its Secret is deleted (404 when there is none) and created
    again with a fresh key just before the pods; pods added to a group that has some keep its key.
    A create that meets an object of that name (409) is an error unless the object is this model's
    (kube.Kube.create). `nodes`: the Nodes that exist (None: unknown).
    """
    ns = ctx.owner.namespace
    existing = {(kind, o["metadata"]["name"]): o for kind, objs in listing.items() for o in objs}
    desired = model_objects(ctx, plan)
    for (replica, revision), create_pods in sorted(decision.keep.items()):
        service, config, *pods = group_objects(ctx, plan, replica)
        desired += [service, config]
        missing = [p for p in pods if ("Pod", p["metadata"]["name"]) not in existing]
        if create_pods and missing:
            if len(missing) == len(pods):  # a new incarnation: a new key
                desired += [group_secret(ctx.owner, plan, replica, revision, new_key())]
            desired += missing
    out = []
    for obj in desired:
        actual = existing.get((obj["kind"], obj["metadata"]["name"]))
        if obj["kind"] == "Secret":  # never listed: replace whatever key an earlier incarnation left
            out += [Write("delete", "Secret", ns, obj["metadata"]["name"]), Write.create(obj)]
        elif actual is None:
            out.append(Write.create(obj))
        elif obj["kind"] != "Pod" and (patch := drift_patch(obj, actual)) is not None:
            out.append(Write("patch", obj["kind"], ns, obj["metadata"]["name"], patch))
    for key in decision.restart:
        out += [Write("delete", "Pod", ns, pod["metadata"]["name"], grace=deletion_grace(pod, nodes))
                for pod in members(listing, key, "Pod", nodes)]
    for key in decision.delete:
        if members(listing, key, "Service"):  # once per group, before its Service goes
            out.append(Write("delete", "Secret", ns, group_name(ctx.owner.name, *key)))
        for kind in ("Pod", "Service", "ConfigMap"):
            out += [Write("delete", kind, ns, obj["metadata"]["name"], grace=deletion_grace(obj, nodes))
                    for obj in members(listing, key, kind, nodes)]
    return out


def members(listing: dict[str, list[dict[str, Any]]], key: GroupKey, kind: str,
            nodes: set[str] | None = None) -> list[dict[str, Any]]:
    """The objects of one kind of group `key` that are not being deleted already (or, on a node that
    is gone, wait for a kubelet that will not come: they need a deletion with grace 0)."""
    out = []
    for obj in listing[kind]:
        labels = obj["metadata"].get("labels") or {}
        if (labels.get(GROUP_LABEL), labels.get(REVISION_LABEL)) == (str(key[0]), key[1]) \
                and (not obj["metadata"].get("deletionTimestamp") or deletion_grace(obj, nodes) == 0):
            out.append(obj)
    return out
