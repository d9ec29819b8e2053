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
from .test_logprobs import check
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


@pytest.mark.parametrize("seed,budget", [(1, None), (2, None), (3, None), (4, None),
                                         (9, "3"), (6, "5"), (7, "2"), (8, "7")])
def test_random_arrivals_into_a_tiny_cache_answer_as_alone(pool, checkpoint, seed, budget):
    """A property over random arrival orders: requests of random prompt and answer lengths arrive
    at random step boundaries into a cache of five blocks; each answers what it answers alone.
    With a step budget of a few tokens (`budget`) the joiners' prompts are computed in chunks over
    several steps, so sequences are preempted mid-prompt too (chunking.py and preemption.py at once)."""
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
    env = {} if budget is None else {"SHARD_STEP_TOKENS": budget}
    results = pool.run(_tiny_cache(plan, 5 * 16), model_dir, ContinuousJob(first, arrivals=arrivals, env=env))
    completions = results[0]["output"].completions
    assert [c.token_ids for c in completions] == [alone(pool, model_dir, plan, r) for r in results[0]["requests"]]
    kv = results[0]["kv"]
    assert kv["free"] == kv["blocks"]


def test_a_sequence_preempted_while_its_prompt_is_computed_in_chunks_rejoins_and_answers_as_alone(pool, checkpoint):
    """A budget of 2 tokens a step computes the joiner's 30-token prompt one token a step beside the
    running decode; the first request's growth takes the cache's last block before that prompt is
    done, so the joiner is preempted mid-prompt (its half-written blocks offered to no one), rejoins
    when the first has finished, and both answer as alone."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=64, batch=2)
    first, joiner = _request(3, 8, 40), _request(11, 30, 8)
    results = pool.run(_tiny_cache(plan, 4 * 16), model_dir,
                       ContinuousJob([first], arrivals={1: [joiner]}, env={"SHARD_STEP_TOKENS": "2"}))
    completions = [c.token_ids for c in results[0]["output"].completions]
    assert completions == [alone(pool, model_dir, plan, r) for r in (first, joiner)]
    kv = results[0]["kv"]
    assert kv["preemptions"] >= 1 and kv["free"] == kv["blocks"]
    # the joiner took no token before it was preempted: its first came after the first request's last
    tokens = [t for t in results[0]["trace"] if t[0] == "tokens"]
    first_of_joiner = next(step for _, step, indices in tokens if 1 in indices)
    last_of_first = max(step for _, step, indices in tokens if 0 in indices)
    assert first_of_joiner > last_of_first


def test_an_echo_request_preempted_mid_prompt_answers_its_whole_prompts_logprobs(pool, checkpoint, hf_model):
    """The scenario above with a joiner that asks for its prompt's log-probabilities: preempted
    before its first token, it has none of them yet (they come with that token), so it computes
    them again when it rejoins (it rejoined without them: an echo of no prompt)."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=64, batch=2)
    first, joiner = _request(3, 8, 40), _request(11, 30, 8, prompt_logprobs=True, logprobs=1)
    results = pool.run(_tiny_cache(plan, 4 * 16), model_dir,
                       ContinuousJob([first], arrivals={1: [joiner]}, env={"SHARD_STEP_TOKENS": "2"}))
    out = results[0]["output"].completions
    kv = results[0]["kv"]
    assert kv["preemptions"] >= 1 and kv["free"] == kv["blocks"]
    check(out[1], joiner["prompt_ids"], hf_model(model_dir), 1, echo=True)


@pytest.mark.parametrize("seed", [31, 32, 33])
def test_random_edge_requests_and_cancels_answer_as_alone_and_give_every_block_back(pool, checkpoint, seed):
    """Seeded random arrivals of requests at the edges: a prompt of maxModelLen tokens for one new
    token, prompts ending at a KV block boundary or one token past it, one new token, echo,
    prompts sharing a prefix (up to all but their last token); clients leaving at random step
    boundaries; a cache of eight blocks (preemptions, mid-prompt ones too) and a step budget of a
    few tokens (chunks that ride with the decode steps). Every request that was not cancelled
    answers as alone (its echo too), and every block comes back. (The harness runs one generate:
    every arrival must join it, so the first two requests run long and the columns stay low.)"""
    rng = random.Random(seed)
    max_len = 64
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=max_len, batch=4)
    shared = _request(rng.randrange(240), max_len, 1)["prompt_ids"]

    def one() -> dict:
        length, new = rng.choice([(max_len, 1), (48, 1), (16, 5), (32, 3), (17, 4), (33, 1),
                                  (rng.randrange(2, 24), rng.randrange(1, 10))])
        prompt = shared[:length] if rng.random() < 0.5 else _request(rng.randrange(240), length, 1)["prompt_ids"]
        echo = {"prompt_logprobs": True, "logprobs": 1} if rng.random() < 0.3 else {}
        return {"prompt_ids": prompt, "max_new_tokens": new, "ignore_eos": True, **echo}

    first = [_request(rng.randrange(240), rng.randrange(2, 8), rng.randrange(40, 50)) for _ in range(2)]
    arrivals: dict[int, list[dict]] = {}
    for _ in range(6):
        arrivals.setdefault(rng.randrange(0, 12), []).append(one())
    cancels: dict[int, list[int]] = {}
    for _ in range(2):  # a sequence index not started by then is not cancelled (pool.py)
        cancels.setdefault(rng.randrange(1, 30), []).append(rng.randrange(8))
    job = ContinuousJob(first, arrivals=arrivals, cancels=cancels, env={"SHARD_STEP_TOKENS": str(rng.randrange(2, 6))})
    results = pool.run(_tiny_cache(plan, 8 * 16), model_dir, job)
    kv = results[0]["kv"]
    assert kv["free"] == kv["blocks"]
    for done, request in zip(results[0]["output"].completions, results[0]["requests"], strict=True):
        if done.finish_reason == "cancelled":
            continue
        [mine] = pool.run(plan, model_dir, GenerateJob([request], return_logits=False))[0]["output"].completions
        assert done.token_ids == mine.token_ids
        if request["prompt_logprobs"]:
            assert done.prompt_logprobs[0] is None and mine.prompt_logprobs[0] is None
            assert done.prompt_logprobs[1:] == pytest.approx(mine.prompt_logprobs[1:], abs=1e-4)
