"""The KV cache's capacity from the memory the plan leaves free (spec.serving): tables for the
modes, hypothesis for the invariants (it fits below the headroom, never takes more than its share
of what is free, takes all but one block of it, grows with memory, the smallest rank bounds its
group), and the contract's reading of plans written before the field. The tokens are what the
paged cache gives sequences (whole blocks); the bytes also count its reserved blocks
(tests/worker/test_kv_capacity.py checks the worker gives exactly these)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.plan import Plan
from shard_contract.sharding import KV_BLOCK_SIZE, kv_pool_tokens, kv_sequence_tokens
from shard_operator.api import SpecError, parse_spec
from shard_operator.api.crd import build_crd
from shard_operator.planning import PlanError, PlannerOptions, plan
from shard_operator.planning.inventory import Device, Inventory, parse_devices
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.replan import incompatibility
from shard_operator.planning.report import render_plan
from shard_operator.planning.sizing import kv_token_bytes, mask_bytes, mask_token_bytes

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
GiB = 2**30


def spec(serving=None, **fields):
    model = {"path": "m", **fields.pop("model", {})}
    return parse_spec({"model": model, **({"serving": serving} if serving is not None else {}), **fields})


def masks_of(p: Plan, r) -> int:
    """The block masks a GPU rank's passes build over its pool, counted in its activations."""
    return mask_bytes(p.max_model_len, p.max_batch_size, kv_pool_tokens(r.kv_cache_tokens), r.kind)


def free_of(p: Plan, r) -> int:
    """What the plan leaves free on a rank below its headroom, before the KV cache (and the block
    masks over it)."""
    b = r.predicted_bytes
    return r.usable_bytes - (b.weights + b.activations - masks_of(p, r) + b.overhead + b.staging)


def per_token(profile, p: Plan, r) -> int:
    """One token's keys and values on the rank."""
    return kv_token_bytes(profile, p.tensor_parallel, r.layers[1] - r.layers[0], p.dtype)


def cost_per_token(profile, p: Plan, r) -> int:
    """What a token of KV costs the rank: its keys and values, and its share of the block masks."""
    return per_token(profile, p, r) + mask_token_bytes(p.max_model_len, p.max_batch_size, r.kind)


def takes_its_share(p: Plan, r, fraction: float, cost: int) -> bool:
    """A fraction's cache (and the block masks over it) is that share of what is free in whole
    blocks, rounded up where the free memory holds the block: at least the share, never a block
    more, never more than is free."""
    held, free, block = r.predicted_bytes.kv_cache + masks_of(p, r), free_of(p, r), KV_BLOCK_SIZE * cost
    share = fraction * free
    return held <= free and held < share + block and (held >= share or held + block > free)


# ---------------------------------------------------------------- the modes (tables)
NINE_TENTHS = {"kvCacheMemoryFraction": 0.9}


def test_a_fraction_gives_the_cache_that_share_of_what_the_plan_leaves_free():
    profile = profile_from_config(LLAMA_8B)
    p = plan(profile, spec(model={"maxModelLen": 8192, "maxBatchSize": 256}, serving=NINE_TENTHS),
             parse_devices("a:80GiB:H100"))
    (r,) = p.ranks
    assert p.max_batch_size == 256  # a cap on running sequences, not a reservation
    # the tokens sequences get (whole blocks); the bytes also hold the pool's reserved blocks
    assert takes_its_share(p, r, 0.9, cost_per_token(profile, p, r))
    assert r.kv_cache_tokens % KV_BLOCK_SIZE == 0
    assert r.predicted_bytes.kv_cache == kv_pool_tokens(r.kv_cache_tokens) * per_token(profile, p, r)
    assert r.predicted_bytes.total <= r.usable_bytes
    # An 8B model in bfloat16 on an 80 GiB H100: ~15 GiB weights, the rest mostly KV at 128 KiB a token.
    assert 300_000 < r.kv_cache_tokens < 500_000
    assert p.kv_cache_tokens == p.group_kv_cache_tokens(0) == r.kv_cache_tokens


