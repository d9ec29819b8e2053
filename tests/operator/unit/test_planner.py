"""The planner: tables for the decisions, hypothesis for the invariants, exhaustive search for
completeness on small cases."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.sharding import kv_pool_tokens, kv_whole_blocks, valid_tensor_degrees
from shard_operator.api import DEFAULT_GPU_FRACTION, parse_spec
from shard_operator.planning import PlanError, PlannerOptions, places, plan, shortfall
from shard_operator.planning.inventory import Device, Inventory, parse_devices
from shard_operator.planning.profile import ModelProfile, profile_from_config
from shard_operator.planning.replan import choose_plan
from shard_operator.planning.sizing import (
    Shard,
    activation_bytes,
    kv_token_bytes,
    mask_bytes,
    weight_bytes,
)
from shard_operator.planning.step import StepOverhead

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
LLAMA_8B = {**LLAMA_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32}


def spec(**fields):
    return parse_spec({"model": {"path": "m", **fields.pop("model", {})}, **fields})


def layer_ranges(result, replica=0):
    return [s.layers for s in result.groups[replica].stages]


# ---------------------------------------------------------------- decisions (tables)
@pytest.mark.parametrize("config, devices, fields, tp, pp", [
    # 70B in bf16 (131 GiB) fits 8 x 80 GiB with TP inside the node: the fastest layout.
    (LLAMA_70B, "a:80GiB*8:H100", {}, 8, 1),
    # Two nodes of four: TP stays in a node, so 4 x 2 stages across nodes.
    (LLAMA_70B, "a:32GiB*4,b:32GiB*4", {}, 4, 2),
    # Given degrees are honoured when they fit.
    (LLAMA_70B, "a:80GiB*8", {"parallelism": {"tensor": 4, "pipeline": 2}}, 4, 2),
    # An 8B model fits one 24 GiB device.
    (LLAMA_8B, "a:24GiB", {}, 1, 1),
    # ... but not at maxModelLen 131072 (one sequence is 16 GiB of KV, and the cache takes 0.9 of
    # what is free): it takes more devices, tensor-parallel in one node.
    (LLAMA_8B, "a:24GiB*4,b:24GiB*4", {"model": {"maxModelLen": 131072, "maxBatchSize": 4}}, 4, 1),
])
def test_chosen_layout(config, devices, fields, tp, pp):
    result = plan(profile_from_config(config), spec(**fields), parse_devices(devices))
    assert (result.tensor_parallel, result.pipeline_parallel) == (tp, pp)
    assert result.reason


def test_fewer_devices_win_within_the_tolerance():
    profile = profile_from_config(LLAMA_8B)
    # On H100s TP=2 is ~30% faster than TP=1 (its all-reduces eat part of the gain).
    pool = parse_devices("a:80GiB*2:H100")
    assert plan(profile, spec(), pool, PlannerOptions(tolerance=0.1)).world_size == 2
    relaxed = plan(profile, spec(), pool, PlannerOptions(tolerance=0.5))
    assert relaxed.world_size == 1 and "with fewer devices" in relaxed.reason


def test_heterogeneous_devices_get_layers_by_speed_and_memory():
    profile = profile_from_config(LLAMA_8B)
    # One device twice as big and twice as fast as each of the others; one running row, so that
    # the stages differ by their layers (the last stage's rows cost it more: test_kv_defaults.py).
    result = plan(profile, spec(model={"maxBatchSize": 1}, parallelism={"tensor": 1},
                                placement={"memoryHeadroom": 0.05}),
                  parse_devices("big:14GiB@2,small1:7GiB@1,small2:7GiB@1"))
    counts = {r.node: r.num_layers for r in result.ranks}
    assert sum(counts.values()) == 32
    assert 1.6 <= counts["big"] / counts["small1"] <= 2.5
    assert 1.6 <= counts["big"] / counts["small2"] <= 2.5


def test_capacity_ordered_layer_counts():
    profile = profile_from_config(LLAMA_70B)
    devices = parse_devices("a:80GiB@2,b:40GiB@1,c:60GiB@1.5,d:20GiB@0.5")
    result = plan(profile, spec(parallelism={"tensor": 1}, placement={"memoryHeadroom": 0.0}), devices)
    by_capacity = sorted(result.ranks, key=lambda r: -r.capacity_bytes)
    counts = [r.num_layers for r in by_capacity]
    assert counts == sorted(counts, reverse=True), counts
    assert counts[0] > counts[-1]


def test_replicas_use_disjoint_devices_and_spread_over_nodes():
    profile = profile_from_config(LLAMA_8B)
    result = plan(profile, spec(replicas=3, parallelism={"tensor": 2, "pipeline": 1}),
                  parse_devices("a:24GiB*4,b:24GiB*2,c:24GiB*2"))
    devices = [(r.node, r.device) for r in result.ranks]
    assert len(devices) == len(set(devices)) == 6
    assert {r.node for r in result.group(0)} != {r.node for r in result.group(1)} or \
        {r.node for r in result.group(1)} != {r.node for r in result.group(2)}
    assert sorted({r.node for r in result.ranks}) == ["a", "b", "c"]


def test_zero_replicas_plans_no_ranks():
    result = plan(profile_from_config(LLAMA_8B), spec(replicas=0), parse_devices("a:24GiB"))
    assert result.ranks == [] and result.groups == [] and result.tensor_parallel == 1


def test_a_capacity_message_leads_with_the_cause_and_tells_a_gap_that_gib_rounds_away():
    """Issue 26: int8 asked of a model that streams; devices a fraction of a MiB too small."""
    from tests.operator.conftest import make_spec, tiny_profile
    streaming_int8 = make_spec(model={"quantization": "int8"}, placement={"offload": {"policy": "auto"}})
    with pytest.raises(PlanError) as err:
        plan(tiny_profile(), streaming_int8, parse_devices("a:2845MiB*2"))
    first, second, third, *_ = err.value.message.splitlines()
    assert first.startswith("tiny does not fit: placement.offload.policy auto cannot stream int8 weights")
    assert second.startswith("Without streaming, at tensor=2 x pipeline=1") and second.endswith(
        "the most loaded rank needs 2561.6 MiB; the largest device offers 2560.5 MiB usable (1.1 MiB short).")
    assert "(0.3 MiB of int8 (float32 activations) weights and 0.3 MiB of KV cache" in third
    assert third.endswith("the pool has 5121.0 MiB usable (2 x 2.8 GiB (gpu) on a, 10% headroom): 2.2 MiB short.")
    assert err.value.message.count("cannot stream int8") == 1  # said once


def test_explicit_partition_is_checked_not_trusted():
    profile = profile_from_config(LLAMA_70B)
    ok = plan(profile, spec(parallelism={"tensor": 4, "pipeline": 2, "layerPartition": [44, 36]}),
              parse_devices("a:48GiB*4,b:48GiB*4"))
    assert layer_ranges(ok) == [(0, 44), (44, 80)]
    with pytest.raises(PlanError, match=r"layerPartition \[40, 41\] places 81 layers; the model has 80"):
        plan(profile, spec(parallelism={"pipeline": 2, "layerPartition": [40, 41]}), parse_devices("a:48GiB*8"))
    with pytest.raises(PlanError) as err:  # 70 layers on one 4 x 32 GiB stage cannot fit
        plan(profile, spec(parallelism={"tensor": 4, "pipeline": 2, "layerPartition": [70, 10]}),
             parse_devices("a:32GiB*4,b:32GiB*4"))
    assert err.value.reason == "InsufficientCapacity"
    assert str(err.value).startswith("model does not fit: at tensor=4 x pipeline=2 (layerPartition [70, 10]) the "
                                     "most loaded rank needs 31.28 GiB; the largest device offers 28.80 GiB usable "
                                     "(2.48 GiB short).")  # one running row's sampler, decode graphs and masks
    assert "drop layerPartition" in str(err.value)


@pytest.mark.parametrize("parallelism, match", [
    ({"tensor": 3}, r"tensor=3 does not divide the 64 attention heads; valid: 1, 2, 4, 8"),
    ({"tensor": 16}, r"tensor=16 needs 16 devices on one node; the largest node in the pool has 8"),
    ({"pipeline": 81}, r"pipeline=81 exceeds the 80 decoder layers"),
])
def test_invalid_parallelism_is_explained(parallelism, match):
    with pytest.raises(PlanError, match=match):
        plan(profile_from_config(LLAMA_70B), spec(parallelism=parallelism), parse_devices("a:80GiB*8"))


TWELVE_HEADS = {**LLAMA_8B, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 8,
                "num_attention_heads": 12, "num_key_value_heads": 12}


@pytest.mark.parametrize("pool", ["", "a:80GiB*8"])  # "": every GPU held by another model
@pytest.mark.parametrize("parallelism, message", [
    ({"tensor": 5},
     "spec.parallelism.tensor: tensor=5 does not divide the 12 attention heads; valid: 1, 2, 3, 4, 6, 12"),
    ({"tensor": 8},
     "spec.parallelism.tensor: tensor=8 does not divide the 12 attention heads; valid: 1, 2, 3, 4, 6, 12"),
    ({"pipeline": 100}, "spec.parallelism.pipeline=100 exceeds the 8 decoder layers; valid: 1 to 8"),
    ({"layerPartition": [4, 5]}, "spec.parallelism.layerPartition [4, 5] places 9 layers; the model has 8"),
])
def test_parallelism_no_pool_can_run_is_named_before_devices_are_considered(pool, parallelism, message):
    inventory = parse_devices(pool) if pool else Inventory()
    with pytest.raises(PlanError) as err:
        plan(profile_from_config(TWELVE_HEADS), spec(parallelism=parallelism), inventory)
    assert (err.value.reason, str(err.value)) == ("InvalidParallelism", message)


def test_kv_heads_fewer_than_tp_are_replicated():
    profile = profile_from_config({**LLAMA_8B, "num_key_value_heads": 2})
    result = plan(profile, spec(parallelism={"tensor": 8, "pipeline": 1}), parse_devices("a:80GiB*8"))
    rank = result.ranks[0]
    # 8 ranks share 2 KV heads: each rank holds one whole head (a replica), not a quarter of one.
    one_head = 2 * 32 * 128 * 2  # K+V x layers x head_dim x bf16, a token
    assert rank.predicted_bytes.kv_cache == one_head * kv_pool_tokens(rank.kv_cache_tokens)  # (and 2 reserved blocks)


def test_int8_counts_a_byte_a_weight_plus_a_scale_a_row():
    """TP=2 over Llama-3-8B: the arithmetic written out from the shapes, independent of sizing.py."""
    profile = profile_from_config(LLAMA_8B)
    result = plan(profile, spec(model={"quantization": "int8"}, parallelism={"tensor": 2, "pipeline": 1}),
                  parse_devices("a:80GiB*2"))
    assert result.quantization == "int8"
    h, inter, kv, vocab, layers = 4096, 14336, 8 * 128, 128256, 32
    column = (h * h + 2 * inter * h) // 2 + 2 * kv * h // 2  # q, gate, up and k, v: half the rows
    row = (h * h + h * inter) // 2  # o, down: half the columns
    scales = 4 * ((h + 2 * inter + 2 * kv) // 2 + 2 * h)  # float32; o and down keep every row's
    norms = 2 * h * 2  # bfloat16
    vocab_part = vocab // 2 * h * 2  # embeddings and LM head stay bfloat16
    expected = layers * (column + row + scales + norms) + 2 * vocab_part + h * 2
    assert [r.predicted_bytes.weights for r in result.ranks] == [expected, expected]
    bf16 = plan(profile, spec(parallelism={"tensor": 2, "pipeline": 1}), parse_devices("a:80GiB*2"))
    assert bf16.quantization == "none" and bf16.ranks[0].predicted_bytes.weights > 1.8 * expected - 2 * vocab_part
    assert result.group_hash(0) != bf16.group_hash(0)  # other weights: other pods
    # on a GPU no faster decode estimate until a device measures int8's gain (planning/step.py) ...
    assert result.groups[0].critical_path_seconds == pytest.approx(bf16.groups[0].critical_path_seconds)
    measured = PlannerOptions(step=StepOverhead(int8_speedup={"gpu": 1.5, "cpu": 2.0}))
    faster = plan(profile, spec(model={"quantization": "int8"}, parallelism={"tensor": 2, "pipeline": 1}),
                  parse_devices("a:80GiB*2"), measured)
    assert faster.groups[0].critical_path_seconds < bf16.groups[0].critical_path_seconds
    # ... while a CPU rank's kernels read int8 at its byte rate: fewer bytes, a faster step
    cpus = parse_devices("a:80GiB*2@0.015", kind="cpu")
    int8_cpu, bf16_cpu = (plan(profile, spec(model={"quantization": q}, parallelism={"tensor": 2, "pipeline": 1}),
                               cpus) for q in ("int8", "none"))
    assert int8_cpu.groups[0].critical_path_seconds < 0.6 * bf16_cpu.groups[0].critical_path_seconds


def test_infeasible_says_what_is_needed_and_what_would_help():
    profile = profile_from_config({**LLAMA_70B, "torch_dtype": "float32"})
    with pytest.raises(PlanError) as err:
        plan(profile, spec(parallelism={"tensor": 2}), parse_devices("a:24GiB*4,b:24GiB*2"))
    message = str(err.value)
    assert err.value.reason == "InsufficientCapacity"
    assert "does not fit: one replica needs at least" in message
    assert "262.83 GiB of float32 weights" in message
    assert "the pool has 129.60 GiB usable (6 x 24.0 GiB (gpu) on 2 nodes, 10% headroom)" in message
    # bfloat16 alone would not fit (131.42 GiB of weights), int8 would:
    # per layer 855,638,016 projection weights at 1 byte + 83,968 rows x 4-byte scales + 2 float32
    # norms of 8192; x 80 layers, + float32 embeddings, LM head (2 x 128256 x 8192) and final norm
    assert "To make it fit (each checked by planning again): add 3 more nodes like a (4 x 24.0 GiB (gpu) each); " \
        "or set quantization: int8 (weights 71.61 GiB)." in message
    assert [s.text for s in err.value.suggestions] == message.split("planning again): ")[1].split("\n")[0] \
        .removesuffix(".").split("; or ")


def test_no_devices_reports_the_skipped_nodes():
    with pytest.raises(PlanError, match=r"no usable devices in the node pool \(n1: cordoned\)") as err:
        from shard_operator.planning.inventory import SkippedNode
        plan(profile_from_config(LLAMA_8B), spec(), Inventory(skipped=[SkippedNode(node="n1", reason="cordoned")]))
    assert err.value.reason == "NoDevices"


def test_plan_round_trips_through_json():
    from shard_contract.plan import Plan
    result = plan(profile_from_config(LLAMA_70B), spec(replicas=2), parse_devices("a:80GiB*8,b:80GiB*8"))
    again = Plan.from_json(result.to_json())
    assert again == result and again.hash == result.hash
    assert again.group_hash(0) != again.group_hash(1)


# ---------------------------------------------------------------- invariants (hypothesis)
OPTIONS = PlannerOptions(runtime_overhead={"gpu": 4096, "cpu": 4096})


@st.composite
def small_profiles(draw) -> ModelProfile:
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    head_dim = draw(st.sampled_from([8, 16]))
    config = {"architectures": [draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM"]))],
              "hidden_size": heads * head_dim, "intermediate_size": draw(st.sampled_from([32, 48, 64])),
              "num_hidden_layers": draw(st.integers(1, 5)), "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": draw(st.sampled_from([40, 64, 100])),
              "max_position_embeddings": 64, "tie_word_embeddings": draw(st.booleans()),
              "torch_dtype": "float32"}
    return profile_from_config(config)


def _rank_rest(profile: ModelProfile, tp: int, layers: tuple[int, int], first: bool, last: bool,
               max_len: int) -> int:
    """A rank's bytes but its KV cache (and the block masks over it), one running row."""
    shard = Shard(tp=tp, layers=layers, embeds=first, has_lm_head=last)
    return weight_bytes(profile, shard) + activation_bytes(profile, shard, max_len, 1) + OPTIONS.runtime_overhead["gpu"]


