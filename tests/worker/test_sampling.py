"""Sampling, pure: each parameter equal to a plain per-row reference (float64, a loop over the
rows) on recorded logits, draws that follow the distribution, repeatable with a seed whatever the
batch around a row, numerically safe for every value the API accepts (the requests that once killed
a group among them), log-probabilities the model's own; and a sequence whose token cannot be chosen
or whose stop strings cannot be checked fails alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from shard_contract.wire import SEED_MAX, SEED_MIN, TEMPERATURE_MAX, GenerateRequest
from shard_worker.engine.sampling import FAILED, HostStaging, Sampler, staging_for, uniform
from shard_worker.engine.sequences import FAILED_ELSEWHERE, Rows, Sequences
from shard_worker.serving import openai


def reference(logits: torch.Tensor, request: GenerateRequest, generated: list[int]) -> torch.Tensor:
    """What a row draws from, the obvious way: token by token in float64, as vLLM orders it
    (bias, repetition over prompt and output, frequency and presence over the output; temperature;
    min_p, top_k, top_p each on what the one before kept)."""
    x = logits.double().clone()
    for token, value in request.logit_bias.items():
        x[token] += value
    seen = set(request.prompt_ids) | set(generated)
    for token in range(len(x)):
        if token in seen:
            x[token] = x[token] / request.repetition_penalty if x[token] > 0 else x[token] * request.repetition_penalty
        count = generated.count(token)
        x[token] -= request.frequency_penalty * count + request.presence_penalty * (count > 0)
    temperature = request.temperature or 1.0
    probs = ((x - x.max()) / temperature).exp()
    probs /= probs.sum()
    order = sorted(range(len(x)), key=lambda t: -float(probs[t]))
    kept = [t for t in order if probs[t] >= request.min_p * probs[order[0]]]
    kept = kept[:request.top_k] if request.top_k else kept
    mass, total, chosen = 0.0, sum(float(probs[t]) for t in kept), []
    for t in kept:
        if request.top_p < 1.0 and mass >= request.top_p * total and chosen:
            break
        chosen.append(t)
        mass += float(probs[t])
    out = torch.zeros_like(probs)
    out[chosen] = probs[chosen]
    return out / out.sum()


def sampler_for(requests: list[GenerateRequest]) -> Sampler:
    sampler = Sampler(len(requests))
    for row, request in enumerate(requests):
        sampler.place(row, request)
    return sampler


RECORDED = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)) * 3  # logits as a model gives them


@pytest.mark.parametrize("params", [
    {}, {"temperature": 0.7}, {"top_p": 0.6}, {"top_k": 5}, {"min_p": 0.2}, {"top_k": 9, "top_p": 0.5, "min_p": 0.05},
    {"presence_penalty": 1.5}, {"frequency_penalty": -0.7}, {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.5}, {"logit_bias": {3: 100.0, 5: -100.0, 60: 2.5}},
    {"temperature": 1.3, "top_p": 0.9, "presence_penalty": 0.4, "frequency_penalty": 0.8, "repetition_penalty": 1.2,
     "logit_bias": {1: -3.0}},
])
def test_the_distribution_equals_the_reference_on_recorded_logits(params):
    """Four rows with different prompts; two steps, so the penalties see generated tokens."""
    requests = [GenerateRequest(prompt_ids=[r, 10 + r, 10 + r], temperature=params.get("temperature", 1.0),
                                **{k: v for k, v in params.items() if k != "temperature"}) for r in range(4)]
    sampler = sampler_for(requests)
    generated: list[list[int]] = [[] for _ in requests]
    for step in range(3):
        logits = RECORDED.roll(step, dims=1)
        got = sampler.probabilities(logits)
        for row, request in enumerate(requests):
            torch.testing.assert_close(got[row], reference(logits[row], request, generated[row]), rtol=1e-9,
                                       atol=1e-12)
        tokens = sampler.sample(logits).to_host().tokens
        for row, token in enumerate(tokens):
            assert got[row, token] > 0, "drew a token the filters dropped"
            generated[row].append(token)


def test_greedy_takes_the_argmax_of_the_biased_and_penalised_logits():
    logits = RECORDED[:1]
    top = int(logits.argmax())
    requests = [GenerateRequest(prompt_ids=[1]), GenerateRequest(prompt_ids=[1], logit_bias={top: -100.0}),
                GenerateRequest(prompt_ids=[top], repetition_penalty=100.0)]
    tokens = sampler_for(requests).sample(logits.expand(3, -1)).to_host().tokens
    expected = [int(reference(logits[0], r, []).argmax()) for r in requests]
    assert tokens == expected and tokens[0] == top and tokens[1] != top and tokens[2] != top


def test_draws_follow_the_distribution():
    """4000 rows, one seed each, in one batch: each token's share within 5 standard deviations
    of its probability, and no token outside the kept set."""
    rows = 4000
    request = {"temperature": 0.8, "top_p": 0.9, "top_k": 6}
    logits = RECORDED[0, :10].expand(rows, -1)
    sampler = sampler_for([GenerateRequest(prompt_ids=[1], seed=s, **request) for s in range(rows)])
    probs = sampler.probabilities(logits)[0]
    counts = torch.bincount(sampler.sample(logits).tokens, minlength=10).double()
    sigma = (rows * probs * (1 - probs)).sqrt()
    assert bool(((counts - rows * probs).abs() <= 5 * sigma + 1).all()), (counts, rows * probs)
    assert bool((counts[probs == 0] == 0).all())


def test_successive_draws_of_one_row_follow_the_distribution():
    """One seed, 3000 steps: the draws of one sequence are as random as those of many."""
    logits = RECORDED[1:2, :6]
    sampler = sampler_for([GenerateRequest(prompt_ids=[1], temperature=1.0, seed=12345)])
    probs = sampler.probabilities(logits)[0]
    draws = torch.tensor([sampler.sample(logits).tokens[0] for _ in range(3000)])
    counts = torch.bincount(draws, minlength=6).double()
    sigma = (3000 * probs * (1 - probs)).sqrt()
    assert bool(((counts - 3000 * probs).abs() <= 5 * sigma + 1).all()), (counts, 3000 * probs)


def test_a_seed_repeats_whatever_the_batch_around_it():
    """The same request draws the same tokens alone, in row 3 of a batch of strangers, and
    again: its draws depend on its seed and its step alone."""
    request = GenerateRequest(prompt_ids=[1], temperature=1.0, seed=-42)
    strangers = [GenerateRequest(prompt_ids=[2], temperature=0.5, seed=s, top_p=0.5) for s in range(3)]

    def draws(requests: list[GenerateRequest], row: int) -> list[int]:
        sampler = sampler_for(requests)
        logits = RECORDED[:1, :32].expand(len(requests), -1)
        return [sampler.sample(logits).to_host().tokens[row] for _ in range(20)]

    alone = draws([request], 0)
    assert alone == draws([*strangers, request], 3) == draws([request], 0)
    other = draws([request.model_copy(update={"seed": -41})], 0)
    assert alone != other


def test_a_row_placed_again_starts_its_draws_over():
    request = GenerateRequest(prompt_ids=[1], temperature=1.0, seed=5)
    sampler = sampler_for([request])
    logits = RECORDED[:1, :32]
    first = [sampler.sample(logits).to_host().tokens[0] for _ in range(10)]
    sampler.place(0, request)
    assert [sampler.sample(logits).to_host().tokens[0] for _ in range(10)] == first


def test_logprobs_are_the_models_log_softmax_with_the_top_alternatives():
    requests = [GenerateRequest(prompt_ids=[1], temperature=1.0, seed=1, logprobs=3, presence_penalty=2.0),
                GenerateRequest(prompt_ids=[1], logprobs=0)]
    host = sampler_for(requests).sample(RECORDED[:2]).to_host()
    expected = torch.log_softmax(RECORDED[:2].float(), dim=-1)
    assert host.logprob is not None and host.top is not None
    for row, token in enumerate(host.tokens):
        assert math.isclose(host.logprob[row], float(expected[row, token]), abs_tol=1e-6)
    top = expected[0].topk(3)
    assert [t for t, _ in host.top[0]] == top.indices.tolist()
    assert [lp for _, lp in host.top[0]] == pytest.approx(top.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("temperature,top_p", [(1e-40, 1.0), (1.0, 1e-300), (5e-324, 5e-324)])
def test_the_values_that_once_failed_a_group_sample_the_most_likely_token(temperature, top_p):
    """temperature 1e-40 overflowed float32 (logits / 1e-40 = inf, softmax NaN); top_p 1e-300 is
    0 in float32 and dropped every token. Both mean: the most likely token."""
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.9]])
    request = GenerateRequest(prompt_ids=[1], temperature=temperature, top_p=top_p, seed=3)
    assert sampler_for([request]).sample(logits).to_host().tokens == [1]


def test_a_penalty_that_overflows_float64_still_gives_a_token():
    """A float32-range logit divided by a repetition penalty near 0 passes float64's range."""
    logits = torch.tensor([[3e38, 3e38, -3e38, 0.0]])
    request = GenerateRequest(prompt_ids=[0, 1, 2], temperature=1.0, repetition_penalty=1e-300, top_p=0.5)
    tokens = sampler_for([request]).sample(logits).to_host().tokens
    assert tokens[0] in (0, 1)


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_every_accepted_seed_samples(seed):
    request = GenerateRequest(prompt_ids=[1], temperature=1.0, seed=seed)
    assert 0 <= sampler_for([request]).sample(RECORDED[:1]).to_host().tokens[0] < 64


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 2**64, SEED_MIN - 1])
def test_a_seed_outside_64_bits_is_refused_by_the_contract(seed):
    with pytest.raises(ValueError, match="seed"):
        GenerateRequest(prompt_ids=[1], temperature=1.0, seed=seed)


