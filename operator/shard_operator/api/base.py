"""What every part of the ShardedModel API shares: its names (group, version, kind), the
conventions of its models (`ApiModel`: camelCase on the wire, unknown fields refused), the scalar
types several parts use, and the error a spec that cannot be accepted raises."""

from __future__ import annotations

import posixpath
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "sharding.dev"
VERSION = "v1alpha1"
API_VERSION: Final = "sharding.dev/v1alpha1"  # f"{GROUP}/{VERSION}", spelled out for its type
KIND: Final = "ShardedModel"
PLURAL = "shardedmodels"
SINGULAR = "shardedmodel"
SHORT_NAMES = ["sm"]

PHASES = ("Pending", "Planning", "Loading", "Ready", "Rebalancing", "Degraded", "Failed")
Phase = Literal["Pending", "Planning", "Loading", "Ready", "Rebalancing", "Degraded", "Failed"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "int8"]
Auto = Literal["auto"]
# Kubernetes int-or-string: a positive integer, or "auto" to let the planner choose.
Degree = Annotated[int, Field(ge=1)] | Auto
# A path without ".." segments, as the CRD's `pattern` (RE2: no lookahead): every segment is
# anything but "..". Kubernetes refuses ".." in a hostPath for the same reason.
_SEGMENT = r"([.]?[^/.][^/]*|[.]|[.][.][^/]+)?"
NO_DOTDOT = rf"^{_SEGMENT}(/{_SEGMENT})*$"


class ApiModel(BaseModel):
    """Kubernetes conventions: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              validate_default=True)

    def dump(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def to_snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


class SpecError(ValueError):
    """A ShardedModel that cannot be accepted; the message names every offending field."""


def normal_path(path: str) -> str:
    """`path` without "." segments, doubled or trailing slashes (POSIX keeps a leading "//")."""
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("/") else normal
