"""bench/gpu_decode.py's pure parts: the order of its measurements (what issue 25 asks first runs
before HF's peer, whose compile is the longest, so a deadline takes the rest) and the KV cache its
plans ask for (what the largest batch needs, so a plan fits any card that holds the weights); and
a child that fails or runs out of time keeps the batches it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_decode import finished_batches, kv_memory, measure_order, rows, variants  # bench/ is not a package

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


def test_a_child_cut_off_keeps_the_batches_it_measured():
    one = {"seconds_per_step": 0.01, "tokens_per_s": 100.0, "prefill_seconds": 0.1, "decode_steps": 127,
           "predicted_step_seconds": 0.008, "tokens": [1, 2, 3]}
    stderr = ("loading ...\n"
              f"batch 1: {json.dumps(one)}\n"
              f"batch 8: {json.dumps({**one, 'tokens_per_s': 700.0, 'seconds_per_step': 8 / 700})}\n"
              'batch 32: {"seconds_per_step": 0.0')  # cut off mid-line
    done = finished_batches(stderr)
    assert list(done) == ["1", "8"] and done["8"]["tokens_per_s"] == 700.0
    assert finished_batches("Traceback (most recent call last):\nRuntimeError: CUDA error") == {}
    report = {"bandwidth": {"gb_per_s": 3000.0}, "results": {"bfloat16": {"bytes": 15 * 2**30, "ours": {
        "error": "timed out", "batches": done}}}}
    assert [(r["variant"], r["batch"]) for r in rows(report)] == [("bfloat16", 1), ("bfloat16", 8)]


def test_a_measurement_past_its_time_is_an_error_that_keeps_its_batches(monkeypatch):
    import subprocess
    import time

    import gpu_decode

    def past_its_time(*args, timeout, **kwargs):
        raise subprocess.TimeoutExpired(["gpu_decode.py", "--child", *args], timeout,
                                        stderr=b'batch 1: {"tokens_per_s": 90.0, "seconds_per_step": 0.011}\n')

    monkeypatch.setattr(gpu_decode.decode, "run_child", past_its_time)
    errors: list[str] = []
    got = gpu_decode.step("ours bfloat16", errors, time.monotonic() + 60, "ours", "cuda")
    assert got["batches"] == {"1": {"tokens_per_s": 90.0, "seconds_per_step": 0.011}}
    assert "timed out" in got["error"] and errors == [f"ours bfloat16: {got['error'].splitlines()[0]}"]
