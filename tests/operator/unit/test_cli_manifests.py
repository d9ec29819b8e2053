"""`shardctl manifests`: the operator's objects for a ShardedModel on a node pool, without a cluster."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml

from shard_contract.env import WorkerEnv
from shard_operator.cli import main
from shard_operator.planning.inventory import inventory_from_nodes, load_nodes
from tests.support.cluster import write_model

ROOT = Path(__file__).resolve().parents[3]


def usable_nodes() -> set[str]:
    inventory = inventory_from_nodes(load_nodes(ROOT / "examples/nodes.yaml"))
    return {d.node for d in inventory.devices}


def test_manifests_for_the_example_on_the_example_pool(tmp_path, capsys):
    model_dir = write_model(tmp_path / "tiny-llama")
    code = main(["manifests", "-f", str(ROOT / "examples/shardedmodel.yaml"), "--model-dir", str(model_dir),
                 "--nodes", str(ROOT / "examples/nodes.yaml"), "--image", "reg/worker:9"])
    assert code == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = [o["kind"] for o in objects]
    assert kinds[:4] == ["NetworkPolicy", "Service", "Service", "ConfigMap"] and kinds.count("Pod") >= 1
    # Tainted (untolerated), cordoned and NotReady nodes are not used; gpu-h100-b's taint is the GPU
    # resource's own, which rank pods tolerate.
    assert usable_nodes() == {"gpu-h100-a", "gpu-h100-b", "gpu-l40s-a", "gpu-batch-a"}
    usable = usable_nodes()
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)
        assert obj["metadata"]["namespace"] == "default" and "ownerReferences" not in obj["metadata"]
        if obj["kind"] == "Pod":
            WorkerEnv.from_env({e["name"]: e["value"] for e in obj["spec"]["containers"][0]["env"] if "value" in e})
            assert obj["spec"]["containers"][0]["image"] == "reg/worker:9"
            assert obj["metadata"]["annotations"]["sharding.dev/node"] in usable


def test_manifests_leave_the_network_policy_out_when_asked(tmp_path, capsys):
    model_dir = write_model(tmp_path / "tiny-llama")
    code = main(["manifests", "-f", str(ROOT / "examples/shardedmodel.yaml"), "--model-dir", str(model_dir),
                 "--nodes", str(ROOT / "examples/nodes.yaml"), "--no-network-policy"])
    assert code == 0
    kinds = [o["kind"] for o in yaml.safe_load_all(capsys.readouterr().out)]
    assert "NetworkPolicy" not in kinds and "Pod" in kinds


def test_manifests_refuse_a_model_no_pod_can_mount(tmp_path, capsys):
    # The 70B example without its volume: a relative path is only for shardctl, beside the file.
    model = yaml.safe_load((ROOT / "examples/llama-70b.yaml").read_text())
    del model["spec"]["model"]["volume"]
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(model))
    code = main(["manifests", "-f", str(tmp_path / "llama.yaml"), "--nodes", str(ROOT / "examples/nodes.yaml")])
    assert code == 1
    assert "without spec.model.volume the path must be absolute" in capsys.readouterr().err
