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


def test_the_70b_example_serves_from_the_model_store(capsys):
    """`shardctl manifests` on the 70B example (its config beside it stands for the PVC's copy):
    every object validates, and each rank reads the claim and path the download Job writes."""
    from shard_operator.cli import main

    store = {doc["kind"]: doc for path in (EXAMPLES / "model-store").glob("*.yaml")
             for doc in yaml.safe_load_all(path.read_text()) if doc}
    claim, job = store["PersistentVolumeClaim"], store["Job"]["spec"]["template"]["spec"]
    assert main(["manifests", "-f", str(EXAMPLES / "llama-70b.yaml"),
                 "--devices", "gpu-a:80GiB*8:H100,gpu-b:80GiB*8:H100"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    pods = [o for o in objects if o["kind"] == "Pod"]
    # 2 replicas of tensor=8: a pod per tensor-parallel group, holding its node's 8 GPUs
    assert [p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for p in pods] == ["8", "8"]
    for obj in objects:
        kubernetes_validate.validate(obj, VERSION, strict=True)
        assert obj["metadata"]["namespace"] == claim["metadata"]["namespace"] == "inference"

    (job_container,) = job["containers"]
    job_env = {e["name"]: e["value"] for e in job_container["env"]}
    job_mount = next(m["mountPath"] for m in job_container["volumeMounts"] if m["name"] == "store")
    job_claim = next(v["persistentVolumeClaim"]["claimName"] for v in job["volumes"] if v["name"] == "store")
    assert job_claim == claim["metadata"]["name"] and "ReadWriteMany" in claim["spec"]["accessModes"]
    for pod in pods:
        spec = pod["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": job_claim, "readOnly": True}
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
        model_dir = next(e["value"] for e in container["env"] if e["name"] == "SHARD_MODEL_DIR")
        assert mount["readOnly"] and model_dir.removeprefix(mount["mountPath"]) == \
            job_env["DEST"].removeprefix(job_mount)  # the same directory of the claim
    # The Job runs as the worker image's user (Dockerfile.worker), so every rank can read what it wrote.
    assert job["securityContext"]["runAsUser"] == 65532 and "useradd --no-log-init --uid 65532" in \
        (REPO / "Dockerfile.worker").read_text()


def test_the_download_job_keeps_the_token_out_of_the_environment():
    (job,) = [doc for doc in yaml.safe_load_all((EXAMPLES / "model-store" / "download-llama-70b.yaml").read_text())]
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert not [e for e in container["env"] if "valueFrom" in e]
    token_path = next(e["value"] for e in container["env"] if e["name"] == "HF_TOKEN_PATH")
    (secret,) = [v for v in spec["volumes"] if "secret" in v]
    mount = next(m for m in container["volumeMounts"] if m["name"] == secret["name"])
    assert mount["readOnly"] and token_path == f"{mount['mountPath']}/{secret['secret']['items'][0]['path']}"
    assert container["securityContext"]["readOnlyRootFilesystem"] and spec["securityContext"]["runAsNonRoot"]
