"""bfloat16 on GPUs that lack it: the compute capability from GPU feature discovery's labels
decides. `dtype: auto` of a bfloat16 checkpoint runs float16 where a chosen GPU is below compute
capability 8.0 (T4, V100); `dtype: bfloat16` by name keeps off those GPUs and says why."""

from __future__ import annotations

import pytest

from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import inventory_from_nodes
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.replan import incompatibility
from tests.operator.unit.test_planner import LLAMA_8B, spec

PRODUCTS = {"t4": ("Tesla-T4", "16384", "7", "5"), "v100": ("Tesla-V100-SXM2-32GB", "32768", "7", "0"),
            "a100": ("NVIDIA-A100-SXM4-80GB", "81920", "8", "0"), "h100": ("NVIDIA-H100-80GB-HBM3", "81559", "9", "0")}


def gpu_node(name: str, product: str, gpus: int = 4, compute_labels: bool = True) -> dict:
    model, memory, major, minor = PRODUCTS[product]
    labels = {"nvidia.com/gpu.product": model, "nvidia.com/gpu.memory": memory}
    if compute_labels:
        labels |= {"nvidia.com/gpu.compute.major": major, "nvidia.com/gpu.compute.minor": minor}
    return {"kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.parametrize("product, capability, native", [
    ("t4", "7.5", False), ("v100", "7.0", False), ("a100", "8.0", True), ("h100", "9.0", True)])
def test_the_compute_capability_comes_from_gpu_feature_discovery(product, capability, native):
    (device, *_) = inventory_from_nodes([gpu_node("n", product)]).devices
    assert (device.compute_capability, device.native_bf16) == (capability, native)
    (unlabelled, *_) = inventory_from_nodes([gpu_node("n", product, compute_labels=False)]).devices
    assert (unlabelled.compute_capability, unlabelled.native_bf16) == ("", True)  # unknown: the worker decides


BF16 = profile_from_config(LLAMA_8B)  # a bfloat16 checkpoint
FP32 = profile_from_config({**LLAMA_8B, "torch_dtype": "float32"})


@pytest.mark.parametrize("profile, asked, nodes, dtype, said", [
    (BF16, "auto", [("t4-a", "t4", True)], "float16", "Tesla-T4 (compute capability 7.5) has no native bfloat16"),
    (BF16, "auto", [("v100-a", "v100", True)], "float16", "compute capability 7.0"),
    (BF16, "auto", [("a100-a", "a100", True)], "bfloat16", ""),
    (BF16, "auto", [("t4-a", "t4", False)], "bfloat16", ""),  # no labels: the worker falls back itself
    (FP32, "auto", [("t4-a", "t4", True)], "float32", ""),  # 16 GiB GPUs: float32 takes TP=4
    (BF16, "float16", [("t4-a", "t4", True)], "float16", ""),
    # by name: the T4 node is left out, the A100s serve it
    (BF16, "bfloat16", [("t4-a", "t4", True), ("a100-a", "a100", True)], "bfloat16", ""),
])
def test_the_plans_dtype(profile, asked, nodes, dtype, said):
    inventory = inventory_from_nodes([gpu_node(n, p, compute_labels=c) for n, p, c in nodes])
    result = plan(profile, spec(model={"dtype": asked}), inventory)
    assert result.dtype == dtype and said in result.reason
    if asked == "bfloat16":
        assert {r.node for r in result.ranks} == {"a100-a"}
    assert incompatibility(result, profile, spec(model={"dtype": asked})) is None  # kept, not re-planned


def test_bfloat16_by_name_on_gpus_without_it_says_so():
    with pytest.raises(PlanError) as err:
        plan(BF16, spec(model={"dtype": "bfloat16"}), inventory_from_nodes([gpu_node("t4-a", "t4")]))
    assert err.value.reason == "NoDevices"
    assert "t4-a: Tesla-T4 (compute capability 7.5) has no native bfloat16 (spec.model.dtype bfloat16; " \
           "auto would run float16 there)" in err.value.message