@pytest.mark.parametrize("top_k", [2**31, 2**63, 2**64, 10**40])
def test_a_top_k_past_int64_keeps_every_token_as_0_does(top_k):
    """The contract takes any top_k >= 0; one past int64 could not be placed (torch.tensor
    overflowed), which took down every sampling rank of a group. It keeps every token: the same
    draws as top_k 0, step after step."""
    every = GenerateRequest(prompt_ids=[1, 2], temperature=1.0, seed=9, presence_penalty=-1.18)
    huge = GenerateRequest(prompt_ids=[1, 2], temperature=1.0, seed=9, presence_penalty=-1.18, top_k=top_k)
    a, b = sampler_for([every]), sampler_for([huge])
    for _ in range(5):
        assert b.sample(RECORDED[:1]).to_host().tokens == a.sample(RECORDED[:1]).to_host().tokens


float32_logits = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40)
penalty = st.floats(-2.0, 2.0, allow_subnormal=True)


@settings(max_examples=300, deadline=None)
@given(logits=float32_logits,
       temperature=st.floats(0.0, TEMPERATURE_MAX, allow_subnormal=True),
       top_p=st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True),
       min_p=st.floats(0.0, 1.0, allow_subnormal=True), top_k=st.integers(0, 50),
       presence=penalty, frequency=penalty,
       repetition=st.floats(0.0, 100.0, exclude_min=True, allow_subnormal=True),
       bias=st.dictionaries(st.integers(0, 39), st.floats(-100.0, 100.0), max_size=3),
       seed=st.integers(SEED_MIN, SEED_MAX))
