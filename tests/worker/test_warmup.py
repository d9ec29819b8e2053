"""The warm-up pass before ready: the plan's largest forward pass runs, is measured, leaves the KV
cache as it found it, and an out-of-memory in it fails with a plan-level reason."""

from __future__ import annotations

import pytest
import torch

from shard_worker.comm.dist import Comm, Topology
from shard_worker.engine.warmup import WarmupOutOfMemory, largest_pass, warm_up
from shard_worker.model.config import ModelConfig
from shard_worker.model.loader import load_stage
from shard_worker.model.model import Stage
from shard_worker.model.slices import Layout
from shard_worker.model.step import KVCache, Rotary
from shard_worker.telemetry.accounting import Accounting


def one_rank(model_dir, batch: int, max_len: int) -> tuple[Stage, KVCache, Rotary]:
    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), Accounting()), torch.float32, torch.device("cpu"))
    load_stage(stage, model_dir)
    cache = KVCache(config.num_layers, batch, layout.kv_heads, max_len, config.head_dim, torch.float32,
                    torch.device("cpu"))
    return stage, cache, Rotary(config, max_len, torch.device("cpu"))


def test_largest_pass_is_the_prefill_rows_by_the_last_chunk():
    assert largest_pass(8, 4096, 512) == (8, 3584, 4096)
    assert largest_pass(2, 100, 512) == (2, 0, 100)  # a context shorter than a chunk: all of it


def test_warm_up_runs_the_largest_pass_and_leaves_the_cache_zeroed(checkpoint):
    stage, cache, rotary = one_rank(checkpoint("llama"), batch=3, max_len=96)
    warm = warm_up(stage, cache, rotary, rows=3, max_len=96, chunk=32)
    assert (warm.rows, warm.cols) == (3, 32)
    assert warm.activations >= 0
    assert not cache.k.any() and not cache.v.any()


def test_an_out_of_memory_in_the_warm_up_names_the_plan(checkpoint):
    stage, cache, rotary = one_rank(checkpoint("llama"), batch=2, max_len=64)
    cache.k.fill_(1.0)

    def forward(*_args, **_kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    stage.forward = forward  # what a device too small for the activations raises
    with pytest.raises(WarmupOutOfMemory, match=r"2 rows x 64 prefill tokens.*maxModelLen"):
        warm_up(stage, cache, rotary, rows=2, max_len=64)
    assert not cache.k.any(), "the cache is zeroed whatever happened"
