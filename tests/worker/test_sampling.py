"""Sampling, pure: top-p as specified, repeatable with a seed, numerically safe for every value the
API accepts (the requests that once killed a group among them), and a sequence whose token cannot
be chosen or whose stop strings cannot be checked fails alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.wire import SEED_MAX, SEED_MIN, TEMPERATURE_MAX, GenerateRequest
from shard_worker import openai
from shard_worker.sampling import FAILED, choose, generator, top_p_probs
from shard_worker.sequences import FAILED_ELSEWHERE, Rows, Sequences, SequenceState


def test_top_p_keeps_the_smallest_head_reaching_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = top_p_probs(logits, 1.0, 0.7)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8)
    assert top_p_probs(logits, 1.0, 0.01).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_seeded_sampling_repeats_and_greedy_ignores_seed():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    reqs = [GenerateRequest(prompt_ids=[1], temperature=1.0, seed=s) for s in (1, 1, 2)]
    draws = [choose(logits, reqs, [generator(r) for r in reqs])[0].tolist() for _ in range(2)]
    assert draws[0] == draws[1]
    greedy = [GenerateRequest(prompt_ids=[1])] * 3
    tokens, failed = choose(logits, greedy, [generator(r) for r in greedy])
    assert tokens.tolist() == logits.argmax(-1).tolist() and failed == {}


@pytest.mark.parametrize("temperature,top_p", [(1e-40, 1.0), (1.0, 1e-300), (5e-324, 5e-324)])
def test_the_values_that_once_failed_a_group_sample_the_most_likely_token(temperature, top_p):
    """temperature 1e-40 overflowed float32 (logits / 1e-40 = inf, softmax NaN); top_p 1e-300 is
    0 in float32 and dropped every token. Both mean: the most likely token."""
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.9]])
    request = GenerateRequest(prompt_ids=[1], temperature=temperature, top_p=top_p, seed=3)
    tokens, failed = choose(logits, [request], [generator(request)])
    assert (tokens.tolist(), failed) == ([1], {})


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_every_accepted_seed_seeds_a_generator(seed):
    request = GenerateRequest(prompt_ids=[1], temperature=1.0, seed=seed)
    assert generator(request) is not None


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 2**64, SEED_MIN - 1])
def test_a_seed_outside_64_bits_is_refused_by_the_contract(seed):
    with pytest.raises(ValueError, match="seed"):
        GenerateRequest(prompt_ids=[1], temperature=1.0, seed=seed)


float32_logits = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(logits=float32_logits,
       temperature=st.floats(0.0, TEMPERATURE_MAX, allow_subnormal=True),
       top_p=st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True),
       seed=st.integers(SEED_MIN, SEED_MAX))
def test_every_accepted_sampling_request_gets_a_token(logits, temperature, top_p, seed):
    """Over the whole accepted range, and logits anywhere in float32's: a distribution (finite,
    summing to 1, keeping a most likely token) and a token, never a failure."""
    row = torch.tensor(logits, dtype=torch.float32)
    request = GenerateRequest(prompt_ids=[1], temperature=temperature, top_p=top_p, seed=seed)
    if temperature > 0:
        probs = top_p_probs(row, temperature, top_p)
        assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9)
        unfiltered = top_p_probs(row, temperature, 1.0)
        # Of the most likely tokens (tied in float64 after the temperature), top_p may keep one only.
        assert probs[unfiltered == unfiltered.max()].sum() > 0
    tokens, failed = choose(row.view(1, -1), [request], [generator(request)])
    assert failed == {} and 0 <= int(tokens[0]) < len(logits)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=st.floats(0.0, TEMPERATURE_MAX, allow_subnormal=True) | st.none(),
       top_p=st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True) | st.none(),
       seed=st.integers(SEED_MIN, SEED_MAX) | st.none(),
       max_tokens=st.integers(1, 10) | st.none(),
       stop=st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1, max_size=8), max_size=4) | st.none())
def test_what_the_api_accepts_the_engine_runs(temperature, top_p, seed, max_tokens, stop):
    """A body the API accepts becomes a request the contract accepts, and that request samples."""
    body = {"prompt": "x", "temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": max_tokens,
            "stop": stop}
    parsed = openai.parse(openai.CompletionRequest, openai_json(body))
    request = openai.to_generate(parsed, [1, 2], max_len=12, vocab_size=50, max_tokens=parsed.max_tokens,
                                 has_tokenizer=True)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    tokens, failed = choose(logits, [request], [generator(request)])
    assert failed == {} and 0 <= int(tokens[0]) < 50


def openai_json(body: dict) -> bytes:
    import json

    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


# ---------------------------------------------------------------- a sequence fails alone
def test_a_row_whose_logits_are_not_finite_fails_alone_and_is_greedy_from_then_on():
    """Sampling raises for row 1 (its logits are NaN: a broken weight for one token, say): it gets
    FAILED and says why; row 0, sampled in the same unit, gets its token."""
    rows = Rows(3, sampler=True)
    for row in range(3):
        rows.place(row, GenerateRequest(prompt_ids=[1], temperature=1.0, seed=row), pad=0)
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    logits[1, 4] = float("nan")
    tokens, failed = rows.choose(0, logits)
    assert int(tokens[1]) == FAILED and 0 <= int(tokens[0]) < 20 and 0 <= int(tokens[2]) < 20
    assert list(failed) == [1] and "not finite" in failed[1] and rows.failures == failed
    again, failed_again = rows.choose(1, logits[1:])  # its sequence has ended: no second failure
    assert failed_again == {} and int(again[0]) == int(logits[1].argmax())
    rows.place(1, GenerateRequest(prompt_ids=[1]), pad=0)  # a newcomer takes the row
    assert rows.failures == {}


def test_a_failed_token_ends_its_sequence_with_why_and_feeds_a_valid_token():
    seqs = Sequences(2, eos_ids=(2,), tokenizer=lambda: None)
    for row in range(2):
        seqs.start(row, GenerateRequest(prompt_ids=[1], max_new_tokens=5, ignore_eos=True))
    took = seqs.add([0, 1], [7, FAILED], failures={})
    assert [s.finished for s in took] == [False, True]
    done = took[1].completion(None)
    assert (done.finish_reason, done.error, done.token_ids) == ("error", FAILED_ELSEWHERE, [])
    seqs.feed([0, 1], torch.tensor([7, FAILED]))
    assert seqs.next_tokens.tolist() == [7, 0]  # row 1 may still be computed: an embedding of 0, not of -1
    assert seqs.live_span() == (0, 1) and seqs.free_rows() == [1]


class BrokenTokenizer:
    def decode(self, ids):
        raise RuntimeError("the tokenizer broke")


def test_a_stop_string_check_that_raises_fails_that_sequence_only():
    seq = SequenceState(GenerateRequest(prompt_ids=[1], max_new_tokens=5, stop=["x"]), eos_ids=(2,))
    seq.add(7, BrokenTokenizer())
    assert seq.finish_reason == "error" and "checking its stop strings failed: RuntimeError" in seq.error
    assert seq.completion(BrokenTokenizer()).finish_reason == "error"


def test_an_answer_that_cannot_be_decoded_fails_without_changing_the_sequence():
    """Only the leader decodes every answer: its failure must not change what the TP peers share."""
    seq = SequenceState(GenerateRequest(prompt_ids=[1], max_new_tokens=1), eos_ids=(2,))
    seq.add(7, None)
    done = seq.completion(BrokenTokenizer())
    assert done.finish_reason == "error" and "decoding its tokens failed" in done.error
    assert seq.finish_reason == "length" and seq.error is None
