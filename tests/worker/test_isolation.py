"""A request fails alone, on real ranks: whatever the accepted sampling parameters of the requests
in a continuous batch, every sequence ends with a token or a stop and the group runs on; and a
request whose token cannot be chosen (its logits are NaN: the checkpoint's embedding of one of its
prompt tokens is broken) ends with an error while the others in its batch are answered as alone,
at TP=2 and with two pipeline stages (where only the last stage samples), and leaves nothing in its
row for the requests that take it next."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shard_contract.wire import SEED_MAX, SEED_MIN, TEMPERATURE_MAX
from shard_worker.engine.sequences import FAILED_ELSEWHERE
from tests.support.checkpoints import break_embedding

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob

pytestmark = pytest.mark.slow

LONG = {"prompt_ids": [3, 17, 42, 99, 7, 200, 64, 11], "max_new_tokens": 12, "ignore_eos": True}
BROKEN_TOKEN = 13


@pytest.fixture(scope="module")
def broken_model(checkpoint, tmp_path_factory):
    return break_embedding(checkpoint("llama-4layers"), tmp_path_factory.mktemp("broken") / "model", BROKEN_TOKEN)


def alone(pool, model_dir, plan, request: dict) -> list[int]:
    return pool.run(plan, model_dir, GenerateJob([request], return_logits=False))[0]["output"].completions[0]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("when", ["in the first batch", "joining"])
def test_a_request_whose_token_cannot_be_chosen_fails_alone(pool, broken_model, tp, pp, when):
    plan = make_plan(broken_model, tp, pp, max_len=64, batch=2)
    broken = {"prompt_ids": [5, BROKEN_TOKEN, 9], "max_new_tokens": 6, "temperature": 0.8, "seed": 4}
    job = ContinuousJob([LONG, broken], arrivals={}) if when == "in the first batch" else \
        ContinuousJob([LONG], arrivals={2: [broken]})
    results = pool.run(plan, broken_model, job)
    long, failed = results[0]["output"].completions
    assert long.token_ids == alone(pool, broken_model, plan, LONG).token_ids and long.finish_reason == "length"
    assert (failed.finish_reason, failed.token_ids) == ("error", [])
    if pp == 1:  # the leader sampled it: it knows why
        assert failed.error.startswith("choosing its next token failed: the model's logits for this "
                                       "sequence are not finite")
    else:  # the last stage sampled it (and logged why); the first stage got FAILED back
        assert failed.error == FAILED_ELSEWHERE
    finished = [e[2] for e in results[0]["events"] if e[0] == "finished"]
    assert finished == [1, 0]  # answered (with its error) at once, long before the other
    for peer in results[1:tp]:  # the first stage's TP peer decided the same
        assert [c.finish_reason for c in peer["output"].completions] == ["length", "error"]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_failed_sequence_leaves_nothing_in_its_row_for_the_next(pool, broken_model, tp, pp):
    """The failed sequence's keys and values in its row are NaN; the requests that take that row
    next (left-padded over those columns, which attention masks but still multiplies) answer
    exactly as in a fresh group, greedy and sampled alike."""
    plan = make_plan(broken_model, tp, pp, max_len=64, batch=2)
    broken = {"prompt_ids": [5, BROKEN_TOKEN, 9], "max_new_tokens": 6, "temperature": 0.8, "seed": 4}
    greedy = {"prompt_ids": [5, 9, 33], "max_new_tokens": 4, "ignore_eos": True}
    sampled = {"prompt_ids": [8, 1, 77, 120], "max_new_tokens": 5, "temperature": 1.3, "top_p": 0.9, "seed": 5,
               "ignore_eos": True}
    results = pool.run(plan, broken_model, ContinuousJob([LONG, broken], arrivals={2: [greedy, sampled]}))
    completions = results[0]["output"].completions
    assert [c.finish_reason for c in completions] == ["length", "error", "length", "length"]
    rows = {index: row for kind, _, index, row in results[0]["events"] if kind == "finished"}
    assert rows[1] == rows[2] == rows[3] == 1  # the failed one's row served both, one after the other
    assert [c.token_ids for c in completions[2:]] == [alone(pool, broken_model, plan, r).token_ids
                                                      for r in (greedy, sampled)]


sampling = st.fixed_dictionaries({
    "prompt_ids": st.lists(st.integers(3, 249), min_size=1, max_size=8),
    "max_new_tokens": st.integers(1, 8),
    "temperature": st.floats(0.0, TEMPERATURE_MAX, allow_subnormal=True),
    "top_p": st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True),
    "seed": st.integers(SEED_MIN, SEED_MAX),
    "stop": st.lists(st.sampled_from(["w1", "w5", " w", "w4 w", "x"]) | st.text(min_size=1, max_size=4),
                     max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 249), max_size=3),
})


# Each example runs a group: generating is the cost, so no shrinking (a failure prints its example).
@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(anchor=sampling, joiners=st.lists(sampling, min_size=1, max_size=3), pp=st.sampled_from([1, 2]))
def test_any_accepted_sampling_parameters_never_fail_the_group(pool, checkpoint, anchor, joiners, pp):
    """Continuous batches of requests anywhere in the accepted ranges (subnormal temperatures and
    top_p, 64-bit seeds, stop strings and ids): each is answered with a stop or its length, and the
    group takes the next job. The first runs long enough for every joiner to join."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2 // pp, pp, max_len=64, batch=2)
    first = {**anchor, **LONG, "max_new_tokens": 30, "stop": [], "stop_token_ids": []}
    results = pool.run(plan, model_dir, ContinuousJob([first], arrivals={1: joiners}))
    completions = results[0]["output"].completions
    assert len(completions) == 1 + len(joiners)
    assert all(c.finish_reason in ("stop", "length") and c.error is None for c in completions), completions
    for c, request in zip(completions, [first, *joiners], strict=True):
        assert 1 <= len(c.token_ids) <= request["max_new_tokens"]
    assert torch.tensor([t for c in completions for t in c.token_ids]).lt(250).all()
