"""The ShardedModel API: validation messages, the generated CRD, and every example."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from shard_operator import api
from shard_operator.api.crd import build_crd, render

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml"))


def sharded_model_docs() -> list:
    return [pytest.param(doc, id=f"{path.name}:{doc['metadata']['name']}")
            for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text())
            if doc and doc.get("kind") == api.KIND]


def crd_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ---------------------------------------------------------------- examples
def test_there_are_examples():
    assert len(sharded_model_docs()) >= 3


@pytest.mark.parametrize("doc", sharded_model_docs())
def test_examples_validate_with_the_models(doc):
    model = api.parse_sharded_model(doc)
    assert model.spec.model.path


@pytest.mark.parametrize("doc", sharded_model_docs())
def test_examples_validate_against_the_crd_schema(doc):
    if ".." in doc["spec"]["model"]["path"].split("/"):  # local-demo.yaml: for shardctl, beside the file
        with pytest.raises(jsonschema.ValidationError, match="does not match"):
            jsonschema.Draft4Validator(crd_schema()).validate(doc)
    else:
        jsonschema.Draft4Validator(crd_schema()).validate(doc)


# ---------------------------------------------------------------- the CRD
def test_committed_crd_is_up_to_date():
    committed = (ROOT / "crds" / "shardedmodels.yaml").read_text()
    assert committed == render(), "crds/shardedmodels.yaml is stale: run `make crd`"


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_crd_schema_is_structural():
    for path, node in _walk(crd_schema()):
        assert "$ref" not in node and "nullable" not in node, path
        assert node.get("additionalProperties") is not False, path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
            assert "anyOf" not in node and "oneOf" not in node, path
        if "default" in node and node.get("type") != "object":
            jsonschema.Draft4Validator(node).validate(node["default"])


def test_crd_has_subresources_columns_and_short_name():
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "shardedmodels.sharding.dev"
    assert crd["spec"]["names"]["shortNames"] == ["sm"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    assert version["subresources"]["status"] == {}
    assert [(c["name"], c.get("priority", 0)) for c in version["additionalPrinterColumns"]] == [
        ("Phase", 0), ("TP", 0), ("PP", 0), ("Ready", 0), ("URL", 0), ("Reason", 0), ("Replicas", 1), ("Age", 0)]


def test_crd_carries_defaults_bounds_and_enums():
    spec = crd_schema()["properties"]["spec"]["properties"]
    assert spec["replicas"] == {"description": spec["replicas"]["description"], "minimum": 0,
                                "type": "integer", "default": 1}
    assert spec["placement"]["default"] == {}  # so nested defaults apply when placement is omitted
    assert spec["placement"]["properties"]["memoryHeadroom"]["exclusiveMaximum"] is True
    assert spec["model"]["properties"]["dtype"]["enum"] == ["auto", "float32", "bfloat16", "float16"]
    status = crd_schema()["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == list(api.PHASES)


# ---------------------------------------------------------------- validation messages
@pytest.mark.parametrize("spec, message", [
    ({"model": {"path": "m"}, "parallelism": {"tensor": 0}},
     'spec.parallelism.tensor: must be a positive integer or "auto" (got 0)'),
    ({"model": {"path": "m"}, "parallelism": {"pipeline": "many"}},
     'spec.parallelism.pipeline: must be a positive integer or "auto" (got \'many\')'),
    ({"model": {"path": "m", "maxModeLen": 8}}, "spec.model.maxModeLen: unknown field (did you mean maxModelLen?)"),
    ({"model": {"path": "m", "maxbatchsize": 8}},
     "spec.model.maxbatchsize: unknown field (did you mean maxBatchSize?)"),
    ({"model": {"path": "m"}, "replica": 2}, "spec.replica: unknown field (did you mean replicas?)"),
    ({"model": {"path": "m"}, "placement": {"tolerations": [{"kee": "a"}]}},
     "spec.placement.tolerations.0.kee: unknown field (did you mean key?)"),
    ({"model": {"path": "m", "volume": {"hostPath": {"path": "/m"}, "readOnly": True}}},
     "spec.model.volume.readOnly: unknown field (check its spelling and indentation)"),
    ({"model": {}}, "spec.model.path: required"),
    ({}, "spec.model: required"),
    ({"model": {"path": "m", "volume": {}}}, "spec.model.volume: give exactly one of pvc, hostPath or image"),
    ({"model": {"path": "m", "volume": {"pvc": {"claimName": "a"}, "hostPath": {"path": "/b"}}}},
     "spec.model.volume: give exactly one of pvc, hostPath or image (got ['pvc', 'hostPath'])"),
    ({"model": {"path": "m"}, "placement": {"memoryHeadroom": 1.5}},
     "spec.placement.memoryHeadroom: should be less than 1 (got 1.5)"),
    ({"model": {"path": "m"}, "replicas": -1}, "spec.replicas: should be greater than or equal to 0 (got -1)"),
    ({"model": {"path": "m", "dtype": "int4"}},
     "spec.model.dtype: should be 'auto', 'float32', 'bfloat16' or 'float16' (got 'int4')"),
    ({"model": {"path": "m"}, "parallelism": {"pipeline": 2, "layerPartition": [1, 2, 3]}},
     "spec.parallelism: layerPartition has 3 stages but pipeline is 2"),
    ({"model": {"path": "m"}, "worker": {"port": 70000}}, "spec.worker.port: should be less than or equal to 65535"),
    ({"model": {"path": "../../../../tmp/x", "volume": {"hostPath": {"path": "/models"}}}},
     "spec.model.path: must stay inside the volume: no '..' segments (got '../../../../tmp/x')"),
    ({"model": {"path": "llama/../../x", "volume": {"pvc": {"claimName": "a"}}}},
     "spec.model.path: must stay inside the volume"),
    ({"model": {"path": "/models/../etc"}}, "spec.model.path: a path on the node must not have '..' segments"),
    ({"model": {"path": "m", "volume": {"hostPath": {"path": "/data/../etc"}}}},
     "spec.model.volume.hostPath.path: must be an absolute path without '..' segments (got '/data/../etc')"),
    ({"model": {"path": "m", "volume": {"hostPath": {"path": "data"}}}},
     "spec.model.volume.hostPath.path: must be an absolute path"),
])
def test_validation_errors_name_the_field(spec, message):
    with pytest.raises(api.SpecError) as err:
        api.parse_spec(spec)
    assert message in str(err.value)


def test_defaults_and_int_or_auto():
    spec = api.parse_spec({"model": {"path": "m"}, "parallelism": {"tensor": 4}})
    assert spec.parallelism.tensor == 4 and spec.parallelism.pipeline == "auto"
    assert spec.replicas == 1 and spec.placement.gpu_resource == "nvidia.com/gpu"
    assert spec.placement.memory_headroom == 0.1 and spec.rollout.max_surge == 1
    assert spec.dump()["parallelism"] == {"tensor": 4, "pipeline": "auto"}


def test_whole_object_error_names_the_object():
    with pytest.raises(api.SpecError, match=r"ShardedModel broken is invalid:\nspec.replicas"):
        api.parse_sharded_model({"apiVersion": api.API_VERSION, "kind": api.KIND,
                                 "metadata": {"name": "broken"}, "spec": {"model": {"path": "m"}, "replicas": "x"}})


def test_a_misspelt_field_of_a_whole_object_gets_the_nearest_name():
    with pytest.raises(api.SpecError, match=r"spec.parallelism.pipelin: unknown field \(did you mean pipeline\?\)"):
        api.parse_sharded_model({"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "m"},
                                 "spec": {"model": {"path": "m"}, "parallelism": {"pipelin": 2}}})


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(api.SpecError) as err:
        api.load_sharded_models(tmp_path / "nope.yaml")
    assert str(err.value) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_load_sharded_models_rejects_files_without_one(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("kind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(api.SpecError, match="no object of kind ShardedModel"):
        api.load_sharded_models(path)
    path.write_text("spec: [unclosed\n")
    with pytest.raises(api.SpecError, match="not valid YAML"):
        api.load_sharded_models(path)


# ---------------------------------------------------------------- spec.model.path stays in its volume
@pytest.mark.parametrize("path, volume, normal", [
    ("llama", True, "llama"), ("/llama/", True, "llama"), ("./a//b/.", True, "a/b"), ("/", True, "."),
    ("/models/llama/", False, "/models/llama"), ("//models", False, "/models"),
    ("../.cache/demo", False, "../.cache/demo"),  # shardctl: beside the YAML file
])
def test_the_model_path_is_normalised_inside_its_volume(path, volume, normal):
    model = {"path": path, **({"volume": {"pvc": {"claimName": "w"}}} if volume else {})}
    assert api.parse_spec({"model": model}).model.path == normal


@given(path=st.text(st.sampled_from("ab./"), min_size=1, max_size=12))
def test_the_crd_pattern_refuses_exactly_the_paths_with_dotdot(path):
    schema = crd_schema()["properties"]["spec"]["properties"]["model"]["properties"]
    assert bool(re.fullmatch(schema["path"]["pattern"], path)) == (".." not in path.split("/"))
    host = schema["volume"]["properties"]["hostPath"]["properties"]["path"]["pattern"]
    assert bool(re.fullmatch(host, path)) == (path.startswith("/") and ".." not in path.split("/"))
    try:
        api.parse_spec({"model": {"path": path, "volume": {"hostPath": {"path": "/v"}}}})
    except api.SpecError:
        assert ".." in path.split("/")  # within a volume the check is the CRD's pattern, and no more


def test_shardctl_follows_a_hostpath_model_only_inside_its_volume(tmp_path):
    volume = tmp_path / "volume"
    (volume / "real").mkdir(parents=True)
    (volume / "inside").symlink_to("real")
    (volume / "out").symlink_to(tmp_path / "elsewhere")  # the target need not exist: nothing is probed
    def spec(path):
        return api.parse_spec({"model": {"path": path, "volume": {"hostPath": {"path": str(volume)}}}})
    assert api.resolve_model_dir(spec("inside").model) == (volume / "real").resolve()
    with pytest.raises(api.SpecError, match=r"^spec\.model\.path must stay inside the volume$"):
        api.resolve_model_dir(spec("out/llama").model)


def test_shardctl_reads_a_pvc_or_image_model_from_a_copy_beside_the_yaml(tmp_path):
    (tmp_path / "models" / "llama").mkdir(parents=True)
    for volume in ({"pvc": {"claimName": "store"}}, {"image": {"reference": "registry.example/llama:1"}}):
        model = api.parse_spec({"model": {"path": "models/llama", "volume": volume}}).model
        assert api.resolve_model_dir(model, base=tmp_path) == tmp_path / "models" / "llama"
        missing = api.parse_spec({"model": {"path": "other", "volume": volume}}).model
        where = re.escape(str(tmp_path / "other"))
        with pytest.raises(api.SpecError, match=rf"pass --model-dir .* beside the YAML file \(no {where}\)"):
            api.resolve_model_dir(missing, base=tmp_path)
        with pytest.raises(api.SpecError, match=r"pass --model-dir"):
            api.resolve_model_dir(model)
