"""Objects that arrange a test cluster: GPU nodes, tiny model directories, ShardedModels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "tie_word_embeddings": False,
}

# A Llama-2-7B-shaped config (bfloat16): big enough that streaming weights, not collective latency,
# sets the decode pace, so faster GPUs make a measurably better plan.
SEVEN_B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, torch_dtype="bfloat16")


def write_model(directory: Path, **overrides: Any) -> Path:
    """A model directory with config.json only: enough for the profiler and the planner."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return directory


def gpu_node(name: str, gpus: int = 2, memory_mib: int = 24576, product: str = "NVIDIA-L4", *,
             ready: bool = True, unschedulable: bool = False, labels: dict[str, str] | None = None,
             resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product,
                                              "nvidia.com/gpu.memory": str(memory_mib),
                                              "nvidia.com/gpu.count": str(gpus), **(labels or {})}},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"allocatable": {"cpu": "32", "memory": "128Gi", resource: str(gpus), "pods": "110"},
                   "capacity": {"cpu": "32", "memory": "128Gi", resource: str(gpus), "pods": "110"},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def sharded_model(name: str, model_dir: Path, *, replicas: int = 1, tensor: int | str = 2,
                  pipeline: int | str = 1, namespace: str = "default", pod_layout: str = "perRank",
                  **spec: Any) -> dict[str, Any]:
    """A ShardedModel whose checkpoint lies in a hostPath the operator can read; one pod per rank
    unless `pod_layout` says otherwise (the operator's tests count pods per rank)."""
    body = {
        "apiVersion": "sharding.dev/v1alpha1", "kind": "ShardedModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"path": model_dir.name, "volume": {"hostPath": {"path": str(model_dir.parent)}},
                           "maxModelLen": 256},
                 "parallelism": {"tensor": tensor, "pipeline": pipeline},
                 "replicas": replicas, **spec,
                 "placement": {"podLayout": pod_layout, **spec.get("placement", {})}},
    }
    return body
