"""A rank holds the KV cache its plan sizes (spec.serving): the paged cache's pool holds the plan's
tokens in whole blocks of 16 (and the two reserved blocks, ZERO and TRASH: model/paging.py), and
maxBatchSize caps the sequences that run at once."""

from __future__ import annotations

import pytest

from shard_contract.plan import Plan
from shard_contract.sharding import MAX_STEP_TOKENS, prefill_rows
from shard_contract.wire import GenerateRequest, GenerateTask
from shard_operator.local.launcher import plan_local, run_generate
from shard_worker.rank.runtime import cache_rows, cache_tokens

from .conftest import make_plan


def _with_tokens(plan: Plan, tokens: int) -> Plan:
    return plan.model_copy(update={"ranks": [r.model_copy(update={"kv_cache_tokens": tokens}) for r in plan.ranks]})


@pytest.mark.parametrize("batch, max_len, tokens, rows", [
    (4, 64, 4 * 64, 4),  # the reservation: maxBatchSize rows
    (4, 64, 2 * 64 + 63, 4),  # fewer tokens: the rows share the blocks there are (admission waits for them)
    (4, 64, 10**9, 4),  # more tokens than rows can use: the cap
    (256, 4096, 10**9, MAX_STEP_TOKENS["cpu"] // 512),  # the largest pass the plan sized activations for
])
def test_cache_rows(checkpoint, batch, max_len, tokens, rows):
    plan = _with_tokens(make_plan(checkpoint("llama"), 1, 1, max_len=64, batch=4), tokens)
    plan = plan.model_copy(update={"max_batch_size": batch, "max_model_len": max_len})
    assert cache_rows(plan, plan.ranks[0]) == rows == min(prefill_rows(batch, max_len, "cpu"), batch)
    assert cache_tokens(plan, plan.ranks[0]) == tokens


@pytest.mark.slow
def test_a_fraction_of_a_cpu_budget_sizes_the_cache_the_rank_allocates(checkpoint):
    model = checkpoint("llama")
    roomy = plan_local(model, 1, 1, max_model_len=64, max_batch_size=4, devices="localhost:1GiB",
                       kv_cache_memory_fraction=0.5)
    r = roomy.ranks[0]
    per_token = r.predicted_bytes.kv_cache // r.kv_cache_tokens
    rest = r.predicted_bytes.total - r.predicted_bytes.kv_cache
    # a budget whose free half holds two and a half sequences of 64 tokens
    budget = int((rest + 2 * 160 * per_token) / (1 - roomy.memory_headroom)) + 1
    plan = plan_local(model, 1, 1, max_model_len=64, max_batch_size=4, devices=f"localhost:{budget}B",
                      kv_cache_memory_fraction=0.5)
    (rank,) = plan.ranks
    assert 160 <= rank.kv_cache_tokens < 160 + 2 and rank.predicted_bytes.total <= rank.usable_bytes
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=[3, 4, 5], max_new_tokens=3),
                                  GenerateRequest(prompt_ids=[7, 8], max_new_tokens=3)])
    result = run_generate(plan, model, task, timeout=180, threads_per_rank=1)
    assert all(len(c.token_ids) == 3 for c in result.completions)
    (entry,) = result.ranks
    assert entry.report is not None
    # the plan's tokens in whole blocks, and the two reserved ones
    assert entry.report.allocated_bytes["kv_cache"] == (-(-rank.kv_cache_tokens // 16) + 2) * 16 * per_token
