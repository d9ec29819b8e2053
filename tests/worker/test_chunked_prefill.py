"""Chunked prefill on real ranks (engine/chunking.py): a joiner's prompt is computed a chunk a step
within a tiny per-step token budget (SHARD_STEP_TOKENS) while the running sequences take a token
at every step, and every answer is what it is alone and what HF gives (greedy), across TP and PP,
in random arrival orders, with the prefix cache (a prompt's blocks cached as its chunks write them),
with echo, and when a joiner is cancelled mid-prompt (its blocks go back to the pool at once); and
a joiner's prompt progresses by at least half the budget a step when the decodes alone fill it."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.env import DECODE_GRAPHS_ENV

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob
from .test_logprobs import check
from .test_parallel import hf_greedy

pytestmark = pytest.mark.slow

RUNNING = {"prompt_ids": [3, 17, 42, 99, 7, 200, 64, 11], "max_new_tokens": 24, "ignore_eos": True}
PROMPT = [(11 * i + 5) % 240 + 2 for i in range(30)]  # longer than the running batch's column: reframed
SAMPLED = {"prompt_ids": [8, 1, 77, 120, 4, 61, 9, 13, 2], "max_new_tokens": 5, "temperature": 1.3, "top_p": 0.9,
           "seed": 5, "ignore_eos": True}


def prompt_of(length: int, salt: int) -> list[int]:
    return [(13 * i + 7 * salt + 3) % 240 + 2 for i in range(length)]


def alone(pool, model_dir, plan, request: dict) -> list[int]:
    results = pool.run(plan, model_dir, GenerateJob([request], return_logits=False))
    return results[0]["output"].completions[0].token_ids


def events(results, kind: str) -> list[tuple]:
    return [e[1:] for e in results[0]["events"] + results[0]["trace"] if e[0] == kind]


@pytest.mark.parametrize("tp,pp,budget,graphs", [(1, 1, 1, "off"), (1, 1, 4, "off"), (2, 1, 3, "off"),
                                                 (1, 2, 5, "off"), (2, 2, 7, "off"), (1, 2, 3, "eager"),
                                                 (1, 1, 2, "eager")])
def test_a_long_joiner_is_computed_a_chunk_a_step_beside_the_decodes_and_answers_as_alone(
        pool, checkpoint, hf_model, tp, pp, budget, graphs):
    """(graphs "eager": every decode step through the replayed step's code, which computes the
    parked row with the others.)"""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=96, batch=3)
    joiner = {"prompt_ids": PROMPT, "max_new_tokens": 6, "ignore_eos": True}
    job = ContinuousJob([RUNNING], arrivals={1: [joiner, SAMPLED]},
                        env={"SHARD_STEP_TOKENS": str(budget), DECODE_GRAPHS_ENV: graphs})
    results = pool.run(plan, model_dir, job)
    completions = [c.token_ids for c in results[0]["output"].completions]
    assert completions == [alone(pool, model_dir, plan, r) for r in (RUNNING, joiner, SAMPLED)]
    assert completions[1] == hf_greedy(hf_model(model_dir), PROMPT, 6)
    for peer in results[1:tp]:  # the first stage's TP peers composed the same steps
        assert [c.token_ids for c in peer["output"].completions] == completions

    took = events(results, "tokens")  # (boundary, indices that took a token in the step before it)
    running_steps = [indices for _, indices in took if 0 in indices]
    assert len(running_steps) == 24  # the running sequence took a token at every step, none skipped
    assert [step for step, _ in took[:24]] == list(range(24))  # the prefill's at boundary 0, then each step's
    first = next(step for step, indices in took if 1 in indices)
    # joined at boundary 1: its 30-token prompt took at least 30 / budget steps
    assert first - 1 >= -(-len(PROMPT) // budget)
    if budget < len(PROMPT):
        assert first > 2  # not in the step it joined at


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_a_joiner_cancelled_mid_prompt_gives_its_blocks_back_and_its_row_serves_the_next(pool, checkpoint, tp, pp):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=96, batch=2)
    joiner = {"prompt_ids": PROMPT, "max_new_tokens": 6, "ignore_eos": True}
    later = {"prompt_ids": prompt_of(20, 1), "max_new_tokens": 5, "ignore_eos": True}
    job = ContinuousJob([RUNNING], arrivals={1: [joiner], 5: [later]}, cancels={3: [1]},
                        env={"SHARD_STEP_TOKENS": "3"})
    results = pool.run(plan, model_dir, job)
    out = results[0]["output"].completions
    assert out[1].finish_reason == "cancelled" and out[1].token_ids == []
    assert [out[0].token_ids, out[2].token_ids] == [alone(pool, model_dir, plan, r) for r in (RUNNING, later)]
    free = dict(events(results, "free_blocks"))  # boundary -> free blocks (after that boundary's cancels)
    assert free[2] < free[1]  # the joiner holds its blocks while its prompt is computed
    assert free[3] == free[4] == free[1]  # released at the boundary it was cancelled at
    assert [row for _, index, row in events(results, "finished") if index == 2] == [1]  # its row, reused


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_chunks_after_a_prefix_cache_hit_and_echo_under_chunking(pool, checkpoint, hf_model, tp, pp):
    """A joiner that takes two cached blocks computes the rest of its prompt in chunks; one that
    asks for its prompt's log-probabilities computes its whole prompt in chunks: both equal HF."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=128, batch=3)
    shared = prompt_of(40, 2)
    first = {"prompt_ids": shared + [5, 6, 7], "max_new_tokens": 20, "ignore_eos": True}
    joiner = {"prompt_ids": shared + [9, 4, 8, 8, 1, 30, 31], "max_new_tokens": 6, "ignore_eos": True}
    echo = {"prompt_ids": shared[:25], "max_new_tokens": 3, "ignore_eos": True, "prompt_logprobs": True,
            "logprobs": 2}
    job = ContinuousJob([first], arrivals={2: [joiner, echo]}, env={"SHARD_STEP_TOKENS": "4"})
    results = pool.run(plan, model_dir, job)
    out = results[0]["output"].completions
    assert [c.cached_tokens for c in out] == [0, 32, 0]
    model = hf_model(model_dir)
    assert [c.token_ids for c in out[:2]] == [hf_greedy(model, r["prompt_ids"], r["max_new_tokens"])
                                              for r in (first, joiner)]
    check(out[2], echo["prompt_ids"], model, 2, echo=True)


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_a_prompts_full_blocks_are_cached_as_its_chunks_write_them(pool, checkpoint, hf_model, tp, pp):
    """A joiner's full prompt blocks join the prefix cache as the chunks that complete them are
    computed, not when its whole prompt is: a second request sharing its first 64 tokens, arriving
    while the first is still mid-prompt (36 of its 70 tokens computed, 3 a step), takes the two
    blocks already written (the pool's hit counter says so), computes the rest, and both answer as
    alone (no cache) and as HF."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=128, batch=3)
    shared = prompt_of(64, 3)
    first = {"prompt_ids": shared + [5, 6, 7, 9, 11, 13], "max_new_tokens": 6, "ignore_eos": True}
    second = {"prompt_ids": shared + [21, 8, 4, 30], "max_new_tokens": 6, "ignore_eos": True}
    running = {**RUNNING, "max_new_tokens": 40}
    # budget 4 beside one decode: 3 prompt tokens a step; the first joins at boundary 1, so by
    # boundary 13 it has 36 tokens computed (2 full blocks of 16) and 34 to go
    job = ContinuousJob([running], arrivals={1: [first], 13: [second]}, env={"SHARD_STEP_TOKENS": "4"})
    results = pool.run(plan, model_dir, job)
    out = results[0]["output"].completions
    took = events(results, "tokens")
    assert next(step for step, indices in took if 1 in indices) > 13  # the first's prompt was not done yet
    assert [c.cached_tokens for c in out] == [0, 0, 32]
    # lookups in blocks (never a prompt's last token's block): 0 + 4 for the first, 4 for the second
    assert (results[0]["kv"]["prefix_hits"], results[0]["kv"]["prefix_queries"]) == (2, 8)
    model = hf_model(model_dir)
    assert [c.token_ids for c in out] == [alone(pool, model_dir, plan, r) for r in (running, first, second)]
    assert [c.token_ids for c in out[1:]] == [hf_greedy(model, r["prompt_ids"], 6) for r in (first, second)]


def test_a_joiner_beside_more_decodes_than_the_budget_gets_half_the_budget_a_step(pool, checkpoint, hf_model):
    """The budget's floor on real ranks: 4 sequences decode (every row of the batch but the
    joiner's) under a budget of 4 tokens, which the decodes alone fill; the joiner's 30-token prompt
    still takes 2 tokens a step (half the budget), so it is done in 15 steps, while all 4 still
    decode (24 steps each), and every answer is what it is alone and HF's."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=96, batch=5)
    running = [{**RUNNING, "prompt_ids": prompt_of(8, salt)} for salt in range(4)]
    joiner = {"prompt_ids": PROMPT, "max_new_tokens": 6, "ignore_eos": True}
    job = ContinuousJob(running, arrivals={1: [joiner]}, env={"SHARD_STEP_TOKENS": "4"})
    results = pool.run(plan, model_dir, job)
    out = [c.token_ids for c in results[0]["output"].completions]
    took = events(results, "tokens")
    first = next(step for step, indices in took if 4 in indices)
    assert first - 1 == len(PROMPT) // 2  # joined at boundary 1: 2 tokens in each step after it
    assert all(set(range(4)) <= set(indices) for step, indices in took if step <= first)  # all 4 decoded meanwhile
    assert out == [alone(pool, model_dir, plan, r) for r in (*running, joiner)]
    assert out[4] == hf_greedy(hf_model(model_dir), PROMPT, 6)


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_joiners_at_max_len_and_a_prefix_hit_of_all_but_the_last_token_answer_as_alone(pool, checkpoint, hf_model,
                                                                                       tp, pp):
    """The longest requests `Engine.check` admits join a running batch: a prompt of maxModelLen
    tokens (three full KV blocks) for one new token (which waited forever: its decode column would
    have been maxModelLen), one of maxModelLen - 1 for two; then a prompt of 33 tokens whose first
    32 the prefix cache holds (its one computed token a chunk of its own). Each answers as alone
    and as HF, and every KV block comes back."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=48, batch=3)
    full = {"prompt_ids": prompt_of(48, 4), "max_new_tokens": 1, "ignore_eos": True}
    edge = {"prompt_ids": prompt_of(47, 5), "max_new_tokens": 2, "ignore_eos": True}
    tail = {"prompt_ids": full["prompt_ids"][:33], "max_new_tokens": 3, "ignore_eos": True}
    job = ContinuousJob([RUNNING], arrivals={1: [full, edge], 12: [tail]}, env={"SHARD_STEP_TOKENS": "8"})
    results = pool.run(plan, model_dir, job)
    out = results[0]["output"].completions
    requests = [RUNNING, full, edge, tail]
    assert [c.token_ids for c in out] == [alone(pool, model_dir, plan, r) for r in requests]
    model = hf_model(model_dir)
    assert [c.token_ids for c in out[1:]] == [hf_greedy(model, r["prompt_ids"], r["max_new_tokens"])
                                              for r in requests[1:]]
    assert out[3].cached_tokens == 32
    kv = results[0]["kv"]
    assert kv["free"] == kv["blocks"]


@cache
def _hf(model_dir, prompt: tuple[int, ...], new: int, model) -> list[int]:
    return hf_greedy(model, list(prompt), new)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=4),
       budget=st.integers(1, 7))
def test_random_arrivals_and_budgets_answer_as_hf(pool, checkpoint, hf_model, arrivals, budget):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 1, 1, max_len=64, batch=3)
    by_step: dict[int, list[dict]] = {}
    for salt, (step, length, new) in enumerate(arrivals):
        by_step.setdefault(step, []).append({"prompt_ids": prompt_of(length, salt), "max_new_tokens": new,
                                             "ignore_eos": True})
    results = pool.run(plan, model_dir, ContinuousJob([RUNNING], arrivals=by_step,
                                                      env={"SHARD_STEP_TOKENS": str(budget)}))
    model = hf_model(model_dir)
    order = [RUNNING] + [r for step in sorted(by_step) for r in by_step[step]]
    got = {tuple(c.token_ids) for c in results[0]["output"].completions}
    assert len(results[0]["output"].completions) == len(order)
    assert got == {tuple(_hf(model_dir, tuple(r["prompt_ids"]), r["max_new_tokens"], model)) for r in order}