def _rank_total(profile: ModelProfile, tp: int, layers: tuple[int, int], first: bool, last: bool,
                max_len: int) -> int:
    """What a rank needs to fit: the rest, and a cache whose share of what is free (the GPU
    default, 0.9) holds one whole sequence, with the block masks over it."""
    fit = math.ceil(kv_pool_tokens(kv_whole_blocks(max_len)) / DEFAULT_GPU_FRACTION)
    return _rank_rest(profile, tp, layers, first, last, max_len) \
        + kv_token_bytes(profile, tp, layers[1] - layers[0]) * fit + mask_bytes(max_len, 1, fit)


@st.composite
def pools(draw, profile: ModelProfile, largest: float = 1.2) -> Inventory:
    """Up to 4 devices on up to 3 nodes, each from a quarter of the whole model to `largest` x it."""
    whole = _rank_total(profile, 1, (0, profile.shape.num_layers), True, True, 16)
    devices = []
    for node in range(draw(st.integers(1, 3))):
        for index in range(draw(st.integers(1, 2))):
            memory = draw(st.integers(max(whole // 4, 1), int(whole * largest)))
            speed = draw(st.sampled_from([0.5, 1.0, 2.0]))
            devices.append(Device(node=f"n{node}", index=index, memory_bytes=memory, speed=speed))
    return Inventory(devices=devices[:4])


def small_spec(tensor="auto", pipeline="auto", replicas=1):
    return spec(model={"maxModelLen": 16, "maxBatchSize": 1}, parallelism={"tensor": tensor, "pipeline": pipeline},
                replicas=replicas, placement={"memoryHeadroom": 0.0})


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield [b - a for a, b in zip((0, *cuts), (*cuts, total), strict=False)]


def exhaustive_fits(profile: ModelProfile, inventory: Inventory, tensor="auto", pipeline="auto") -> bool:
    """Any TP group on one node, any stage order, any layer split: does something fit?"""
    per_node: dict[str, list[Device]] = {}
    for d in inventory.devices:
        per_node.setdefault(d.node, []).append(d)
    if not per_node:
        return False
    widest = max(len(v) for v in per_node.values())
    for tp in valid_tensor_degrees(profile.shape, widest):
        if tensor != "auto" and tp != tensor:
            continue
        groups = [c for devs in per_node.values() for c in itertools.combinations(devs, tp)]
        for pp in range(1, min(profile.shape.num_layers, len(groups)) + 1):
            if pipeline != "auto" and pp != pipeline:
                continue
            for chain in itertools.permutations(groups, pp):
                if len({d.key for g in chain for d in g}) != tp * pp:
                    continue
                for counts in _compositions(profile.shape.num_layers, pp):
                    starts = list(itertools.accumulate([0, *counts]))
                    if all(_rank_total(profile, tp, (starts[s], starts[s + 1]), s == 0, s == pp - 1, 16)
                           <= d.memory_bytes for s, g in enumerate(chain) for d in g):
                        return True
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_planner_finds_a_layout_whenever_exhaustive_search_does(data):
    profile = data.draw(small_profiles())
    inventory = data.draw(pools(profile))
    tensor = data.draw(st.sampled_from(["auto", "auto", 2]))
    expected = exhaustive_fits(profile, inventory, tensor)
    try:
        plan(profile, small_spec(tensor=tensor), inventory, OPTIONS)
        found = True
    except PlanError as err:
        assert err.reason in ("InsufficientCapacity", "InvalidParallelism"), err
        found = False
    assert found == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_plan_places_each_layer_once_in_order_and_fits(data):
    profile = data.draw(small_profiles())
    inventory = data.draw(pools(profile))
    replicas = data.draw(st.integers(1, 2))
    tensor = data.draw(st.sampled_from(["auto", 1, 2]))
    try:
        result = plan(profile, small_spec(tensor=tensor, replicas=replicas), inventory, OPTIONS)
    except PlanError:
        return
    tp, pp = result.tensor_parallel, result.pipeline_parallel
    assert result.replicas == replicas and 1 <= len(result.groups) <= replicas
    assert [g.replica for g in result.groups] == list(range(len(result.groups)))
    assert len(result.ranks) == len(result.groups) * tp * pp
    for group in result.groups:
        ranges = [s.layers for s in group.stages]
        assert ranges[0][0] == 0 and ranges[-1][1] == profile.shape.num_layers
        assert all(a[1] == b[0] and a[0] < a[1]
                   for a, b in zip(ranges, ranges[1:] + [(ranges[-1][1], None)], strict=True))
        ranks = result.group(group.replica)
        assert sorted(r.rank for r in ranks) == list(range(tp * pp))
        for r in ranks:
            assert r.rank == r.stage * tp + r.tp_rank
            assert r.layers == ranges[r.stage]
            assert r.embeds == (r.stage == 0) and r.has_lm_head == (r.stage == pp - 1)
            assert r.predicted_bytes.total <= r.usable_bytes
            b = r.predicted_bytes
            masks = mask_bytes(16, 1, kv_pool_tokens(r.kv_cache_tokens))
            assert b.total - b.kv_cache - masks == _rank_rest(profile, tp, r.layers, r.embeds, r.has_lm_head, 16)
            assert r.kv_cache_tokens >= 16
        for stage in range(pp):
            assert len({r.node for r in ranks if r.stage == stage}) == 1  # a TP group is one node
    used = [(r.node, r.device_index) for r in result.ranks]
    assert len(used) == len(set(used))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_plans_are_deterministic(data):
    profile = data.draw(small_profiles())
    inventory = data.draw(pools(profile))
    shuffled = list(inventory.devices)
    random.Random(data.draw(st.integers(0, 99))).shuffle(shuffled)
    try:
        first = plan(profile, small_spec(), inventory, OPTIONS)
    except PlanError as err:
        with pytest.raises(PlanError) as again:
            plan(profile, small_spec(), Inventory(devices=shuffled), OPTIONS)
        assert str(again.value) == str(err)
        return
    assert plan(profile, small_spec(), Inventory(devices=shuffled), OPTIONS) == first


def _planned_groups(profile: ModelProfile, inventory: Inventory, replicas: int) -> int:
    try:
        return len(plan(profile, small_spec(replicas=replicas), inventory, OPTIONS).groups)
    except PlanError:
        return 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_as_many_groups_as_fit_are_planned(data):
    profile = data.draw(small_profiles())
    inventory = data.draw(pools(profile, largest=2.0))
    wanted = data.draw(st.integers(1, 4))
    # The reference: the largest k for which planning k replicas places every one of them.
    fit = max((k for k in range(1, wanted + 1) if _planned_groups(profile, inventory, k) == k), default=0)
    assert _planned_groups(profile, inventory, wanted) == fit
    if not fit:
        return
    result = plan(profile, small_spec(replicas=wanted), inventory, OPTIONS)
    used = {(r.node, r.device_index) for r in result.ranks}
    left = Inventory(devices=[d for d in inventory.devices if (d.node, d.index) not in used])
    # ... and no further group of the same degrees fits on the devices left (any split, any order).
    missing = shortfall(result, profile, small_spec(replicas=wanted), inventory, OPTIONS)
    if fit < wanted:
        assert not exhaustive_fits(profile, left, result.tensor_parallel, result.pipeline_parallel)
        assert missing.message.startswith(f"{wanted} replicas wanted, {fit} fit")
    else:
        assert missing is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scaling_history_does_not_change_how_many_groups_run(data):
    profile = data.draw(small_profiles())
    inventory = data.draw(pools(profile, largest=2.0))

    def scaled(*counts: int) -> int:
        current = None
        try:
            for n in counts:
                current = choose_plan(current, profile, small_spec(replicas=n), inventory, options=OPTIONS).plan
        except PlanError:
            return 0
        return len(current.groups)
    fresh = scaled(2)
    assert scaled(3, 0, 2) == scaled(1, 2) == scaled(2, 1, 2) == fresh == _planned_groups(profile, inventory, 2)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_suggestion_it_prints_makes_every_replica_fit(data):
    """Whatever does not fit (nothing, or not every replica), each suggestion the message makes,
    applied to the spec and the pool, gives a plan of every replica."""
    profile = data.draw(small_profiles())
    inventory = data.draw(pools(profile, largest=1.0))
    the_spec = small_spec(tensor=data.draw(st.sampled_from(["auto", 1, 2, 4])),
                          pipeline=data.draw(st.sampled_from(["auto", 1, 2, 3])), replicas=data.draw(st.integers(1, 3)))
    try:
        result = plan(profile, the_spec, inventory, OPTIONS)
    except PlanError as err:
        if err.reason == "InvalidParallelism":
            return
        message, found = err.message, err.suggestions
    else:
        missing = shortfall(result, profile, the_spec, inventory, OPTIONS)
        if missing is None:
            return
        message, found = missing.message, missing.suggestions
    offered = message.split("(each checked by planning again): ")[-1].split("\n")[0].removesuffix(".")
    assert ("Nothing tried" in message) if not found else offered.split("; or ") == [s.text for s in found]
    for suggestion in found:
        new_spec, new_inventory = suggestion.apply(the_spec, inventory)
        assert len(plan(profile, new_spec, new_inventory, OPTIONS).groups) == new_spec.replicas, suggestion.text
        if suggestion.patch and (suggestion.add or suggestion.memory_factor != 1):  # not more than it takes
            assert _planned(profile, new_spec, inventory) < new_spec.replicas, suggestion.text


def _planned(profile: ModelProfile, the_spec, inventory: Inventory) -> int:
    try:
        return len(plan(profile, the_spec, inventory, OPTIONS).groups)
    except PlanError:
        return 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_places_answers_as_planning_and_counting_does(data):
    """How the suggestions are checked (sooner, skipping layouts that cannot answer yes) agrees
    with the plan itself, for every number of groups."""
    profile = data.draw(small_profiles())
    inventory = Inventory(devices=[*data.draw(pools(profile, largest=1.0)).devices,
                                   *(d.model_copy(update={"node": f"m{d.node}"})
                                     for d in data.draw(pools(profile, largest=1.0)).devices)])
    the_spec = small_spec(tensor=data.draw(st.sampled_from(["auto", 1, 2])),
                          pipeline=data.draw(st.sampled_from(["auto", 1, 2, 3])), replicas=data.draw(st.integers(1, 4)))
    planned = _planned(profile, the_spec, inventory)
    for groups in range(1, the_spec.replicas + 1):
        assert places(profile, the_spec, inventory, groups, OPTIONS) == (planned >= groups), groups


@pytest.mark.parametrize("devices, spec_fields, first, offered", [
    # The cases: a layout given in full is the constraint, said first; then what was checked.
    ("a:24GiB*4", {"parallelism": {"tensor": 2, "pipeline": 2}, "replicas": 2},
     "tensor=2 x pipeline=2 x 2 replicas needs 8 devices, tensor-parallel ranks on one node; the pool has 4.",
     "set tensor: auto and pipeline: auto, and add 12 more devices of 24.0 GiB (gpu) to node a (4 more devices "
     "would run 1 of the 2 replicas)"),
    ("a:24GiB*5", {"parallelism": {"tensor": 2, "pipeline": 2}, "replicas": 2},
     "tensor=2 x pipeline=2 x 2 replicas needs 8 devices, tensor-parallel ranks on one node; the pool has 5.",
     "set tensor: auto and pipeline: auto, and add 11 more devices of 24.0 GiB (gpu) to node a (3 more devices "
     "would run 1 of the 2 replicas)"),
    # Auto tensor alone fits: no devices added to it as well.
    ("a:80GiB*2,b:80GiB*2", {"parallelism": {"tensor": 8}},
     "spec.parallelism.tensor=8 needs 8 devices on one node; the largest node in the pool has 2.",
     "set tensor: auto"),
    # 70B on two 24 GiB devices: 14 more run both replicas (the KV cache needs room for one
    # sequence per GPU, in 0.9 of what is free: the GPU default).
    ("a:24GiB*2", {"replicas": 2}, "one replica needs at least 141.83 GiB across 2 devices",
     "add 14 more devices of 24.0 GiB (gpu) to node a (6 more devices would run 1 of the 2 replicas)"),
])
def test_the_binding_constraint_comes_first_and_the_suggestions_are_checked(devices, spec_fields, first, offered):
    fields = {"model": {"maxModelLen": 8192, "maxBatchSize": 8}, **spec_fields}
    with pytest.raises(PlanError) as err:
        plan(profile_from_config(LLAMA_70B), spec(**fields), parse_devices(devices))
    assert str(err.value).startswith(f"model does not fit: {first}")
    assert f"To make it fit (each checked by planning again): {offered}." in str(err.value)


def test_a_partial_fit_says_the_layout_needs_more_devices_than_the_pool_has():
    the_spec = spec(model={"maxModelLen": 8192, "maxBatchSize": 8}, replicas=2,
                    parallelism={"tensor": 2, "pipeline": 2})
    result = plan(profile_from_config(LLAMA_70B), the_spec, parse_devices("a:80GiB*4"))
    missing = shortfall(result, profile_from_config(LLAMA_70B), the_spec, parse_devices("a:80GiB*4"))
    assert len(result.groups) == 1 and missing.message.startswith(
        "2 replicas wanted, 1 fits: tensor=2 x pipeline=2 x 2 replicas needs 8 devices, tensor-parallel ranks on "
        "one node; the pool has 4 (4 x 80.0 GiB (gpu) on a).")
    # pipeline auto runs both groups at tensor=2 on the four: each GPU's KV cache needs room for one
    # sequence only (the GPU default), not eight reserved
    assert [s.text for s in missing.suggestions] == ["add 4 more devices of 80.0 GiB (gpu) to node a",
                                                     "set pipeline: auto", "lower spec.replicas to 1"]
