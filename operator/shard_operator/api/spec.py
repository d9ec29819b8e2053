"""The whole ShardedModel: its spec from the parts (`model`, `placement`, `worker`), its status,
and how a YAML file or an API object becomes one, with one line per offending field."""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .base import API_VERSION, KIND, ApiModel, SpecError
from .model import ModelSpec
from .placement import Parallelism, Placement, Rollout
from .serving import Serving
from .status import ShardedModelStatus
from .worker import WorkerSpec


class ShardedModelSpec(ApiModel):
    model: ModelSpec
    parallelism: Parallelism = Field(default_factory=Parallelism)
    replicas: int = Field(1, ge=0, description="Data-parallel copies of the whole sharded group.")
    placement: Placement = Field(default_factory=Placement)
    rollout: Rollout = Field(default_factory=Rollout)
    worker: WorkerSpec = Field(default_factory=WorkerSpec)
    serving: Serving = Field(default_factory=Serving)

    @model_validator(mode="after")
    def _offload_streams_checkpoint_weights(self) -> ShardedModelSpec:
        if self.placement.offload.policy == "always" and self.model.quantization == "int8":
            raise ValueError(OFFLOAD_INT8)
        return self


# Streaming reads the checkpoint's own weights at every step: int8 ones would be quantized again
# at every step, from more bytes than bfloat16's, which is slower than streaming bfloat16.
OFFLOAD_INT8 = ("placement.offload.policy always cannot stream int8 weights (spec.model.quantization int8): "
                "streamed layers are read from the checkpoint at every step and would be quantized again "
                "each time; use quantization none with offload, or int8 without it")


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    namespace: str | None = None


class ShardedModel(ApiModel):
    api_version: Literal["sharding.dev/v1alpha1"] = API_VERSION
    kind: Literal["ShardedModel"] = KIND
    metadata: ObjectMeta
    spec: ShardedModelSpec
    status: ShardedModelStatus | None = None


def _field_path(loc: tuple[Any, ...], root: str) -> str:
    # pydantic adds union members to the location ("constrained-int", "literal['auto']"): drop them.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("constrained-")
                                                                   or p in ("int", "str", "float")))]
    return ".".join(p for p in [root, *parts] if p)


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The wire names of the fields beside the one at `loc` (its parent model's), or [] where the
    location leaves the models (a dict, a list of scalars)."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        info = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if info is None:
            return []
        inner = [a for a in (typing.get_args(info.annotation) or (info.annotation,))
                 for a in (typing.get_args(a) or (a,))]
        nested = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is None:
            return []
        model = nested
    return [f.alias or name for name, f in model.model_fields.items()]


def _did_you_mean(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc), n=1, cutoff=0.6)
    if not close:  # often only the case is off: maxmodellen
        close = [f for f in _fields_at(model, loc) if f.lower() == str(loc[-1]).lower()][:1]
    return f"did you mean {close[0]}?" if close else "check its spelling and indentation"


def explain(err: ValidationError, root: str = "", model: type[BaseModel] | None = None) -> str:
    """One line per offending field, named as a Kubernetes user writes it; an unknown field gets
    the nearest field `model` has there ("did you mean maxModelLen?")."""
    lines: dict[str, str] = {}
    for error in err.errors():
        path = _field_path(error["loc"], root)
        given = error.get("input")
        if any(isinstance(p, str) and p == "literal['auto']" for p in error["loc"]):
            lines[path] = f"{path}: must be a positive integer or \"auto\" (got {given!r})"
        elif error["type"] == "extra_forbidden":
            hint = _did_you_mean(model, error["loc"]) if model else "check its spelling and indentation"
            lines[path] = f"{path}: unknown field ({hint})"
        elif error["type"] == "missing":
            lines[path] = f"{path}: required"
        elif error["type"] == "value_error":
            lines.setdefault(path, f"{path or 'spec'}: {error['msg'].removeprefix('Value error, ')}")
        else:
            message = error["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
            lines.setdefault(path, f"{path}: should be {message} (got {given!r})")
    return "\n".join(lines.values())


def parse_sharded_model(obj: dict[str, Any]) -> ShardedModel:
    """Validate a whole ShardedModel object (as read from YAML or the API)."""
    if not isinstance(obj, dict):
        raise SpecError(f"expected a ShardedModel object, got {type(obj).__name__}")
    try:
        return ShardedModel.model_validate(obj)
    except ValidationError as err:
        name = (obj.get("metadata") or {}).get("name", "?") if isinstance(obj.get("metadata"), dict) else "?"
        raise SpecError(f"ShardedModel {name} is invalid:\n{explain(err, model=ShardedModel)}") from None


def parse_spec(spec: dict[str, Any]) -> ShardedModelSpec:
    """Validate just the spec (what the operator receives)."""
    try:
        return ShardedModelSpec.model_validate(spec or {})
    except ValidationError as err:
        raise SpecError(explain(err, root="spec", model=ShardedModelSpec)) from None


def load_sharded_models(path: str | os.PathLike[str]) -> list[ShardedModel]:
    """Every ShardedModel in a YAML file (other kinds in a multi-document file are skipped)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except OSError as err:
        raise SpecError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    models = [parse_sharded_model(d) for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not models:
        raise SpecError(f"{path}: no object of kind {KIND} found")
    return models
