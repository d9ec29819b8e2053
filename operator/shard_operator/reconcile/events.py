"""The operator's Events, as an event recorder posts them (core/v1, with the events.k8s.io fields
`kubectl events` and `kubectl describe` show: action, reportingController, reportingInstance). Pure.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ..api import GROUP, KIND, VERSION

REPORTING_CONTROLLER = f"{GROUP}/shard-operator"
# What the operator did (or failed to do) about the ShardedModel, per Event reason.
ACTIONS = {"Planned": "Plan", "Replanned": "Plan", "Rebalancing": "Plan", "Scaled": "Plan",
           "CreatingGroup": "CreateGroup", "RecreatingGroup": "RecreateGroup", "DeletingGroup": "DeleteGroup",
           "GroupReady": "GroupReady", "Offloading": "Plan", "FullyResident": "Plan"}


def instance() -> str:
    """Which operator process: its pod's name in a cluster, else the host's."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def one_line(message: str) -> str:
    """A message as one line: `kubectl describe` prints an Event's message as its table's last cell,
    as it is, so a line break would start a row of its own (a condition keeps the paragraphs)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def event_body(model: dict[str, Any], type_: str, reason: str, message: str, now: str, reporter: str) -> dict[str, Any]:
    """A core/v1 Event about a ShardedModel (`now`: RFC 3339 with microseconds)."""
    meta = model["metadata"]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": type_, "reason": reason, "message": one_line(message)[:1000],
        "action": ACTIONS.get(reason, "Reconcile"),
        "reportingComponent": REPORTING_CONTROLLER, "reportingInstance": reporter,
        "source": {"component": REPORTING_CONTROLLER},  # the From of `kubectl describe`
        "firstTimestamp": now[:19] + "Z", "lastTimestamp": now[:19] + "Z", "eventTime": now, "count": 1,
    }
