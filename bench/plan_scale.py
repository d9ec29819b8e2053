"""Plan a 405B-class Llama (from config.json alone) onto 1,024 GPUs of three kinds in 128 nodes.

Usage: python bench/plan_scale.py [--replicas N ...] [--repeat K]
Prints the chosen layout and the planning time (median of K runs); the goal is under one second.
When not every replica fits (48 do not), also the time of the checked suggestions of what would
(`shortfall`, median of K runs, each computed afresh); the goal is under two seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from shard_operator.api import parse_spec
from shard_operator.planning import plan, shortfall
from shard_operator.planning.explain import _suggest
from shard_operator.planning.inventory import inventory_from_nodes
from shard_operator.planning.profile import profile_from_config

LLAMA_405B = {  # the published shape of Llama 3.1 405B
    "architectures": ["LlamaForCausalLM"], "hidden_size": 16384, "intermediate_size": 53248,
    "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    "rope_theta": 500000.0, "tie_word_embeddings": False,
}
# (product label, MiB per GPU, nodes); 8 GPUs per node -> 1,024 GPUs in 128 nodes.
POOL = [("NVIDIA-H100-80GB-HBM3", 81559, 48), ("NVIDIA-A100-SXM4-40GB", 40960, 48), ("NVIDIA-L40S", 46068, 32)]


def nodes() -> list[dict]:
    out = []
    for product, mib, count in POOL:
        for i in range(count):
            out.append({
                "kind": "Node",
                "metadata": {"name": f"{product.split('-')[1].lower()}-{i:03d}", "labels": {
                    "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": str(mib),
                    "nvidia.com/gpu.count": "8", "topology.kubernetes.io/zone": f"zone-{i % 3}"}},
                "spec": {},
                "status": {"allocatable": {"nvidia.com/gpu": "8"},
                           "conditions": [{"type": "Ready", "status": "True"}]},
            })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 8, 48])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    profile = profile_from_config(LLAMA_405B, name="llama-405b")
    node_objs = nodes()
    print(f"model: {profile.total_numel / 1e9:.0f}B parameters, {profile.checkpoint_bytes / 2**30:.0f} GiB bf16")
    for replicas in args.replicas:
        spec = parse_spec({"model": {"path": "llama-405b", "maxModelLen": 8192}, "replicas": replicas})
        times, result = [], None
        for _ in range(args.repeat):
            start = time.perf_counter()
            inventory = inventory_from_nodes(node_objs, spec.placement)
            result = plan(profile, spec, inventory)
            times.append(time.perf_counter() - start)
        assert result is not None
        print(f"replicas={replicas}: {len(inventory.devices)} GPUs in {len(inventory.nodes())} nodes -> "
              f"tensor={result.tensor_parallel} x pipeline={result.pipeline_parallel}, "
              f"{len(result.ranks)} ranks, imbalance {result.imbalance:.3f}; "
              f"plan time median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f})")
        print(f"  reason: {result.reason}")
        if len(result.groups) < replicas:
            advice_times = []
            for _ in range(args.repeat):
                _suggest.cache_clear()  # the operator's memo of the answer: measure computing it
                start = time.perf_counter()
                missing = shortfall(result, profile, spec, inventory)
                advice_times.append(time.perf_counter() - start)
            assert missing is not None
            print(f"  {len(result.groups)} of {replicas} fit; "
                  f"suggestions median {statistics.median(advice_times):.3f} s "
                  f"(min {min(advice_times):.3f}, max {max(advice_times):.3f}): "
                  + "; or ".join(s.text for s in missing.suggestions))


if __name__ == "__main__":
    main()
