"""bench/gpu_decode.py's pure parts: the order of its measurements (what issue 25 asks first runs
before HF's peer, whose compile is the longest, so a deadline takes the rest) and the KV cache its
plans ask for (what the largest batch needs, so a plan fits any card that holds the weights)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_decode import kv_memory, measure_order, variants  # bench/ is not a package

from shard_contract.sharding import KV_BLOCK_SIZE, KV_RESERVED_BLOCKS


def test_bfloat16_and_the_first_int8_product_run_before_the_peer():
    chosen = variants(["bfloat16", "int8"], ["compiled", "int8pack"])
    first, later = measure_order(chosen, "compiled")
    assert [v[0] for v in first] == ["bfloat16", "int8 compiled"]
    assert [v[0] for v in later] == ["int8 int8pack"]
    assert measure_order(variants(["bfloat16"], ["compiled"]), "compiled") == (variants(["bfloat16"], []), [])


def test_the_kv_cache_holds_the_largest_batch_and_no_more_than_a_quarter_over():
    per_token = 128 * 2**10  # an 8B model's bfloat16 keys and values, every layer
    asked = kv_memory(per_token, 32, 168)
    assert asked.endswith("MiB")
    mib = int(asked.removesuffix("MiB"))
    needed = (32 * -(-168 // KV_BLOCK_SIZE) + KV_RESERVED_BLOCKS) * KV_BLOCK_SIZE * per_token
    assert needed <= mib * 2**20 <= 1.25 * needed + 2**20
