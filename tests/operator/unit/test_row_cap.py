"""The running-row cap the planner chooses when the spec leaves maxBatchSize out on GPUs
(planning/rowcap.py): the pure choice as a table, and hypothesis for the rule: the default never
makes a model infeasible that one row runs, the cap is the largest power of two that fits, it
never shrinks as memory grows, and a chosen plan's bytes stay within every device. A later
reconcile keeps a cap the planner chose; a cap the spec gives, or an old plan's, is planned again."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import Device, Inventory, parse_devices
from shard_operator.planning.profile import profile_from_config
from shard_operator.planning.replan import incompatibility
from shard_operator.planning.request import Request
from shard_operator.planning.rowcap import caps, choose, explain

from .test_kvcache import LLAMA_8B, OPTIONS, GiB, small_llamas, spec

CAPS = [256, 128, 64, 32, 16, 8, 4, 2, 1]


def _request(batch: int, chosen: bool) -> Request:
    return Request(dtype="bfloat16", quantization="none", max_len=1024, batch=batch, replicas=1, headroom=0.1,
                   spread_replicas=False, rows_chosen=chosen)


def test_the_caps_tried_are_the_given_one_or_the_powers_of_two_down_to_one():
    assert caps(_request(256, True)) == CAPS
    assert caps(_request(48, False)) == [48]


@pytest.mark.parametrize(("fits_up_to", "wanted", "expected", "asked"), [
    (256, 1, 256, [256]),  # fits with room to spare: one search
    (1000, 2, 256, [256, 1]),  # one of two groups at every cap: one row places no more
    (32, 1, 32, [256, 1, 128, 64, 32]),
    (1, 1, 1, [256, 1, 128, 64, 32, 16, 8, 4, 2]),
    (0, 1, 1, [256, 1]),  # nothing fits: the smallest, which the refusal speaks of
])
def test_choose_takes_the_largest_cap_that_places_what_one_row_places(fits_up_to, wanted, expected, asked):
    seen = []

    def score(cap):
        seen.append(cap)
        return (1 if cap <= fits_up_to else 0, True)
    assert choose(CAPS, score, wanted) == expected
    assert seen == asked


def test_choose_keeps_replicas_and_resident_layers_before_rows():
    # two groups fit at 16 rows, one at 64: the cap must not cost a replica
    assert choose(CAPS, lambda cap: (2 if cap <= 16 else 1, True), 2) == 16
    # above 32 rows the layers would stream (offload auto): fewer rows, all resident
    assert choose(CAPS, lambda cap: (1, cap <= 32), 1) == 32


def test_the_reason_says_why_the_cap_is_below_the_default():
    assert explain(256, 256, 4096, None, 0) == ""
    text = explain(32, 256, 4096, (0, True), 3 * GiB)
    assert text.startswith("maxBatchSize 32, not the GPU default 256 (spec.model.maxBatchSize is unset)")
    assert "3.0 GiB on the most loaded rank" in text and text.endswith("at 64 not one group fits")
    assert explain(32, 256, 4096, (1, False), 0).endswith("at 64 layers would stream")
    assert explain(32, 256, 4096, (1, True), 0).endswith("at 64 fewer groups fit (1)")


# ---------------------------------------------------------------- the rule (hypothesis)
def _gpus(memories: list[int]) -> Inventory:
    return Inventory(devices=[Device(node="n0", index=i, kind="gpu", memory_bytes=m) for i, m in enumerate(memories)])


def _cap(profile, s, inventory) -> int:
    """The cap planned, 0 when nothing fits."""
    try:
        return plan(profile, s, inventory, OPTIONS).max_batch_size
    except PlanError:
        return 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_default_cap_fits_is_the_largest_that_does_and_never_makes_a_model_infeasible(data):
    profile = data.draw(small_llamas())
    memories = data.draw(st.lists(st.integers(256 * 2**20, 6 * GiB), min_size=1, max_size=3))
    max_len = data.draw(st.sampled_from([256, 1024, 4096]))
    unset = spec(model={"maxModelLen": max_len})
    inventory = _gpus(memories)
    one_row = _cap(profile, spec(model={"maxModelLen": max_len, "maxBatchSize": 1}), inventory)
    try:
        p = plan(profile, unset, inventory, OPTIONS)
    except PlanError as err:
        assert one_row == 0, "the default refused a model that one row runs"
        assert "With maxBatchSize unset it was planned at 1 running row" in err.message
        return
    cap = p.max_batch_size
    assert cap in CAPS and p.max_batch_size_chosen
    for r in p.ranks:  # what the plan says fits, fits
        assert r.predicted_bytes.total <= r.usable_bytes <= r.capacity_bytes
        assert r.kv_cache_tokens >= max_len
    if cap < 256:  # the largest: twice as many rows do not fit
        assert _cap(profile, spec(model={"maxModelLen": max_len, "maxBatchSize": 2 * cap}), inventory) == 0
        assert f"maxBatchSize {cap}, not the GPU default 256" in p.reason
    else:
        assert "not the GPU default" not in p.reason
    # the same plan as the spec giving that cap
    given_cap = plan(profile, spec(model={"maxModelLen": max_len, "maxBatchSize": cap}), inventory, OPTIONS)
    assert [r.predicted_bytes for r in given_cap.ranks] == [r.predicted_bytes for r in p.ranks]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_more_memory_never_gives_a_smaller_cap(data):
    profile = data.draw(small_llamas())
    count = data.draw(st.integers(1, 3))
    small = data.draw(st.integers(256 * 2**20, 4 * GiB))
    more = data.draw(st.integers(0, 4 * GiB))
    max_len = data.draw(st.sampled_from([256, 1024, 4096]))
    s = spec(model={"maxModelLen": max_len})
    assert _cap(profile, s, _gpus([small] * count)) <= _cap(profile, s, _gpus([small + more] * count))


# ---------------------------------------------------------------- a later reconcile
def test_a_chosen_cap_is_kept_and_a_given_or_old_one_is_planned_again():
    profile = profile_from_config(LLAMA_8B)
    unset = spec(model={"maxModelLen": 4096})
    current = plan(profile, unset, parse_devices("a:24GiB"))
    cap = current.max_batch_size
    assert cap < 256 and current.max_batch_size_chosen
    assert incompatibility(current, profile, unset) is None  # whatever cap it chose, the spec allows
    assert incompatibility(current, profile, spec(model={"maxModelLen": 4096, "maxBatchSize": cap})) is None
    assert incompatibility(current, profile, spec(model={"maxModelLen": 4096, "maxBatchSize": 2 * cap})) == \
        f"maxBatchSize changed from {cap} to {2 * cap}"
    # a plan made before the planner chose (maxBatchSize 1, its cache reserved), or for a given cap
    old = current.model_copy(update={"max_batch_size": 1, "max_batch_size_chosen": False})
    assert incompatibility(old, profile, unset) == "maxBatchSize changed from 1 to the planner's choice"