def test_a_cpu_reserves_max_batch_size_sequences_unless_the_spec_gives_a_fraction():
    profile = profile_from_config({**LLAMA_8B, "num_hidden_layers": 2})
    cpu = parse_devices("localhost:64GiB", kind="cpu")
    reserved = plan(profile, spec(model={"maxModelLen": 1024, "maxBatchSize": 3}), cpu)
    assert reserved.max_batch_size == 3 and reserved.kv_cache_tokens == 3 * 1024
    assert plan(profile, spec(model={"maxModelLen": 1024}), cpu).kv_cache_tokens == 1024  # CPU default: 1
    half = plan(profile, spec(model={"maxModelLen": 1024}, serving={"kvCacheMemoryFraction": 0.5}), cpu)
    (r,) = half.ranks
    assert takes_its_share(half, r, 0.5, cost_per_token(profile, half, r))
    assert r.kv_cache_tokens > 1000 * 1024  # 64 GiB of host budget, 16 KiB a token at 2 layers
    assert half.max_batch_size == 1


def test_a_quantity_is_the_bytes_of_every_rank_and_must_fit():
    profile = profile_from_config(LLAMA_8B)
    p = plan(profile, spec(model={"maxModelLen": 8192}, serving={"kvCacheMemory": "20Gi"},
                           parallelism={"tensor": 2, "pipeline": 1}), parse_devices("a:80GiB*2:H100"))
    for r in p.ranks:
        assert r.kv_cache_tokens == kv_sequence_tokens(20 * GiB // cost_per_token(profile, p, r))
        assert r.predicted_bytes.kv_cache + masks_of(p, r) <= 20 * GiB
    with pytest.raises(PlanError) as err:
        plan(profile, spec(model={"maxModelLen": 8192}, serving={"kvCacheMemory": "70Gi"},
                           parallelism={"tensor": 1, "pipeline": 1}), parse_devices("a:80GiB:H100"))
    assert err.value.reason == "InsufficientCapacity"
    assert "kvCacheMemory" in err.value.message


def test_the_local_plan_takes_a_quantity_as_the_spec_does(hf_checkpoint):
    """`plan_local` (shardctl's and the benches' plan) passes kvCacheMemory through: a quantity of
    exactly N tokens' pool gives N tokens (bench/serve_peer.py sizes its overflow group so)."""
    from pydantic import ValidationError

    from shard_operator.local.launcher import plan_local

    model, _ = hf_checkpoint()
    roomy = plan_local(model, 1, 1, max_model_len=64, max_batch_size=4, devices="localhost:1GiB",
                       kv_cache_memory_fraction=0.5)
    (r,) = roomy.ranks
    token_bytes = r.predicted_bytes.kv_cache // kv_pool_tokens(r.kv_cache_tokens)
    for tokens in (64, 160, 1024):
        p = plan_local(model, 1, 1, max_model_len=64, max_batch_size=4, devices="localhost:1GiB",
                       kv_cache_memory=f"{kv_pool_tokens(tokens) * token_bytes}B")
        assert p.kv_cache_memory == kv_pool_tokens(tokens) * token_bytes and p.kv_cache_memory_fraction is None
        assert p.kv_cache_tokens == tokens
        assert p.ranks[0].predicted_bytes.kv_cache == kv_pool_tokens(tokens) * token_bytes
    with pytest.raises(ValidationError, match="at most one of"):
        plan_local(model, 1, 1, max_model_len=64, devices="localhost:1GiB", kv_cache_memory_fraction=0.5,
                   kv_cache_memory="1MiB")


def test_a_layout_fits_only_with_room_for_one_whole_sequence():
    """vLLM refuses to start when its cache holds less than maxModelLen tokens; the planner takes
    more devices instead (here a second) or says it does not fit."""
    profile = profile_from_config(LLAMA_8B)
    # one sequence of 131072 tokens is 16 GiB of KV: not beside 15 GiB of weights on a 24 GiB card
    # (one running row: 256 would add their prefill pass and decode steps at that length)
    one = {"maxModelLen": 131072, "maxBatchSize": 1}
    p = plan(profile, spec(model=one, serving=NINE_TENTHS), parse_devices("a:24GiB*2"))
    assert p.world_size == 2 and p.kv_cache_tokens >= 131072
    with pytest.raises(PlanError):
        plan(profile, spec(model=one, serving=NINE_TENTHS), parse_devices("a:24GiB"))


def test_two_small_gpus_are_not_one_big_one():
    """The group holds what its smallest rank holds: a stage on a small card bounds the stage on
    a big one, and the big one's prediction is what it holds, not what it could."""
    profile = profile_from_config(LLAMA_8B)
    p = plan(profile, spec(model={"maxModelLen": 4096}, parallelism={"tensor": 1, "pipeline": 2},
                           serving={"kvCacheMemoryFraction": 1.0}),
             parse_devices("a:80GiB:H100,b:24GiB:L4"))
    tokens = [kv_sequence_tokens(int(free_of(p, r)) // cost_per_token(profile, p, r)) for r in p.ranks]
    assert len(set(tokens)) == 2
    assert all(r.kv_cache_tokens == min(tokens) for r in p.ranks)
    assert all(r.predicted_bytes.kv_cache == kv_pool_tokens(min(tokens)) * per_token(profile, p, r) for r in p.ranks)


def test_groups_on_devices_of_different_sizes_hold_different_tokens():
    profile = profile_from_config({**LLAMA_8B, "num_hidden_layers": 4})
    p = plan(profile, spec(model={"maxModelLen": 4096}, replicas=2, parallelism={"tensor": 1, "pipeline": 1},
                           serving=NINE_TENTHS), parse_devices("a:80GiB:H100,b:40GiB:A100"))
    held = {g.replica: p.group_kv_cache_tokens(g.replica) for g in p.groups}
    assert len(set(held.values())) == 2 and p.kv_cache_tokens == min(held.values())
    text = render_plan(p)
    assert f"KV cache {min(held.values())} to {max(held.values())} tokens per group" in text
    assert "kvCacheMemoryFraction 0.9 of the memory left free" in text


def test_a_changed_fraction_is_planned_again():
    profile = profile_from_config(LLAMA_8B)
    devices = parse_devices("a:80GiB:H100")
    p = plan(profile, spec(serving={"kvCacheMemoryFraction": 0.5}), devices)
    assert incompatibility(p, profile, spec(serving={"kvCacheMemoryFraction": 0.5})) is None
    assert incompatibility(p, profile, spec(serving={"kvCacheMemoryFraction": 0.8})) == \
        "serving.kvCacheMemoryFraction changed from 0.5 to 0.8"
    assert incompatibility(p, profile, spec()) == "serving.kvCacheMemoryFraction changed from 0.5 to None"
    assert plan(profile, spec(serving={"kvCacheMemoryFraction": 0.8}), devices).hash != p.hash


@pytest.mark.parametrize("serving, message", [
    ({"kvCacheMemoryFraction": 0}, "spec.serving.kvCacheMemoryFraction: should be greater than 0"),
    ({"kvCacheMemoryFraction": 1.5}, "spec.serving.kvCacheMemoryFraction: should be less than or equal to 1"),
    ({"kvCacheMemory": "20"}, "spec.serving.kvCacheMemory: '20' has no unit"),
    ({"kvCacheMemory": "0Gi"}, "spec.serving.kvCacheMemory: must be a positive quantity"),
    ({"kvCacheMemoryFraction": 0.5, "kvCacheMemory": "1Gi"},
     "spec.serving: give at most one of kvCacheMemoryFraction and kvCacheMemory"),
    ({"kvCacheFraction": 0.5}, "spec.serving.kvCacheFraction: unknown field (did you mean kvCacheMemoryFraction?)"),
])
def test_the_serving_fields_are_checked(serving, message):
    with pytest.raises(SpecError) as err:
        spec(serving=serving)
    assert message in str(err.value)


def test_the_crd_carries_the_serving_bounds_and_rule():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    serving = schema["serving"]
    fraction = serving["properties"]["kvCacheMemoryFraction"]
    assert (fraction["exclusiveMinimum"], fraction["maximum"]) == (True, 1.0)
    assert serving["x-kubernetes-validations"][0]["rule"] == \
        "!(has(self.kvCacheMemoryFraction) && has(self.kvCacheMemory))"
    assert "default" not in schema["model"]["properties"]["maxBatchSize"]  # resolved by the device kind


# ---------------------------------------------------------------- plans written before the field
def test_a_plan_without_kv_tokens_reads_as_the_reservation_and_keeps_its_hash():
    profile = profile_from_config({**LLAMA_8B, "num_hidden_layers": 2})
    p = plan(profile, spec(model={"maxModelLen": 1024, "maxBatchSize": 2}),
             parse_devices("localhost:64GiB*2", kind="cpu"))
    data = json.loads(p.to_json())
    for r in data["ranks"]:
        del r["kv_cache_tokens"]
    for key in ("kv_cache_memory_fraction", "kv_cache_memory"):
        del data[key]
    old = Plan.model_validate(data)
    assert [r.kv_cache_tokens for r in old.ranks] == [2 * 1024] * 2
    assert old.hash == p.hash == data["hash"]


# ---------------------------------------------------------------- invariants (hypothesis)
OPTIONS = PlannerOptions(runtime_overhead={"gpu": 64 * 2**20, "cpu": 64 * 2**20})


@st.composite
def small_llamas(draw):
    heads = draw(st.sampled_from([4, 8]))
    return profile_from_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": heads * 64, "intermediate_size": heads * 160,
        "num_hidden_layers": draw(st.integers(2, 8)), "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
        "vocab_size": draw(st.sampled_from([1000, 32000])), "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16"})


@st.composite
def pools(draw, kind="gpu"):
    devices = [Device(node="n0", index=i, kind=kind, memory_bytes=draw(st.integers(256 * 2**20, 4 * GiB)))
               for i in range(draw(st.integers(1, 3)))]
    return Inventory(devices=devices)


def _try(profile, s, inventory):
    try:
        return plan(profile, s, inventory, OPTIONS)
    except PlanError:
        return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_cache_fits_below_the_headroom_and_takes_its_share_of_what_is_free(data):
    profile = data.draw(small_llamas())
    inventory = data.draw(pools(kind=data.draw(st.sampled_from(["gpu", "cpu"]))))
    fraction = data.draw(st.floats(0.05, 1.0))
    headroom = data.draw(st.sampled_from([0.0, 0.1, 0.3]))
    max_len = data.draw(st.sampled_from([256, 1024, 4096]))
    s = spec(model={"maxModelLen": max_len, "maxBatchSize": data.draw(st.integers(1, 64))},
             placement={"memoryHeadroom": headroom}, serving={"kvCacheMemoryFraction": fraction})
    p = _try(profile, s, inventory)
    if p is None:
        return
    for g in p.groups:
        group = p.group(g.replica)
        assert len({r.kv_cache_tokens for r in group}) == 1
        assert group[0].kv_cache_tokens >= max_len  # one whole sequence at least
        for r in group:
            assert r.predicted_bytes.total <= r.usable_bytes  # fits with headroom
            block = KV_BLOCK_SIZE * cost_per_token(profile, p, r)  # never a block past its share
            assert r.predicted_bytes.kv_cache + masks_of(p, r) < fraction * free_of(p, r) + block
        # the most constrained rank takes its share (whole blocks, the reserved ones counted, rounded
        # up where it has room), and sequences get whole blocks
        assert any(takes_its_share(p, r, fraction, cost_per_token(profile, p, r)) for r in group)
        assert group[0].kv_cache_tokens % KV_BLOCK_SIZE == 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_capacity_grows_with_memory(data):
    """Same layout on larger devices: never fewer tokens (monotone in memory)."""
    profile = data.draw(small_llamas())
    n = data.draw(st.integers(1, 2))
    memory = data.draw(st.integers(512 * 2**20, 4 * GiB))
    more = data.draw(st.integers(0, 4 * GiB))
    fraction = data.draw(st.sampled_from([0.5, 0.9, 1.0]))
    s = spec(model={"maxModelLen": 512, "maxBatchSize": 8}, parallelism={"tensor": 1, "pipeline": n},
             serving={"kvCacheMemoryFraction": fraction})
    small = _try(profile, s, Inventory(devices=[Device(node="n", index=i, memory_bytes=memory) for i in range(n)]))
    large = _try(profile, s, Inventory(devices=[Device(node="n", index=i, memory_bytes=memory + more)
                                                for i in range(n)]))
    if small is None:
        return
    assert large is not None
    if [s_.layers for s_ in small.stages] == [s_.layers for s_ in large.stages]:
        assert large.kv_cache_tokens >= small.kv_cache_tokens


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_quantity_is_never_exceeded_and_fits_below_the_headroom(data):
    profile = data.draw(small_llamas())
    inventory = data.draw(pools())
    quantity = data.draw(st.integers(1, 2048)) * 2**20
    max_len = data.draw(st.sampled_from([256, 1024]))
    s = spec(model={"maxModelLen": max_len}, serving={"kvCacheMemory": f"{quantity // 2**20}Mi"})
    p = _try(profile, s, inventory)
    if p is None:
        return
    for r in p.ranks:
        assert max_len <= r.kv_cache_tokens == p.group_kv_cache_tokens(r.replica)
        assert r.predicted_bytes.kv_cache + masks_of(p, r) <= quantity
        assert r.predicted_bytes.total <= r.usable_bytes
    # the most constrained rank of each group holds all but less than a block of the quantity
    for g in p.groups:
        assert min(quantity - r.predicted_bytes.kv_cache - masks_of(p, r)
                   - KV_BLOCK_SIZE * cost_per_token(profile, p, r) for r in p.group(g.replica)) < 0
