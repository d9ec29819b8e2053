"""A rank holds the KV cache its plan sizes (spec.serving): the plan's tokens are whole blocks of 16,
exactly what the paged cache gives sequences; its pool also holds the two reserved blocks (ZERO
and TRASH: model/paging.py), which the plan's bytes count; maxBatchSize caps the sequences that
run at once."""

from __future__ import annotations

import pytest
import torch

from shard_contract.plan import Plan
from shard_contract.sharding import (
    KV_BLOCK_SIZE,
    KV_RESERVED_BLOCKS,
    MAX_STEP_TOKENS,
    kv_pool_tokens,
    kv_whole_blocks,
    prefill_rows,
)
from shard_contract.wire import GenerateRequest, GenerateTask
from shard_operator.local.launcher import plan_local, run_generate
from shard_worker.engine.kvblocks import Blocks
from shard_worker.model import paging
from shard_worker.model.step import KVCache
from shard_worker.rank.runtime import cache_rows, cache_tokens, warm_rows

from .conftest import make_plan

RESERVED = KV_BLOCK_SIZE * KV_RESERVED_BLOCKS  # the pool's positions no sequence holds


def _with_tokens(plan: Plan, tokens: int) -> Plan:
    return plan.model_copy(update={"ranks": [r.model_copy(update={"kv_cache_tokens": tokens}) for r in plan.ranks]})


@pytest.mark.parametrize("batch, max_len, tokens, warm", [
    (4, 64, 4 * 64, 4),  # the reservation: maxBatchSize rows
    (4, 64, 2 * 64 + 63, 4),  # fewer tokens: the rows share the blocks there are (admission waits for them)
    (4, 64, 10**9, 4),  # more tokens than rows can use: the cap
    # 256 rows run at once; a prefill pass (and the warm-up) takes the rows the plan sized activations for
    (256, 4096, 10**9, MAX_STEP_TOKENS["cpu"] // 512),
])
def test_cache_rows(checkpoint, batch, max_len, tokens, warm):
    plan = _with_tokens(make_plan(checkpoint("llama"), 1, 1, max_len=64, batch=4), tokens)
    plan = plan.model_copy(update={"max_batch_size": batch, "max_model_len": max_len})
    assert cache_rows(plan) == batch
    assert warm_rows(plan, plan.ranks[0]) == warm == prefill_rows(batch, max_len, "cpu")
    assert cache_tokens(plan, plan.ranks[0]) == tokens


@pytest.mark.slow
def test_a_fraction_of_a_cpu_budget_sizes_the_cache_the_rank_allocates(checkpoint):
    model = checkpoint("llama")
    roomy = plan_local(model, 1, 1, max_model_len=64, max_batch_size=4, devices="localhost:1GiB",
                       kv_cache_memory_fraction=0.5)
    r = roomy.ranks[0]
    per_token = r.predicted_bytes.kv_cache // (r.kv_cache_tokens + RESERVED)
    rest = r.predicted_bytes.total - r.predicted_bytes.kv_cache
    # a budget whose free half holds two and a half sequences of 64 tokens and the reserved blocks:
    # sequences get it in whole blocks, rounded up (176 tokens: the free memory has room for the
    # block), the reserved blocks are not theirs
    budget = int((rest + 2 * (160 + 8 + RESERVED) * per_token) / (1 - roomy.memory_headroom)) + 1
    plan = plan_local(model, 1, 1, max_model_len=64, max_batch_size=4, devices=f"localhost:{budget}B",
                      kv_cache_memory_fraction=0.5)
    (rank,) = plan.ranks
    assert rank.kv_cache_tokens == 176 and rank.predicted_bytes.total <= rank.usable_bytes
    half = 0.5 * (rank.usable_bytes - rest)
    assert half <= rank.predicted_bytes.kv_cache == (176 + RESERVED) * per_token < half + 16 * per_token
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=[3, 4, 5], max_new_tokens=3),
                                  GenerateRequest(prompt_ids=[7, 8], max_new_tokens=3)])
    result = run_generate(plan, model, task, timeout=180, threads_per_rank=1)
    assert all(len(c.token_ids) == 3 for c in result.completions)
    (entry,) = result.ranks
    assert entry.report is not None
    # the rank allocated exactly the plan's bytes: its tokens and the reserved blocks
    assert entry.report.allocated_bytes["kv_cache"] == rank.predicted_bytes.kv_cache


@pytest.mark.parametrize("tokens", [16, 160, 4096, 123456 * 16])
def test_a_rank_gives_sequences_exactly_the_plan_s_tokens(tokens):
    """The worker's paged cache and its block bookkeeping give sequences the plan's tokens (whole
    blocks), and the pool is the bytes the planner predicts: the plan's tokens and the reserved
    blocks (ZERO, TRASH), whose constants the contract owns for both sides."""
    cache = KVCache(layers=1, batch=1, kv_heads=1, max_len=16, head_dim=1, dtype=torch.float32,
                    device=torch.device("cpu"), tokens=tokens)
    pool = Blocks(cache.num_blocks, cache.block_size, first_id=paging.RESERVED_BLOCKS).pool
    assert pool.num_blocks * pool.block_size == cache.num_blocks * cache.block_size == tokens
    assert cache.nbytes == 2 * kv_pool_tokens(tokens) * 4 == 2 * (tokens + RESERVED) * 4
    assert (paging.BLOCK_SIZE, paging.RESERVED_BLOCKS) == (KV_BLOCK_SIZE, KV_RESERVED_BLOCKS)


@pytest.mark.parametrize("fraction, max_len, batch", [(0.5, 64, 4), (0.9, 100, 3), (None, 100, 3), (None, 64, 2)])
def test_the_planned_tokens_are_whole_blocks_and_the_bytes_count_the_reserved_ones(checkpoint, fraction, max_len,
                                                                                  batch):
    """Whatever the budget or the reservation: whole blocks for sequences (a sequence of maxModelLen
    in whole blocks, maxBatchSize of them reserved), bytes for those and the reserved blocks."""
    plan = plan_local(checkpoint("llama"), 1, 1, max_model_len=max_len, max_batch_size=batch,
                      devices="localhost:1GiB", kv_cache_memory_fraction=fraction)
    (r,) = plan.ranks
    assert r.kv_cache_tokens % KV_BLOCK_SIZE == 0 and r.kv_cache_tokens >= kv_whole_blocks(max_len)
    if fraction is None:
        assert r.kv_cache_tokens == batch * kv_whole_blocks(max_len) == plan.reserved_tokens
    per_token = r.predicted_bytes.kv_cache // (r.kv_cache_tokens + RESERVED)
    assert r.predicted_bytes.kv_cache == (r.kv_cache_tokens + RESERVED) * per_token
