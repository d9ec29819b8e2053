"""Offload in the planner: which layers stream, from where, at what predicted speed; tables for
the decisions, hypothesis for the properties (offload only when needed, every rank within its
budgets, the fewest streamed bytes)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.plan import Plan
from shard_operator.api import SpecError, parse_spec
from shard_operator.planning import Costs, PlanError, kvcache, plan, resolve_request
from shard_operator.planning.inventory import (
    FILE_GBPS,
    HOST_GBPS,
    MAPPED_FILE_GBPS,
    Device,
    Inventory,
    inventory_from_nodes,
    parse_devices,
)
from shard_operator.planning.offload import spread
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.replan import choose_plan
from shard_operator.planning.sizing import (
    kv_token_bytes,
    layer_copied_bytes,
    layer_read_bytes,
    layer_streamed_bytes,
    layer_weight_bytes,
)
from shard_operator.planning.step import StepOverhead
from tests.operator.unit.test_planner import LLAMA_8B, OPTIONS, _rank_total
from tests.support.cluster import gpu_node

EIGHT_B = profile_from_config(LLAMA_8B, "llama-3-8b")


def spec(policy="auto", model=None, **offload):
    return parse_spec({"model": {"path": "m", "maxModelLen": 4096, **(model or {})},
                       "parallelism": offload.pop("parallelism", {}),
                       "placement": {"offload": {"policy": policy, **offload}}})


def streamed(p: Plan) -> int:
    return sum(r.offload.streamed_bytes for r in p.ranks if r.offload)


# ---------------------------------------------------------------- decisions (tables)
def test_a_model_that_does_not_fit_streams_what_the_device_cannot_hold():
    result = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4"))
    (rank,) = result.ranks
    off, p = rank.offload, rank.predicted_bytes
    layer = layer_streamed_bytes(EIGHT_B, 0, 1, "bfloat16")
    assert 0 < len(off.layers) < 32 and off.tier == "host" and off.file_layers == [] and off.prefetch == 2
    assert off.streamed_bytes == len(off.layers) * layer and p.staging == 2 * layer
    assert p.weights == result_weights(rank, layer)
    assert p.total <= rank.usable_bytes < p.total + layer  # one more resident layer would not fit
    assert off.stream_seconds == pytest.approx(off.streamed_bytes / (HOST_GBPS * 1e9))  # PCIe's default rate
    assert result.groups[0].critical_path_seconds == pytest.approx(max(off.compute_seconds, off.stream_seconds))
    assert off.host_bytes == off.streamed_bytes  # pinned copies of what it streams: what its pod asks for
    assert "offload auto: the devices cannot hold every layer: rank 0 streams" in result.reason
    assert off.layers == spread((0, 32), len(off.layers))


def result_weights(rank, layer: int) -> int:
    """Resident weights of a rank that streams `layer` bytes of each streamed layer."""
    whole = sum(layer_weight_bytes(EIGHT_B, i, 1, "bfloat16") for i in range(*rank.layers))
    outside = EIGHT_B.shape.vocab_size * EIGHT_B.shape.hidden_size * 2 * 2 + EIGHT_B.final_norm_numel * 2
    return whole - len(rank.offload.layers) * layer + outside


def test_spread_puts_resident_layers_between_streamed_ones():
    assert spread((0, 16), 4) == [2, 6, 10, 14]
    assert spread((8, 12), 4) == [8, 9, 10, 11]
    assert spread((0, 10), 3) == [1, 5, 8] and spread((0, 5), 0) == []


def test_auto_plans_exactly_as_never_when_the_model_fits():
    devices = parse_devices("a:24GiB*2:L4")
    assert plan(EIGHT_B, spec("auto"), devices).ranks == plan(EIGHT_B, spec("never"), devices).ranks


def test_never_says_what_offload_would_do():
    with pytest.raises(PlanError) as err:
        plan(EIGHT_B, spec("never"), parse_devices("a:8GiB:L4"))
    fitted = plan(EIGHT_B, spec("auto"), parse_devices("a:8GiB:L4"))
    step = fitted.groups[0].critical_path_seconds
    assert (f"set spec.placement.offload.policy auto: streaming {len(fitted.ranks[0].offload.layers)} of the 32 "
            f"layers on its one rank") in err.value.message
    assert f"est. {step * 1e3:.2f} ms per decode step ({1 / step:.1f} tokens/s per sequence)" in err.value.message


def test_always_streams_every_layer_of_every_rank():
    result = plan(EIGHT_B, spec("always", parallelism={"tensor": 2}), parse_devices("a:80GiB*2:H100"))
    for rank in result.ranks:
        assert rank.offload.layers == list(range(32))
        assert rank.offload.streamed_bytes == 32 * layer_streamed_bytes(EIGHT_B, 0, 2, "bfloat16")


def test_rates_come_from_the_devices():
    slow = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4")).ranks[0].offload
    fast = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4+host=50")).ranks[0].offload
    assert (slow.host_bandwidth, fast.host_bandwidth) == (HOST_GBPS * 1e9, 50e9)
    assert fast.stream_seconds == pytest.approx(slow.stream_seconds / 2)
    labelled = inventory_from_nodes([gpu_node("n", gpus=1, memory_mib=8192, labels={
        "sharding.dev/host-bandwidth": "50", "sharding.dev/file-bandwidth": "7"})])
    assert (labelled.devices[0].host_gbps, labelled.devices[0].file_gbps) == (50.0, 7.0)
    with pytest.raises(ValueError, match="host must be positive"):
        parse_devices("a:8GiB+host=0")


def test_a_host_budget_sends_the_rest_to_the_files_or_fails_without_them():
    whole = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4")).ranks[0].offload
    layer = layer_streamed_bytes(EIGHT_B, 0, 1, "bfloat16")
    off = plan(EIGHT_B, spec(hostMemory=f"{10 * layer}B"), parse_devices("a:8GiB:L4")).ranks[0].offload
    assert off.layers == whole.layers and len(off.file_layers) == len(off.layers) - 10
    assert off.tier == "host+files" and off.read_bytes == len(off.file_layers) * layer_read_bytes(EIGHT_B, 0, 1)
    # a file layer is read while the copy of the one before runs: host 10 layers, files the rest
    assert off.stream_seconds == pytest.approx(10 * layer / (HOST_GBPS * 1e9) + len(off.file_layers) * max(
        layer_read_bytes(EIGHT_B, 0, 1) / (FILE_GBPS * 1e9), layer / (HOST_GBPS * 1e9)))
    with pytest.raises(PlanError, match="Offload streams the decoder layers' projections only"):
        plan(EIGHT_B, spec(hostMemory=f"{10 * layer}B", fromFiles=False), parse_devices("a:8GiB:L4"))


def test_cpu_ranks_map_the_files_in_place_with_the_row_parallel_rows_whole():
    result = plan(EIGHT_B, spec(parallelism={"tensor": 2}), parse_devices("a:6GiB*2", kind="cpu"))
    rank = result.ranks[0]
    off = rank.offload
    assert off.tier == "files" and off.host_bandwidth == 0 and off.file_bandwidth == MAPPED_FILE_GBPS * 1e9
    lp = EIGHT_B.layers[0]
    assert layer_read_bytes(EIGHT_B, 0, 2) == (lp.column_matrix // 2 + lp.kv_matrix // 2 + lp.row) * 2
    assert off.read_bytes == len(off.layers) * layer_read_bytes(EIGHT_B, 0, 2)
    assert off.stream_seconds == pytest.approx(off.read_bytes / (MAPPED_FILE_GBPS * 1e9))
    # computed on in place: no staging slots, so every byte that streams is a byte saved
    assert off.copied_bytes == 0 and rank.predicted_bytes.staging == 0
    layer = off.streamed_bytes // len(off.layers)
    assert rank.predicted_bytes.total <= rank.usable_bytes < rank.predicted_bytes.total + layer
    with pytest.raises(PlanError):
        plan(EIGHT_B, spec(fromFiles=False, parallelism={"tensor": 2}), parse_devices("a:6GiB*2", kind="cpu"))


def test_cpu_ranks_copy_what_they_cannot_compute_on_in_place():
    """Another runtime dtype than the checkpoint's: every streamed matrix is converted into staging
    slots, read no faster than a copy. Misaligned matrices (a non-standard writer's): those only."""
    converted = plan(EIGHT_B, spec(model={"dtype": "float32"}), parse_devices("a:16GiB", kind="cpu")).ranks[0]
    off, layer = converted.offload, layer_streamed_bytes(EIGHT_B, 0, 1, "float32")
    assert off.copied_bytes == off.streamed_bytes == len(off.layers) * layer
    assert converted.predicted_bytes.staging == 2 * layer
    assert off.stream_seconds == pytest.approx(off.read_bytes / (FILE_GBPS * 1e9))

    misaligned = EIGHT_B.model_copy(deep=True)
    for lp in misaligned.layers:  # q and down of every layer start 2 bytes past an element
        lp.unaligned_column = EIGHT_B.shape.hidden_size ** 2
        lp.unaligned_row = EIGHT_B.shape.hidden_size * EIGHT_B.shape.intermediate_size
    rank = plan(misaligned, spec(parallelism={"tensor": 2}), parse_devices("a:6GiB*2", kind="cpu")).ranks[0]
    copied = (EIGHT_B.shape.hidden_size ** 2 + EIGHT_B.shape.hidden_size * EIGHT_B.shape.intermediate_size) // 2 * 2
    assert layer_copied_bytes(misaligned, 0, 2, "auto", "cpu") == copied
    assert layer_copied_bytes(misaligned, 0, 2, "auto", "gpu") == layer_streamed_bytes(misaligned, 0, 2)
    assert rank.offload.copied_bytes == len(rank.offload.layers) * copied
    assert rank.predicted_bytes.staging == 2 * copied


def test_one_slot_cannot_hide_a_load_behind_its_own_layer():
    two = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4")).ranks[0].offload
    one = plan(EIGHT_B, spec(prefetch=1), parse_devices("a:8GiB:L4"))
    off = one.ranks[0].offload
    assert one.ranks[0].predicted_bytes.staging == layer_streamed_bytes(EIGHT_B, 0, 1, "bfloat16")
    assert len(off.layers) == len(two.layers) - 1  # the slot it does not need holds a layer instead
    step = StepOverhead()  # an L4 reads 0.3 TB/s, a decode step's kernels a share of that
    layer_compute = layer_weight_bytes(EIGHT_B, 0, 1, "bfloat16") / (0.3e12 * step.read_share["gpu"]) \
        + step.per_layer["gpu"]
    assert one.groups[0].critical_path_seconds == pytest.approx(off.stream_seconds + len(off.layers) * layer_compute)


def test_int8_is_not_streamed():
    with pytest.raises(SpecError, match=r"spec: placement\.offload\.policy always cannot stream int8 weights"):
        spec("always", model={"quantization": "int8"})
    with pytest.raises(PlanError, match=r"placement\.offload\.policy auto cannot stream int8 weights"):
        plan(EIGHT_B, spec("auto", model={"quantization": "int8"}), parse_devices("a:4GiB:L4"))


@pytest.mark.parametrize("offload, message", [
    ({"policy": "sometimes"}, "spec.placement.offload.policy: should be 'never', 'auto' or 'always'"),
    ({"hostMemory": "lots"}, "spec.placement.offload.hostMemory: 'lots' is not a memory size"),
    ({"prefetch": 0}, 'spec.placement.offload.prefetch: must be a positive integer or "auto" (got 0)'),
    ({"prefetch": "many"}, 'spec.placement.offload.prefetch: must be a positive integer or "auto"'),
    ({"fromFile": True}, "spec.placement.offload.fromFile: unknown field"),
])
def test_bad_offload_fields_are_named(offload, message):
    with pytest.raises(SpecError) as err:
        parse_spec({"model": {"path": "m"}, "placement": {"offload": offload}})
    assert message in str(err.value)


def test_the_plan_round_trips_and_its_hash_follows_the_streamed_layers():
    result = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4"))
    assert Plan.from_json(result.to_json()) == result
    assert result.to_json_dict()["ranks"][0]["offload"]["layers"] == result.ranks[0].offload.layers
    other = plan(EIGHT_B, spec(prefetch=1), parse_devices("a:8GiB:L4"))
    assert result.group_hash(0) != other.group_hash(0)
    resident = plan(EIGHT_B, spec("never"), parse_devices("a:24GiB:L4"))
    unchanged = resident.model_copy(update={"offload": resident.offload.model_copy(update={"policy": "auto"})})
    assert resident.group_hash(0) == unchanged.group_hash(0)  # pods are replaced only when streaming changes


def test_a_changed_offload_spec_is_planned_again_and_a_bigger_pool_ends_the_streaming():
    small = parse_devices("a:8GiB:L4")
    current = plan(EIGHT_B, spec(), small)
    again = choose_plan(current, EIGHT_B, spec(prefetch=1), small)
    assert again.kind == "respec" and "placement.offload changed" in again.message
    grown = parse_devices("a:8GiB:L4,b:24GiB:L4")
    choice = choose_plan(current, EIGHT_B, spec(), grown, reconsider=True)
    assert choice.kind == "improved" and not choice.plan.streams
    assert "it holds every layer (streaming" in choice.message


# ---------------------------------------------------------------- properties (hypothesis)
def _spec(policy: str, parallelism: dict, prefetch="auto", host=None):
    offload = {"policy": policy, "prefetch": prefetch, **({"hostMemory": f"{host}B"} if host is not None else {})}
    return parse_spec({"model": {"path": "m", "maxModelLen": 16}, "parallelism": parallelism,
                       "placement": {"memoryHeadroom": 0.0, "offload": offload}})


@st.composite
def cases(draw):
    """A model whose layers weigh more than the rest, on up to 4 devices of one kind, each from a
    sixth of the whole model to all of it: most do not fit without streaming, many do with it."""
    heads = draw(st.sampled_from([2, 4]))
    profile = profile_from_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": heads * 16, "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([1, heads])),
        "intermediate_size": draw(st.sampled_from([128, 256])),
        "num_hidden_layers": draw(st.integers(3, 12)), "vocab_size": 40, "max_position_embeddings": 64,
        "torch_dtype": "float32"})
    whole = _rank_total(profile, 1, (0, profile.shape.num_layers), True, True, 16)
    kind = draw(st.sampled_from(["gpu", "cpu"]))
    devices = [Device(node=f"n{node}", index=index, kind=kind, memory_bytes=draw(st.integers(whole // 6, whole)),
                      speed=draw(st.sampled_from([0.5, 1.0])))
               for node in range(draw(st.integers(1, 2))) for index in range(draw(st.integers(1, 2)))]
    host = draw(st.sampled_from([None, 0, layer_streamed_bytes(profile, 0, 1) * 2]))
    parallelism = draw(st.sampled_from([{}, {"tensor": 2}, {"tensor": 1, "pipeline": 2}]))
    return profile, Inventory(devices=devices), parallelism, draw(st.sampled_from(["auto", 1, 3])), host


def _plan_or_none(profile, s, inventory):
    try:
        return plan(profile, s, inventory, OPTIONS)
    except PlanError as err:
        assert err.reason in ("InsufficientCapacity", "InvalidParallelism"), err
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_auto_streams_only_when_holding_every_layer_places_fewer_replicas(case):
    profile, inventory, parallelism, prefetch, host = case
    never = _plan_or_none(profile, _spec("never", parallelism, prefetch, host), inventory)
    auto = _plan_or_none(profile, _spec("auto", parallelism, prefetch, host), inventory)
    if never is not None:
        assert auto is not None and not auto.streams and auto.ranks == never.ranks
    elif auto is not None:
        assert auto.streams


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), policy=st.sampled_from(["auto", "always"]))
def test_every_rank_fits_its_device_and_its_host_budget(case, policy):
    profile, inventory, parallelism, prefetch, host = case
    s = _spec(policy, parallelism, prefetch, host)
    result = _plan_or_none(profile, s, inventory)
    if result is None:
        return
    assert [layer for r in result.group(0) if r.tp_rank == 0 for layer in range(*r.layers)] == \
        list(range(profile.shape.num_layers))
    for r in result.ranks:
        assert r.predicted_bytes.total <= r.usable_bytes
        if r.offload is None:
            assert policy == "auto"
            continue
        o = r.offload
        layer = o.streamed_bytes // len(o.layers)
        copied = o.copied_bytes // len(o.layers)  # a GPU copies every layer in; a CPU maps it in place
        assert copied == (layer if r.kind == "gpu" else 0)
        assert set(o.layers) <= set(range(*r.layers)) and set(o.file_layers) <= set(o.layers)
        assert r.predicted_bytes.staging == o.prefetch * copied and o.prefetch <= len(o.layers)
        in_host = (len(o.layers) - len(o.file_layers)) * layer
        assert in_host == 0 if r.kind == "cpu" else (host is None or in_host <= host)
        if policy == "auto":  # it keeps every layer it can: one more resident would not fit its stage
            smallest = min(p.usable_bytes for p in result.group(r.replica) if p.stage == r.stage)
            held = r.predicted_bytes.total - r.predicted_bytes.kv_cache + kv_room(profile, result, r, s)
            assert (len(o.layers) > o.prefetch or not copied) and held + layer > smallest
        else:
            assert o.layers == list(range(*r.layers))


