"""Device inventory: Kubernetes Nodes, the compact string, and this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from shard_contract.units import GiB, MiB, parse_bytes
from shard_operator.api import Placement, Toleration
from shard_operator.planning.inventory import (
    CPU_SPEED,
    bandwidth_of,
    inventory_from_nodes,
    load_nodes,
    local_inventory,
    local_kind,
    parse_devices,
)

NODES = Path(__file__).resolve().parents[3] / "examples" / "nodes.yaml"


def pool(**kwargs) -> Placement:
    return Placement(node_selector={"sharding.dev/pool": "inference"}, **kwargs)


def test_nodes_file_skips_what_cannot_host_the_model():
    inventory = inventory_from_nodes(load_nodes(NODES), pool())
    skipped = {s.node: s.reason for s in inventory.skipped}
    assert skipped == {
        "gpu-a100-a": "NotReady",
        "gpu-batch-a": "not in the node pool (sharding.dev/pool=batch, want inference)",
        "gpu-l40s-b": "cordoned",
        "gpu-train-a": "tainted dedicated=training:NoSchedule (not tolerated)",
    }
    # gpu-h100-b's taint is the GPU resource's own (tolerated by default, see below)
    assert inventory.nodes() == ["gpu-h100-a", "gpu-h100-b", "gpu-l40s-a"]
    h100 = [d for d in inventory.devices if d.node == "gpu-h100-a"]
    assert [d.index for d in h100] == list(range(8))
    assert h100[0].memory_bytes == 81559 * MiB and h100[0].speed == 3.35
    assert h100[0].product == "NVIDIA-H100-80GB-HBM3" and h100[0].name == "cuda:0"


def test_tolerations_admit_tainted_nodes():
    exists = Toleration(key="dedicated", operator="Exists", effect="NoSchedule")
    inventory = inventory_from_nodes(load_nodes(NODES), pool(tolerations=[exists]))
    assert "gpu-train-a" in inventory.nodes()
    equal = Toleration(key="dedicated", operator="Equal", value="training")
    assert "gpu-train-a" in inventory_from_nodes(load_nodes(NODES), pool(tolerations=[equal])).nodes()
    wrong_value = Toleration(key="dedicated", operator="Equal", value="serving")
    assert "gpu-train-a" not in inventory_from_nodes(load_nodes(NODES), pool(tolerations=[wrong_value])).nodes()
    everything = Toleration(operator="Exists")
    assert len(inventory_from_nodes(load_nodes(NODES), pool(tolerations=[everything])).nodes()) == 4


def _tainted(*taints: dict) -> dict:
    return {"kind": "Node", "metadata": {"name": "n", "labels": {"nvidia.com/gpu.memory": "81559"}},
            "spec": {"taints": list(taints)},
            "status": {"allocatable": {"nvidia.com/gpu": "8", "amd.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}  # GKE, EKS, the GPU Operator
SKU_TAINT = {"key": "sku", "value": "gpu", "effect": "NoSchedule"}  # AKS


@pytest.mark.parametrize("taints, placement, admitted", [
    ([GPU_TAINT], {}, True),  # the GPU resource's own taint: tolerated without a word in the spec
    ([{"key": "nvidia.com/gpu", "effect": "NoSchedule"}], {}, True),  # valueless: tolerated too (Exists)
    # ExtendedResourceToleration adds NoSchedule only: a NoExecute taint still needs the spec
    ([{"key": "nvidia.com/gpu", "effect": "NoExecute"}], {}, False),
    ([{"key": "amd.com/gpu", "effect": "NoSchedule"}], {"gpu_resource": "amd.com/gpu"}, True),
    ([GPU_TAINT], {"gpu_resource": "amd.com/gpu"}, False),  # not the resource these pods request
    ([SKU_TAINT], {}, False),
    ([SKU_TAINT], {"tolerations": [Toleration(key="sku", value="gpu")]}, True),
    ([GPU_TAINT, SKU_TAINT], {"tolerations": [Toleration(key="sku", operator="Exists")]}, True),
    ([GPU_TAINT, SKU_TAINT], {}, False),
    ([{"key": "dedicated", "effect": "PreferNoSchedule"}], {}, True),  # a preference only
])
def test_the_gpu_resources_own_taint_is_tolerated_by_default_others_need_the_spec(taints, placement, admitted):
    inventory = inventory_from_nodes([_tainted(*taints)], Placement(**placement))
    assert bool(inventory.devices) == admitted, inventory.skipped


def test_other_gpu_resource_and_missing_labels():
    nodes = load_nodes(NODES)
    inventory = inventory_from_nodes(nodes, Placement(gpu_resource="amd.com/gpu"))
    assert not inventory.devices
    assert all("no allocatable amd.com/gpu" in s.reason for s in inventory.skipped
               if s.reason not in ("NotReady", "cordoned") and not s.reason.startswith("tainted"))
    bare = {"kind": "Node", "metadata": {"name": "bare", "labels": {}},
            "status": {"allocatable": {"nvidia.com/gpu": "2"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    assert inventory_from_nodes([bare]).skipped[0].reason.startswith("no nvidia.com/gpu.memory label")
    assert "no product label either" in inventory_from_nodes([bare]).skipped[0].reason


def _node(**labels: str) -> dict:
    return {"kind": "Node", "metadata": {"name": "n", "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": "2"}, "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.parametrize("labels, mib, product", [
    # GPU feature discovery's memory label, as before
    ({"nvidia.com/gpu.memory": "81559"}, 81559, ""),
    # without it (GKE, plain EKS): the product's known memory, from GFD's product or GKE's label
    ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, 81559, "NVIDIA-H100-80GB-HBM3"),
    ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, 81920, "NVIDIA-A100-SXM4-80GB"),
    ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}, 40960, "NVIDIA-A100-SXM4-40GB"),
    ({"nvidia.com/gpu.product": "NVIDIA-H100-NVL"}, 95830, "NVIDIA-H100-NVL"),
    ({"nvidia.com/gpu.product": "NVIDIA-L40S"}, 46068, "NVIDIA-L40S"),
    ({"nvidia.com/gpu.product": "NVIDIA-L4"}, 23034, "NVIDIA-L4"),
    ({"nvidia.com/gpu.product": "Tesla-T4"}, 15360, "Tesla-T4"),
    ({"nvidia.com/gpu.product": "NVIDIA-A10G"}, 22888, "NVIDIA-A10G"),
    ({"cloud.google.com/gke-accelerator": "nvidia-l4"}, 23034, "nvidia-l4"),
    ({"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"}, 40960, "nvidia-tesla-a100"),
    ({"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}, 81920, "nvidia-a100-80gb"),
    ({"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"}, 81559, "nvidia-h100-mega-80gb"),
    # ours wins over both (a MIG layout, a card the table does not know): a size, or MiB as GFD writes it
    ({"sharding.dev/gpu-memory": "40Gi", "nvidia.com/gpu.memory": "81559"}, 40 * 1024, ""),
    ({"sharding.dev/gpu-memory": "23034", "nvidia.com/gpu.product": "NVIDIA-L4"}, 23034, "NVIDIA-L4"),
])
def test_gpu_memory_without_feature_discovery(labels, mib, product):
    (device, _) = inventory_from_nodes([_node(**labels)]).devices
    assert (device.memory_bytes, device.product) == (mib * MiB, product)


@pytest.mark.parametrize("labels, reason", [
    ({}, "no nvidia.com/gpu.memory label (GPU feature discovery not running?), no sharding.dev/gpu-memory label, "
         "and no product label either: label the node sharding.dev/gpu-memory=<memory of one GPU, e.g. 80Gi>"),
    ({"nvidia.com/gpu.product": "NVIDIA-Quadro-9000"}, "product NVIDIA-Quadro-9000 is not in the table of known GPUs"),
    # a MIG slice has a fraction of the card's memory: never the table's figure
    ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"}, "is not in the table of known GPUs"),
    ({"sharding.dev/gpu-memory": "lots"}, "sharding.dev/gpu-memory=lots: expected a size such as 80Gi"),
    ({"nvidia.com/gpu.memory": "0"}, "nvidia.com/gpu.memory=0: expected MiB as a positive number"),
])
def test_a_node_whose_gpu_memory_is_unknown_is_skipped_saying_what_to_label(labels, reason):
    (skipped,) = inventory_from_nodes([_node(**labels)]).skipped
    assert reason in skipped.reason


@pytest.mark.parametrize("text, expected", [
    ("a:80GiB*4", [("a", 0, 80 * GiB, 1.0)] + [("a", i, 80 * GiB, 1.0) for i in range(1, 4)]),
    ("a:24GB*2@0.3", [("a", 0, 24 * 10**9, 0.3), ("a", 1, 24 * 10**9, 0.3)]),
    ("a:1GiB,a:2GiB", [("a", 0, GiB, 1.0), ("a", 1, 2 * GiB, 1.0)]),
    ("a:80GiB:H100", [("a", 0, 80 * GiB, 3.35)]),
    (" x:512MiB*1 , y:1.5GiB ", [("x", 0, 512 * MiB, 1.0), ("y", 0, int(1.5 * GiB), 1.0)]),
])
def test_parse_devices(text, expected):
    devices = parse_devices(text).devices
    assert [(d.node, d.index, d.memory_bytes, d.speed) for d in devices] == expected


@pytest.mark.parametrize("text, message", [
    ("", "the device list is empty; write NODE:MEMORY[*COUNT][@SPEED][:PRODUCT]"),
    ("  ", "the device list is empty"),
    ("a", "device spec 'a': write NODE:MEMORY"),
    ("a:lots", "device spec 'a:lots': write NODE:MEMORY"),
    ("a:80GiB*x", "device spec 'a:80GiB*x': write NODE:MEMORY"),
    (":80GiB", "device spec ':80GiB': write NODE:MEMORY"),
    ("a:80*4", "device spec 'a:80*4': memory '80' has no unit; write it like 80GiB, 80GB or 80MiB"),
    ("a:80XB", "device spec 'a:80XB': memory '80XB' is not a memory size"),
    ("b:1GiB,a:0GiB", "device spec 'a:0GiB': memory must be positive"),
    ("b:1GiB,a:80GiB*0", "device spec 'a:80GiB*0': the count after * must be at least 1"),
    ("a:1GiB@0", "device spec 'a:1GiB@0': speed must be positive"),
    ("a:1GiB,,b:1GiB", "device list 'a:1GiB,,b:1GiB' has an empty entry"),
])
def test_parse_devices_rejects_nonsense_naming_the_entry(text, message):
    with pytest.raises(ValueError) as err:
        parse_devices(text)
    assert str(err.value).startswith(message)


def test_auto_kind_is_what_this_machine_runs_on_localhost_and_gpus_elsewhere():
    devices = parse_devices("localhost:256MiB*2,a:24GiB", kind="auto").devices
    assert [d.kind for d in devices] == [local_kind(), local_kind(), "gpu"]
    assert local_kind() == ("gpu" if any(d.kind == "gpu" for d in local_inventory().devices) else "cpu")
    assert parse_devices("localhost:1GiB").devices[0].kind == "gpu"  # asked for: as given


def test_cpu_devices_get_cpu_speed():
    devices = parse_devices("local:2GiB*2", kind="cpu").devices
    assert {d.kind for d in devices} == {"cpu"} and devices[0].speed == CPU_SPEED and devices[1].name == "cpu:1"


def test_local_inventory_splits_memory_over_ranks():
    inventory = local_inventory(ranks=3, budget_bytes=GiB)
    if inventory.devices[0].kind == "cpu":
        assert [d.memory_bytes for d in inventory.devices] == [GiB] * 3
    default = local_inventory()
    assert default.devices and all(d.memory_bytes > 0 for d in default.devices)


@pytest.mark.parametrize("product, tbps", [("NVIDIA-H100-80GB-HBM3", 3.35), ("NVIDIA-H100-PCIe", 2.0),
                                           ("NVIDIA-A100-SXM4-40GB", 1.555), ("NVIDIA-L4", 0.3),
                                           ("NVIDIA L40S", 0.864), ("Mystery-GPU", 1.0)])
def test_known_bandwidths(product, tbps):
    assert bandwidth_of(product) == tbps


@pytest.mark.parametrize("text, value", [("80GiB", 80 * GiB), ("24G", 24 * 10**9), ("512Mi", 512 * MiB),
                                         ("1.5TiB", int(1.5 * 2**40)), ("4096B", 4096), (1000, 1000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80", "0", " 1.5 "])
def test_parse_bytes_needs_a_unit(text):
    with pytest.raises(ValueError, match="has no unit; write it like"):
        parse_bytes(text)


def test_device_kind_label_makes_cpu_backed_devices():
    """The one-machine dev cluster labels its simulated GPUs as CPU memory budgets."""
    node = {"kind": "Node", "metadata": {"name": "sim", "labels": {
                "nvidia.com/gpu.memory": "160", "sharding.dev/device-kind": "cpu"}},
            "status": {"allocatable": {"nvidia.com/gpu": "2"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    devices = inventory_from_nodes([node]).devices
    assert [(d.kind, d.name, d.memory_bytes) for d in devices] == [("cpu", "cpu:0", 160 * MiB),
                                                                   ("cpu", "cpu:1", 160 * MiB)]
    del node["metadata"]["labels"]["sharding.dev/device-kind"]
    assert {d.kind for d in inventory_from_nodes([node]).devices} == {"gpu"}
    node["metadata"]["labels"]["sharding.dev/device-kind"] = "tpu"
    inventory = inventory_from_nodes([node])
    assert not inventory.devices
    assert inventory.skipped[0].reason == "sharding.dev/device-kind=tpu: expected gpu or cpu"
