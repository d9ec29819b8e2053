"""The names of a model's objects: DNS-1035 labels that never collide between models."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

BASE_MAX = 40  # room in a 63-character DNS label for "-<replica>-<revision>-<rank>"


def _digest(*parts: Any, n: int = 6) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:n]


# Endings the names below give a model's objects (and `base_name`'s own digest). A model whose name
# ends so is named by a digest too: else model "a-metrics" would be given the name of model "a"'s
# metrics Service, and a model named like another's group its Service, pods and key.
GENERATED_ENDING = re.compile(r"-(metrics|plan|profile|ranks)$|-[0-9a-f]{6}$|-\d+-[0-9a-f]{6}-\d+$")


def base_name(model: str) -> str:
    """A DNS-1035 label prefix for the model's objects: lowercase, no dots, starts with a letter,
    and never ends like a name made of another model's (`GENERATED_ENDING`)."""
    name = "".join(c if c.isalnum() else "-" for c in model.lower()).strip("-") or "model"
    if not name[0].isalpha():
        name = "m-" + name
    # keep altered names apart ("a.b" is not "a-b"), and names that end like generated ones
    if name != model or len(name) > BASE_MAX or GENERATED_ENDING.search(name):
        name = name[:BASE_MAX - 7].rstrip("-") + "-" + _digest(model)
    return name


def model_label(model: str) -> str:
    """The model's name as a label value (at most 63 characters)."""
    return model if len(model) <= 63 else model[:56].rstrip("-.") + "-" + _digest(model)


def group_name(model: str, replica: int, revision: str) -> str:
    return f"{base_name(model)}-{replica}-{revision}"


def pod_name(model: str, replica: int, revision: str, rank: int) -> str:
    return f"{group_name(model, replica, revision)}-{rank}"


def group_of_pod(pod: str) -> str:
    """The group_name a pod_name was made of (a pod of several ranks is named by its first)."""
    return pod.rsplit("-", 1)[0]


def endpoint_name(model: str) -> str:
    return base_name(model)


def metrics_name(model: str) -> str:
    return f"{base_name(model)}-metrics"


def plan_record_name(model: str) -> str:
    return f"{base_name(model)}-plan"


def profile_name(model: str) -> str:
    return f"{base_name(model)}-profile"


def network_policy_name(model: str) -> str:
    return f"{base_name(model)}-ranks"