def test_every_accepted_sampling_request_gets_a_token(logits, temperature, top_p, min_p, top_k, presence,
                                                      frequency, repetition, bias, seed):
    """Over the whole accepted range, and logits anywhere in float32's: a distribution (finite,
    summing to 1) and a token it gives a chance, never a failure, two steps running."""
    row = torch.tensor(logits, dtype=torch.float32)[None, :]
    request = GenerateRequest(prompt_ids=[0, 1], temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                              presence_penalty=presence, frequency_penalty=frequency,
                              repetition_penalty=repetition, logit_bias=bias, seed=seed)
    sampler = sampler_for([request])
    for _ in range(2):
        probs = sampler.probabilities(row)
        assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9)
        token = sampler.sample(row).to_host().tokens[0]
        assert 0 <= token < len(logits)
        assert temperature == 0 or probs[0, token] > 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=st.floats(0.0, TEMPERATURE_MAX, allow_subnormal=True) | st.none(),
       top_p=st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True) | st.none(),
       seed=st.integers(SEED_MIN, SEED_MAX) | st.none(),
       max_tokens=st.integers(1, 10) | st.none(),
       stop=st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1, max_size=8), max_size=4) | st.none(),
       top_k=st.integers(min_value=-1) | st.none(), presence=penalty | st.none())
def test_what_the_api_accepts_the_engine_runs(temperature, top_p, seed, max_tokens, stop, top_k, presence):
    """A body the API accepts becomes a request the contract accepts, and that request samples
    (top_k unbounded, as the API takes it)."""
    body = {"prompt": "x", "temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": max_tokens,
            "stop": stop, "top_k": top_k, "presence_penalty": presence}
    parsed = openai.parse(openai.CompletionRequest, openai_json(body))
    request = openai.to_generate(parsed, [1, 2], max_len=12, vocab_size=50, max_tokens=parsed.max_tokens,
                                 has_tokenizer=True)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    assert 0 <= sampler_for([request]).sample(logits).to_host().tokens[0] < 50


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
    tokens, failed, _ = rows.choose(0, logits)
    assert int(tokens[1]) == FAILED and 0 <= int(tokens[0]) < 20 and 0 <= int(tokens[2]) < 20
    assert list(failed) == [1] and "not finite" in failed[1] and rows.failures == failed
    again, failed_again, _ = rows.choose(1, logits[1:])  # its sequence has ended: no second failure
    assert failed_again == {} and int(again[0]) == int(logits[1].argmax())
    rows.place(1, GenerateRequest(prompt_ids=[1]), pad=0)  # a newcomer takes the row
    assert rows.failures == {}


