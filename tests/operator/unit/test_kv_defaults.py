"""The GPU defaults (issue 28): the KV cache takes 0.9 of what the plan leaves free and
maxBatchSize caps running sequences at 256 (less where that leaves no room: test_row_cap.py),
with what those rows cost counted on every rank (the sampler on the last stage, the captured
decode steps, the block masks over the pool); a CPU keeps
maxBatchSize 1 and its reservation. Tables for the terms, hypothesis for the invariants: with the
defaults every rank's predicted bytes stay below its usable memory, and a group holds at least one
maxModelLen sequence or the plan refuses, saying so."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.sharding import KV_BLOCK_SIZE, batch_buckets, kv_pool_tokens, length_buckets, prefill_rows
from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import Device, Inventory, parse_devices
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.report import render_plan
from shard_operator.planning.sizing import (
    SAMPLER_LOGIT_BYTES,
    Shard,
    activation_bytes,
    kv_token_bytes,
    mask_bytes,
    mask_token_bytes,
    running_bytes,
)

from .test_kvcache import LLAMA_8B, OPTIONS, GiB, small_llamas, spec


# ---------------------------------------------------------------- the defaults (tables)
def test_a_gpu_plan_without_serving_takes_nine_tenths_of_what_is_free_for_256_rows():
    profile = profile_from_config(LLAMA_8B)
    p = plan(profile, spec(model={"maxModelLen": 4096}), parse_devices("a:80GiB:H100"))
    (r,) = p.ranks
    assert p.max_batch_size == 256 and p.kv_cache_memory_fraction is None
    b = r.predicted_bytes
    masks = mask_bytes(4096, 256, kv_pool_tokens(r.kv_cache_tokens), "gpu")
    free = r.usable_bytes - (b.weights + b.activations - masks + b.overhead + b.staging)
    per_token = kv_token_bytes(profile, 1, 32, p.dtype) + mask_token_bytes(4096, 256, "gpu")
    assert 0.9 * free <= b.kv_cache + masks < 0.9 * free + KV_BLOCK_SIZE * per_token  # whole blocks, rounded up
    assert b.total <= r.usable_bytes
    # ~15 GiB of weights, ~7 GiB for 256 rows and the runtime, the rest mostly KV at 128 KiB a token
    assert 350_000 < r.kv_cache_tokens < 450_000
    assert "0.9 of the memory left free (the GPU default)" in render_plan(p)
    assert "up to 256 sequences" in render_plan(p)


def test_a_cpu_plan_keeps_one_row_and_its_reservation():
    profile = profile_from_config({**LLAMA_8B, "num_hidden_layers": 2})
    p = plan(profile, spec(model={"maxModelLen": 1024}), parse_devices("localhost:64GiB", kind="cpu"))
    assert p.max_batch_size == 1 and p.kv_cache_tokens == 1024
    assert "maxBatchSize x maxModelLen (the CPU default)" in render_plan(p)


def test_running_rows_cost_the_sampler_the_graphs_and_the_largest_step():
    """8B, 256 rows at maxModelLen 4096: each term as the docs (planner.md, The KV cache) give it."""
    profile = profile_from_config(LLAMA_8B)
    last = Shard(tp=1, layers=(0, 0), embeds=False, has_lm_head=True)
    middle = Shard(tp=1, layers=(0, 0), embeds=False, has_lm_head=False)
    vocab = 128256
    sampler = 256 * vocab * SAMPLER_LOGIT_BYTES
    graphs = sum(batch_buckets(256)) * len(length_buckets(4096)) * vocab * 4
    assert (sum(batch_buckets(256)), len(length_buckets(4096))) == (511, 5)
    assert running_bytes(profile, last, 4096, 256, kind="cpu") == sampler  # no graphs on a CPU rank
    assert sampler / GiB == pytest.approx(2.35, abs=0.01) and graphs / GiB == pytest.approx(1.22, abs=0.01)
    step = running_bytes(profile, last, 4096, 256) - sampler - graphs
    assert 0 < step < 0.5 * GiB  # the largest step's own: its rows through a layer, their logits, its maps
    # another stage keeps hidden states, not logits, and samples nothing
    assert running_bytes(profile, middle, 4096, 256) < 0.2 * GiB
    assert running_bytes(profile, middle, 4096, 256, kind="cpu") == 0
    # one row costs next to nothing: the cap, not the cache, is what 256 rows pay for
    assert running_bytes(profile, last, 4096, 1) < 0.02 * GiB


def test_the_masks_cost_each_token_a_share_for_every_row():
    # 256 decoding rows and a prefill pass of 16 rows x 4 query blocks, 40 bytes a row per block of 16
    assert prefill_rows(256, 4096, "gpu") == 16
    assert mask_token_bytes(4096, 256, "gpu") == (256 + 16 * 4) * 40 // 16 == 800
    assert mask_token_bytes(4096, 256, "cpu") == 0  # a CPU rank's C kernels read the pool without one
    assert mask_bytes(4096, 256, 1024, "gpu") == 800 * 1024


def test_the_activations_grow_with_the_cap_on_the_last_stage():
    profile = profile_from_config(LLAMA_8B)
    last = Shard(tp=1, layers=(0, 32), embeds=True, has_lm_head=True)
    one, many = (activation_bytes(profile, last, 4096, b, "auto", "gpu") for b in (1, 256))
    assert many - one >= running_bytes(profile, last, 4096, 256) - running_bytes(profile, last, 4096, 1)


def test_a_small_gpu_plans_the_default_with_fewer_rows_and_a_given_256_is_refused_naming_it():
    """An 8B model on a 24 GiB card: its weights fit, 256 rows beside them do not. Left unset, the
    cap is the largest power of two that fits, and the plan says why; given, 256 is refused with
    its cost named and the same cap suggested (checked by planning again)."""
    profile = profile_from_config(LLAMA_8B)
    devices = parse_devices("a:24GiB")
    chosen = plan(profile, spec(model={"maxModelLen": 4096}), devices)
    cap = chosen.max_batch_size
    assert cap in (1, 2, 4, 8, 16, 32, 64, 128) and chosen.max_batch_size_chosen
    (r,) = chosen.ranks
    assert r.kv_cache_tokens >= 4096 and r.predicted_bytes.total <= r.usable_bytes
    assert f"maxBatchSize {cap}, not the GPU default 256 (spec.model.maxBatchSize is unset)" in chosen.reason
    assert f"room for a sequence of 4096 tokens; at {2 * cap} not one group fits" in chosen.reason
    assert chosen.reason in render_plan(chosen)
    with pytest.raises(PlanError):  # the next cap up does not fit: the largest was chosen
        plan(profile, spec(model={"maxModelLen": 4096, "maxBatchSize": 2 * cap}), devices)
    with pytest.raises(PlanError) as err:
        plan(profile, spec(model={"maxModelLen": 4096, "maxBatchSize": 256}), devices)
    assert err.value.reason == "InsufficientCapacity"
    assert "The spec's maxBatchSize 256: its running rows cost a last-stage rank ~" in err.value.message
    assert f"lower maxBatchSize to {cap} (from 256)" in err.value.message
    given = plan(profile, spec(model={"maxModelLen": 4096, "maxBatchSize": cap}), devices)
    assert not given.max_batch_size_chosen and "not the GPU default" not in given.reason
    assert given.ranks[0].predicted_bytes == r.predicted_bytes  # the same plan, given or chosen


# ---------------------------------------------------------------- invariants (hypothesis)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_with_the_defaults_every_rank_fits_and_holds_a_sequence_or_the_plan_says_why(data):
    profile = data.draw(small_llamas())
    kind = data.draw(st.sampled_from(["gpu", "cpu"]))
    devices = [Device(node="n0", index=i, kind=kind, memory_bytes=data.draw(st.integers(128 * 2**20, 8 * GiB)))
               for i in range(data.draw(st.integers(1, 3)))]
    max_len = data.draw(st.sampled_from([256, 1024, 4096]))
    s = spec(model={"maxModelLen": max_len}, placement={"memoryHeadroom": data.draw(st.sampled_from([0.0, 0.1]))})
    try:
        p = plan(profile, s, Inventory(devices=devices), OPTIONS)
    except PlanError as err:
        assert err.reason == "InsufficientCapacity" and "one replica needs" in err.message
        return
    assert p.max_batch_size in ((1, 2, 4, 8, 16, 32, 64, 128, 256) if kind == "gpu" else (1,))
    for r in p.ranks:
        assert r.predicted_bytes.total <= r.usable_bytes
        assert r.kv_cache_tokens >= max_len  # one whole sequence at least
        b = r.predicted_bytes
        masks = mask_bytes(max_len, p.max_batch_size, kv_pool_tokens(r.kv_cache_tokens), kind)
        assert b.activations >= masks + running_bytes(
            profile, Shard(tp=p.tensor_parallel, layers=r.layers, embeds=r.embeds, has_lm_head=r.has_lm_head),
            max_len, p.max_batch_size, p.dtype, kind)
        if kind == "gpu":  # 0.9 of what the rest leaves free, in whole blocks: never a block more
            free = r.usable_bytes - (b.weights + b.activations - masks + b.overhead + b.staging)
            per_token = kv_token_bytes(profile, p.tensor_parallel, r.layers[1] - r.layers[0], p.dtype) \
                + mask_token_bytes(max_len, p.max_batch_size, kind)
            assert b.kv_cache + masks < 0.9 * free + KV_BLOCK_SIZE * per_token
        else:
            assert r.kv_cache_tokens == max_len  # the CPU default: one reserved sequence
