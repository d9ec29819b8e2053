"""Continuous batching on real ranks: a request that joins a running batch at a decode step
boundary answers exactly what it answers alone (greedy and seeded sampling, TP and PP), finishes
and is handed back before the long request it joined, and its row is reused by the next one."""

from __future__ import annotations

import pytest

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob

pytestmark = pytest.mark.slow

LONG = {"prompt_ids": [3, 17, 42, 99, 7, 200, 64, 11], "max_new_tokens": 20, "ignore_eos": True}
GREEDY = {"prompt_ids": [5, 9, 33], "max_new_tokens": 4, "ignore_eos": True}
SAMPLED = {"prompt_ids": [8, 1, 77, 120, 4, 61], "max_new_tokens": 5, "temperature": 1.3, "top_p": 0.9,
           "seed": 5, "ignore_eos": True}


def alone(pool, model_dir, plan, request: dict) -> list[int]:
    results = pool.run(plan, model_dir, GenerateJob([request], return_logits=False))
    return results[0]["output"].completions[0].token_ids


@pytest.mark.parametrize("model,tp,pp", [("llama-4layers", 1, 1), ("llama-4layers", 2, 1),
                                         ("llama-4layers", 1, 2), ("llama-4layers", 2, 2), ("mistral", 1, 1)])
def test_joiners_answer_as_alone_finish_first_and_reuse_a_row(pool, checkpoint, model, tp, pp):
    model_dir = checkpoint(model)
    plan = make_plan(model_dir, tp, pp, max_len=64, batch=2)
    # the long one runs alone in row 0; at the second step boundary two arrive: one joins row 1,
    # the other waits for that row to free up
    results = pool.run(plan, model_dir, ContinuousJob([LONG], arrivals={2: [GREEDY, SAMPLED]}))
    completions = [c.token_ids for c in results[0]["output"].completions]
    assert completions == [alone(pool, model_dir, plan, r) for r in (LONG, GREEDY, SAMPLED)]
    assert [len(c) for c in completions] == [20, 4, 5]
    for peer in results[1:plan.tensor_parallel]:  # the first stage's TP peers ran the same batch
        assert [c.token_ids for c in peer["output"].completions] == completions

    events = results[0]["events"]
    joins = [e[1:] for e in events if e[0] == "join"]  # (step, column, index)
    finishes = [e[1:] for e in events if e[0] == "finished"]  # (step, index, row)
    assert [(index, row) for _, index, row in finishes] == [(1, 1), (2, 1), (0, 0)]  # joiners first, in row 1
    assert joins[0] == (2, 10, 1)  # at once: its prompt ends at column 8 + 2 decode steps
    assert joins[1][0] == finishes[0][0] and joins[1][2] == 2  # at the boundary where row 1 freed
    assert finishes[1][0] < finishes[2][0]  # while the long one still ran