def kv_room(profile, result, r, s) -> int:
    """The KV cache a rank's stage must leave room for: on a GPU (0.9 of the free memory by
    default) a whole sequence in that share, however little the group's smallest rank then gives
    every rank; on a CPU the reservation it holds."""
    if r.kind != "gpu":
        return r.predicted_bytes.kv_cache
    request = resolve_request(profile, s, "gpu")
    per_token = kv_token_bytes(profile, result.tensor_parallel, r.layers[1] - r.layers[0], request.dtype)
    return per_token * kvcache.fit_tokens(kvcache.kv_policy(request, "gpu"), request)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_no_split_of_the_layers_over_the_same_stages_streams_fewer_bytes(case):
    profile, inventory, parallelism, prefetch, host = case
    s = _spec("auto", parallelism, prefetch, host)
    result = _plan_or_none(profile, s, inventory)
    if result is None or not result.streams or result.pipeline_parallel > 3:
        return
    ranks = [r for r in result.group(0) if r.tp_rank == 0]
    costs = Costs(profile, resolve_request(profile, s), OPTIONS, streaming=True)
    devices = {(d.node, d.index): d for d in inventory.devices}
    shapes = [_block_shape(result, r, devices) for r in ranks]
    last = len(ranks) - 1
    stages = [costs.offload_stage(shape, result.tensor_parallel, i == 0, i == last) for i, shape in enumerate(shapes)]
    planned = sum(len(r.offload.layers) if r.offload else 0 for r in ranks)
    for counts in _splits(profile.shape.num_layers, len(ranks)):
        at = [stage.at(n) for stage, n in zip(stages, counts, strict=True)]
        if all(a is not None for a in at):
            assert planned <= sum(a.streamed for a in at), (counts, [r.layers for r in ranks])


def _block_shape(result, rank, devices) -> tuple:
    """The shape of the block a stage's ranks form (the smallest of them, as the planner makes it)."""
    group = [devices[(r.node, r.device_index)] for r in result.group(rank.replica) if r.stage == rank.stage]
    return (min(d.memory_bytes for d in group), min(d.speed for d in group), group[0].kind,
            min(d.host_gbps for d in group), min(d.file_gbps for d in group))


def _splits(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield [b - a for a, b in zip((0, *cuts), (*cuts, total), strict=False)]


def test_the_picture_shows_what_a_rank_streams_and_its_staging():
    from shard_operator.planning.picture import plan_svg

    streams = plan(EIGHT_B, spec(), parse_devices("a:8GiB:L4"))
    streaming = plan_svg(streams)
    streamed = len(streams.ranks[0].offload.layers)
    assert 0 < streamed < 32 and f"layers 0-31 (32 layers, {streamed} streamed)" in streaming
    assert "staging (streamed layers)" in streaming
    assert "predicted staging" in streaming
    resident = plan_svg(plan(EIGHT_B, spec("never"), parse_devices("a:24GiB:L4")))
    assert "streamed" not in resident and "staging" not in resident
