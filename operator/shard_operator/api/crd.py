"""Generate the ShardedModel CustomResourceDefinition from the pydantic models in the `api/` package.

`python -m shard_operator.api.crd > crds/shardedmodels.yaml` (or `make crd`); a test fails when the
committed file differs. The schema is structural (every node typed, no $ref, no
`additionalProperties: false`), carries the defaults and bounds of the models, and marks the
int-or-"auto" parallelism degrees with `x-kubernetes-int-or-string`.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from .. import api

# As `kubectl get` shows them: READY as ready/wanted groups (as for Deployments), the in-cluster
# URL (as KServe's), and why a Failed or Degraded model is so.
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "TP", "type": "integer", "jsonPath": ".status.plan.tensorParallel"},
    {"name": "PP", "type": "integer", "jsonPath": ".status.plan.pipelineParallel"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _factory_defaults(root: type[BaseModel]) -> dict[tuple[str, str], Any]:
    """(model name, wire field name) -> default of fields whose default comes from a factory.

    Pydantic leaves those out of the JSON schema; Kubernetes needs `default: {}` on an omitted
    object for the defaults inside it to apply.
    """
    found: dict[tuple[str, str], Any] = {}
    seen: set[type] = set()
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for name, field in cls.model_fields.items():
            alias = field.alias or name
            # Our factories take no argument (pydantic also allows one that takes the validated data).
            value = field.default_factory() if field.default_factory is not None else None  # type: ignore[call-arg]
            if isinstance(value, BaseModel):
                found[(cls.__name__, alias)] = {}
            for arg in _model_types(field.annotation):
                todo.append(arg)
    return found


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [t for arg in getattr(annotation, "__args__", ()) for t in _model_types(arg)]


def _convert(node: dict[str, Any], defs: dict[str, Any], factory: dict[tuple[str, str], Any],
             owner: str | None = None) -> dict[str, Any]:
    if "$ref" in node:
        name = node["$ref"].split("/")[-1]
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return {**_convert(defs[name], defs, factory, owner=name), **_convert_keywords(extra)}
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        types = {o.get("type") for o in options}
        if types == {"integer", "string"}:  # an int-or-"auto" degree
            # Kubernetes accepts only this exact anyOf beside int-or-string; the bounds go to CEL.
            return {"x-kubernetes-int-or-string": True,
                    "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "x-kubernetes-validations": [{
                        "rule": "type(self) == int ? self >= 1 : self == 'auto'",
                        "message": "must be a positive integer or \"auto\""}],
                    **_convert_keywords(rest)}
        if len(options) == 1:  # Optional[X]: just X, not required
            merged = _convert(options[0], defs, factory, owner)
            merged.update(_convert_keywords({k: v for k, v in rest.items() if v is not None}))
            return merged
        raise ValueError(f"cannot express union {options} in a structural schema")
    out = _convert_keywords(node)
    if "properties" in node:
        out["properties"] = {}
        for prop, sub in node["properties"].items():
            converted = _convert(sub, defs, factory)
            if owner and (owner, prop) in factory:
                converted["default"] = factory[(owner, prop)]
            out["properties"][prop] = converted
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _convert(node["additionalProperties"], defs, factory)
    if "items" in node:
        items = node["items"]
        if isinstance(items, dict):
            out["items"] = _convert(items, defs, factory)
    if "prefixItems" in node:  # tuples: a list of one type
        out["items"] = _convert(node["prefixItems"][0], defs, factory)
    return out


_KEEP = ("type", "description", "enum", "minimum", "maximum", "minLength", "maxLength", "minItems",
         "maxItems", "maxProperties", "pattern", "required", "format", "x-kubernetes-validations")


def _convert_keywords(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if k in _KEEP}
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMaximum" in node:  # JSON Schema 2020 -> OpenAPI 3.0
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if node.get("default") is not None:
        out["default"] = node["default"]
    if out.get("type") == "number" and "format" not in out:
        out["format"] = "double"
    return out


def model_schema(cls: type[BaseModel]) -> dict[str, Any]:
    raw = cls.model_json_schema(by_alias=True, mode="validation")
    return _convert(raw, raw.get("$defs", {}), _factory_defaults(cls), owner=cls.__name__)


def build_crd() -> dict[str, Any]:
    spec = model_schema(api.ShardedModelSpec)
    status = model_schema(api.ShardedModelStatus)
    status.pop("required", None)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {"kind": api.KIND, "listKind": f"{api.KIND}List", "plural": api.PLURAL,
                      "singular": api.SINGULAR, "shortNames": api.SHORT_NAMES},
            "scope": "Namespaced",
            "versions": [{
                "name": api.VERSION, "served": True, "storage": True,
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A language model sharded across GPUs (tensor x pipeline parallel), "
                                   "replicated, and served.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        "metadata": {"type": "object"}, "spec": spec, "status": status},
                }},
            }],
        },
    }


def render() -> str:
    header = "# Generated from operator/shard_operator/api/ by `make crd`; do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