def test_joiners_that_stop_at_once_or_on_a_stop_string_free_their_rows(pool, checkpoint):
    """A one-token joiner is answered in the step it joins at; a joiner with a stop string stops
    where it stops alone (text included); their row serves the next arrival."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2, 1, max_len=64, batch=2)
    one_token = {**GREEDY, "max_new_tokens": 1}
    full = alone(pool, model_dir, plan, {**SAMPLED, "max_new_tokens": 8})
    def text(ids: list[int]) -> str:  # the test tokenizer decodes token t as "w<t>"
        return " ".join(f"w{t}" for t in ids)

    # the first token from the third on whose word is not met earlier (w14 is in w145)
    k = next(k for k in range(2, 8) if text(full[:k + 1]).find(f"w{full[k]}") == len(text(full[:k])) + 1)
    stop = f"w{full[k]}"
    stopping = {**SAMPLED, "max_new_tokens": 8, "stop": [stop]}
    results = pool.run(plan, model_dir, ContinuousJob([LONG], arrivals={1: [one_token, stopping, GREEDY]}))
    completions = results[0]["output"].completions
    assert [c.token_ids for c in completions] == [alone(pool, model_dir, plan, r)
                                                  for r in (LONG, one_token, stopping, GREEDY)]
    assert completions[2].token_ids == full[:k + 1] and stop not in completions[2].text
    joins = [e[1:] for e in results[0]["events"] if e[0] == "join"]
    finishes = [e[1:] for e in results[0]["events"] if e[0] == "finished"]
    assert [(step, index) for step, _, index in joins][:2] == [(1, 1), (2, 2)]  # row 1 is free again at once
    assert [(index, row) for _, index, row in finishes] == [(1, 1), (2, 1), (3, 1), (0, 0)]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_cancelled_sequence_stops_at_the_next_step_and_its_row_serves_the_next_arrival(pool, checkpoint, tp, pp):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=64, batch=2)
    # rows 0 and 1 run two long requests; at step 3 the client of the first leaves and a short
    # request arrives: it takes row 0 at once; the batch ends when the second long one does
    results = pool.run(plan, model_dir, ContinuousJob([LONG, {**LONG, "prompt_ids": [9, 4, 1]}],
                                                      arrivals={3: [GREEDY]}, cancels={3: [0]}))
    completions = results[0]["output"].completions
    long_alone, second_alone, greedy_alone = (alone(pool, model_dir, plan, r)
                                              for r in (LONG, {**LONG, "prompt_ids": [9, 4, 1]}, GREEDY))
    assert completions[0].finish_reason == "cancelled"
    assert completions[0].token_ids == long_alone[:4]  # the prefill's token and one per step before 3
    assert [c.token_ids for c in completions[1:]] == [second_alone, greedy_alone]
    for peer in results[1:plan.tensor_parallel]:
        assert [c.token_ids for c in peer["output"].completions] == [c.token_ids for c in completions]
    events = results[0]["events"]
    assert ("cancel", 3, 0) in events and ("join", 3, 11, 2) in events  # column 8 + 3
    assert [e[2:] for e in events if e[0] == "finished"] == [(2, 0), (1, 1)]  # the cancelled one is not answered


def test_when_every_client_leaves_the_generate_ends_at_once(pool, checkpoint):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2, 1, max_len=64, batch=2)
    results = pool.run(plan, model_dir, ContinuousJob([LONG], arrivals={}, cancels={2: [0]}))
    (completion,) = results[0]["output"].completions
    assert completion.finish_reason == "cancelled" and len(completion.token_ids) == 3
    assert results[0]["output"].decode_steps == 2
    assert results[1]["output"].decode_steps == 2  # the TP peer stopped with it


@pytest.mark.parametrize("order", ["short first", "long first"])
def test_rows_whose_sequences_finished_are_not_computed_at_the_edges(pool, checkpoint, order):
    """A batch of a 3-token and a 10-token request: once the short one stops, each decode step
    computes the long one's row alone, and the tokens stay what each gets alone."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2, 1, max_len=64, batch=2)
    short, long = {**GREEDY, "max_new_tokens": 3}, {**LONG, "max_new_tokens": 10}
    batch = [short, long] if order == "short first" else [long, short]
    results = pool.run(plan, model_dir, GenerateJob(batch, return_logits=False))
    output = results[0]["output"]
    assert [c.token_ids for c in output.completions] == [alone(pool, model_dir, plan, r) for r in batch]
    assert output.decode_steps == 9
    assert output.decode_rows == 2 * 2 + 7 * 1  # both rows for the short one's 2 steps, then one
    assert results[1]["output"].decode_rows == output.decode_rows  # the TP peer computed the same


SHARED = [(7 * i + 3) % 240 + 2 for i in range(40)]  # a system prompt: two full KV blocks of 16 and a bit


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_a_joiner_takes_a_shared_prompts_cached_blocks_and_answers_as_alone(pool, checkpoint, tp, pp):
    """The paged KV cache's prefix cache on real ranks: a joiner whose prompt starts with the
    running sequence's prompt takes its full blocks (32 tokens) from the prefix cache, computes
    only the rest (on every stage, reading the shared blocks through its block table), and
    answers what it answers alone; a request that asks for its prompt's log-probabilities
    computes its whole prompt."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, tp, pp, max_len=128, batch=3)
    first = {"prompt_ids": SHARED + [5, 6, 7], "max_new_tokens": 12, "ignore_eos": True}
    joiner = {"prompt_ids": SHARED + [9, 4], "max_new_tokens": 6, "ignore_eos": True}
    echo = {**joiner, "prompt_logprobs": True, "max_new_tokens": 3}
    results = pool.run(plan, model_dir, ContinuousJob([first], arrivals={2: [joiner, echo]}))
    completions = results[0]["output"].completions
    assert [c.cached_tokens for c in completions] == [0, 32, 0]
    assert [c.token_ids for c in completions] == [alone(pool, model_dir, plan, r) for r in (first, joiner, echo)]


def test_a_top_k_past_int64_is_served_by_every_sampling_rank_of_a_pipeline(pool, checkpoint):
    """The contract and the API take any top_k >= 0. One past int64 could not be placed in the
    sampler (torch.tensor overflows), so every sampling rank raised: under pipeline parallelism
    those are the last stage's, all followers, and the group died under a schemathesis chat
    request (`tests/serving/test_attacks.py`). It keeps every token, as top_k 0 does: whether it
    starts the batch or joins it (placed at once, or when its chunked prompt is done)."""
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2, 2, max_len=64, batch=2)
    huge = {"top_k": 2**64, "presence_penalty": -1.18}
    first, joiner = {**SAMPLED, **huge}, {**LONG, **huge, "temperature": 0.9, "seed": 11, "max_new_tokens": 6}
    results = pool.run(plan, model_dir, ContinuousJob([first], arrivals={1: [joiner]},
                                                      env={"SHARD_STEP_TOKENS": "3"}))
    completions = [c.token_ids for c in results[0]["output"].completions]
    as_all = [{**r, "top_k": 0} for r in (first, joiner)]
    assert completions == [alone(pool, model_dir, plan, r) for r in as_all]