def test_a_failed_token_ends_its_sequence_with_why_and_feeds_a_valid_token():
    seqs = Sequences(2, eos_ids=(2,))
    for row in range(2):
        seqs.start(row, GenerateRequest(prompt_ids=[1], max_new_tokens=5, ignore_eos=True))
    took = seqs.add([0, 1], [7, FAILED], failures={})
    assert [s.finished for s in took] == [False, True]
    done = took[1].completion()
    assert (done.finish_reason, done.error, done.token_ids) == ("error", FAILED_ELSEWHERE, [])
    seqs.feed([0, 1], torch.tensor([7, FAILED]))
    assert seqs.next_tokens.tolist() == [7, 0]  # row 1 may still be computed: an embedding of 0, not of -1
    assert seqs.live_span() == (0, 1) and seqs.free_rows() == [1]




# ---------------------------------------------------------------- the step's one copy to the host
class Copies(TorchDispatchMode):
    """Each copy_ dispatched, as whether it writes into `staging`'s memory."""

    def __init__(self, staging: HostStaging):
        super().__init__()
        self.lo = staging.bytes.data_ptr()
        self.hi = self.lo + staging.bytes.numel()
        self.into_staging: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.into_staging.append(self.lo <= args[0].data_ptr() < self.hi)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("logprobs", [None, 0, 3])
def test_a_cuda_ranks_step_copy_is_one_copy_into_its_staging(logprobs):
    """The structure of a CUDA rank's host copy, on the CPU: with a staging (unpinned: no CUDA
    here), `to_host` copies once, into the staging's memory, and reads what a plain copy reads
    (tokens, log-probabilities, alternatives)."""
    requests = [GenerateRequest(prompt_ids=[1], temperature=1.0, seed=r, logprobs=logprobs) for r in range(3)]
    sampled = sampler_for(requests).sample(RECORDED[:3])
    plain = sampled.to_host()
    sampled.staging = HostStaging(3, pin=False)
    with Copies(sampled.staging) as seen:
        staged = sampled.to_host()
    assert staged == plain and seen.into_staging == [True]
    with Copies(sampled.staging) as seen:  # again: the same memory, one copy
        assert sampled.to_host() == plain and seen.into_staging == [True]


def test_a_cpu_rank_has_no_staging():
    """Its tensors are on the host already: `to_host` reads them (no copy)."""
    assert staging_for(torch.device("cpu"), 4) is None
    sampled = sampler_for([GenerateRequest(prompt_ids=[1])]).sample(RECORDED[:1])
    assert sampled.staging is None
    with Copies(HostStaging(1, pin=False)) as seen:
        assert sampled.to_host().tokens == [int(RECORDED[0].argmax())]
    assert seen.into_staging == []


def test_ids_go_back_to_the_device_through_the_staging():
    """The next step's inputs from the host (another stage sampled them, or the host did): one
    copy into the staging's ids, then from there (pinned on CUDA: an asynchronous DMA)."""
    staging = HostStaging(4, pin=False)
    with Copies(staging) as seen:
        out = staging.upload(torch.tensor([5, FAILED, 9]), torch.device("cpu"))
    assert out.tolist() == [5, FAILED, 9] and staging.ids[:3].tolist() == [5, FAILED, 9]
    assert seen.into_staging == [False]  # the ids' region, not the step copy's bytes
    assert staging.ids.data_ptr() >= staging.bytes.data_ptr() + staging.bytes.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_rank_feeds_host_ids_through_pinned_memory():
    seqs = Sequences(3, eos_ids=(2,), device="cuda")
    seqs.feed([0, 2], torch.tensor([7, FAILED]))
    seqs.feed(slice(0, 3), torch.tensor([1, 2, 3]))
    staging = staging_for(torch.device("cuda"), 3)
    assert staging is not None and staging.ids.is_pinned()
    assert seqs.next_tokens.tolist() == [1, 2, 3]
    seqs.feed([1], torch.tensor([FAILED], device="cuda"))  # on the device already: no staging
    assert seqs.next_tokens.tolist() == [1, 0, 3]


def test_the_noise_is_finite_for_every_hash():
    """The hash's extremes give a uniform strictly inside (0, 1), so the Gumbel noise is finite:
    +inf noise on a token a grammar masked (-inf) made NaN, and argmax took it."""
    h = torch.tensor([0, 1, 2**31, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = uniform(h)
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())
