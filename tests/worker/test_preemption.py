"""Optimistic admission and preemption by recompute on real ranks: a continuous batch admits a
request when its prompt's KV blocks are free, gives its sequence blocks as it grows, and when none
is free preempts the newest running sequence, which rejoins later from its prompt and the tokens
it generated. With a KV cache far smaller than the requests' prompts and new tokens, every
request is answered exactly as it is alone (greedy: as HF's; seeded sampling and penalties: the
same draws), preemptions happen, and every block is free again at the end (TP and PP)."""

from __future__ import annotations

import random

import pytest

from shard_contract.env import DECODE_GRAPHS_ENV

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob
from .test_parallel import hf_greedy

pytestmark = pytest.mark.slow


def _tiny_cache(plan, tokens: int):
    return plan.model_copy(update={"ranks": [r.model_copy(update={"kv_cache_tokens": tokens}) for r in plan.ranks]})


def _request(first: int, prompt: int, new: int, **kw) -> dict:
    return {"prompt_ids": [(first + 13 * i) % 240 + 2 for i in range(prompt)], "max_new_tokens": new,
            "ignore_eos": True, **kw}


def alone(pool, model_dir, plan, request: dict) -> list[int]:
    """What `request` answers alone, in a fixed batch with every block it needs held from the start."""
    results = pool.run(plan, model_dir, GenerateJob([request], return_logits=False))
    return results[0]["output"].completions[0].token_ids


# Four requests of 8 + 24 tokens (two blocks of 16 each) in a cache of four blocks: all four are
# admitted with one block each, and at column 16 the two newest are preempted for the two oldest.
FOUR = [_request(3, 8, 24), _request(5, 8, 24, temperature=1.1, seed=11),
        _request(7, 8, 24, temperature=0.8, top_k=20, seed=-4, frequency_penalty=0.7),
        _request(9, 8, 24)]


@pytest.mark.parametrize("tp,pp,graphs", [(1, 1, "off"), (2, 1, "off"), (1, 2, "off"), (1, 1, "eager")])
def test_more_requests_than_the_cache_holds_are_all_answered_as_alone(pool, checkpoint, hf_model, tp, pp, graphs):
    """(graphs "eager": the decode steps run as captured ones do, reading the grown block tables
    from their device copies.)"""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=64, batch=4)
    small = _tiny_cache(plan, 4 * 16)
    results = pool.run(small, model_dir, ContinuousJob(FOUR, arrivals={}, env={DECODE_GRAPHS_ENV: graphs}))
    completions = [c.token_ids for c in results[0]["output"].completions]
    assert completions == [alone(pool, model_dir, plan, r) for r in FOUR]
    for greedy in (0, 3):
        assert completions[greedy] == hf_greedy(hf_model(model_dir), FOUR[greedy]["prompt_ids"], 24)
    kv = results[0]["kv"]
    assert kv["blocks"] == 4 and kv["preemptions"] >= 2 and kv["free"] == kv["blocks"]
    for peer in results[1:tp]:  # the first stage's TP peers ran the same batch
        assert [c.token_ids for c in peer["output"].completions] == completions


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_preempted_request_whose_client_leaves_is_dropped_and_the_others_answer(pool, checkpoint, tp, pp):
    """The third and fourth are preempted at column 16 (step 8); the fourth's client leaves while
    it waits to rejoin: it is never answered, the others answer as alone, every block comes back."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=64, batch=4)
    results = pool.run(_tiny_cache(plan, 4 * 16), model_dir, ContinuousJob(FOUR, arrivals={}, cancels={10: [3]}))
    completions = results[0]["output"].completions
    assert [c.finish_reason for c in completions] == ["length", "length", "length", "cancelled"]
    assert [c.token_ids for c in completions[:3]] == [alone(pool, model_dir, plan, r) for r in FOUR[:3]]
    kv = results[0]["kv"]
    assert kv["preemptions"] >= 2 and kv["free"] == kv["blocks"]


def test_a_preempted_sequence_waits_for_the_batch_to_drain_when_the_columns_left_are_too_few(pool, checkpoint):
    """max_len 40 leaves a preempted 8 + 30-token request no room to rejoin the running batch's
    columns; it rejoins when the batch has drained, at the columns' start again, and answers as alone."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=40, batch=3)
    requests = [_request(3, 8, 30), _request(5, 8, 30, temperature=1.0, seed=3), _request(7, 8, 30)]
    results = pool.run(_tiny_cache(plan, 5 * 16), model_dir, ContinuousJob(requests, arrivals={}))
    completions = [c.token_ids for c in results[0]["output"].completions]
    assert completions == [alone(pool, model_dir, plan, r) for r in requests]
    kv = results[0]["kv"]
    assert kv["preemptions"] >= 1 and kv["free"] == kv["blocks"]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_arrivals_into_a_tiny_cache_answer_as_alone(pool, checkpoint, seed):
    """A property over random arrival orders: requests of random prompt and answer lengths arrive
    at random step boundaries into a cache of five blocks; each answers what it answers alone."""
    rng = random.Random(seed)
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=128, batch=3)  # columns enough for every arrival to join

    def one() -> dict:
        sampled = {"temperature": 0.9, "seed": rng.randrange(100)} if rng.random() < 0.4 else {}
        return _request(rng.randrange(240), rng.randrange(2, 30), rng.randrange(5, 30), **sampled)

    first = [{**one(), "max_new_tokens": rng.randrange(24, 31)} for _ in range(rng.randrange(1, 3))]
    arrivals: dict[int, list[dict]] = {}  # while the first ones still run
    for _ in range(5):
        arrivals.setdefault(rng.randrange(0, 20), []).append(one())
    results = pool.run(_tiny_cache(plan, 5 * 16), model_dir, ContinuousJob(first, arrivals=arrivals))
    completions = results[0]["output"].completions
    assert [c.token_ids for c in completions] == [alone(pool, model_dir, plan, r) for r in results[0]["requests"]]
    kv = results[0]["kv"]
    assert kv["free"] == kv["blocks"]
