"""Every example that is a Kubernetes object validates: built-in kinds against the Kubernetes
schemas (strict), ShardedModels against the CRD the chart installs."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .chart import CHART, REPO

EXAMPLES = REPO / "examples"
VERSION = kubernetes_validate.latest_version()


def crd_schema() -> dict:
    crd = yaml.safe_load((CHART / "crds" / "shardedmodels.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def example_objects() -> list:
    """(file:kind/name, object) for every document of every YAML example; a List contributes its items."""
    found = []
    for path in sorted(EXAMPLES.rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            items = doc["items"] if doc.get("kind") == "List" else [doc]
            for obj in items:
                ident = f"{path.relative_to(EXAMPLES)}:{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
                found.append(pytest.param(obj, id=ident))
    return found


def test_examples_hold_objects_of_both_sorts():
    kinds = {p.values[0]["kind"] for p in example_objects()}
    assert "ShardedModel" in kinds and "Node" in kinds


@pytest.mark.parametrize("obj", example_objects())
def test_example_validates(obj):
    if obj["kind"] == "ShardedModel":
        assert obj["apiVersion"] == "sharding.dev/v1alpha1"
        if ".." in obj["spec"]["model"]["path"].split("/"):  # local-demo.yaml: for shardctl, beside the file
            with pytest.raises(jsonschema.ValidationError, match="does not match"):
                jsonschema.Draft4Validator(crd_schema()).validate(obj)
            return
        jsonschema.Draft4Validator(crd_schema()).validate(obj)
        return
    try:
        kubernetes_validate.validate(obj, VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"{obj['apiVersion']} {obj['kind']}: neither a built-in kind nor a ShardedModel")
    except kubernetes_validate.ValidationError as err:
        pytest.fail(f"{'.'.join(map(str, err.path))}: {err.message}")


def test_strict_validation_catches_a_misspelt_field():
    node = next(p.values[0] for p in example_objects() if p.values[0]["kind"] == "Node")
    broken = {**node, "status": {**node["status"], "capacityy": {"cpu": "1"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
