"""Log-probabilities on real ranks equal HF transformers' for the same checkpoint and tokens
(float32, within 1e-4): each generated token's with its top alternatives, and the prompt's own
(echo), computed in the prefill: for a batch of prompts of different lengths (left padding), for a
request that joins a running batch, and across TP and PP (where the last stage sends them back)."""

from __future__ import annotations

import pytest
import torch

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob

pytestmark = pytest.mark.slow

LONG = [3, 17, 42, 99, 7, 200, 64, 11, 5, 90]
SHORT = [8, 1, 77, 120]


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at every position of `ids` (position i predicts ids[i + 1])."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(completion, prompt: list[int], model, top: int | None, echo: bool) -> None:
    tokens = completion.token_ids
    lp = hf_logprobs(model, prompt + tokens)
    if echo:
        assert completion.prompt_logprobs[0] is None and len(completion.prompt_logprobs) == len(prompt)
        expected = [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert completion.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    else:
        assert completion.prompt_logprobs is None
    if top is None:
        assert completion.logprobs is None
        return
    at = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    assert completion.logprobs == pytest.approx([float(lp[i, t]) for i, t in zip(at, tokens, strict=True)],
                                                abs=1e-4)
    for i, alternatives in zip(at, completion.top_logprobs, strict=True):
        assert len(alternatives) == top
        theirs = lp[i].topk(top)
        assert [v for _, v in alternatives] == pytest.approx(theirs.values.tolist(), abs=1e-4)
        assert all(abs(float(lp[i, t]) - v) < 1e-4 for t, v in alternatives)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_logprobs_and_echo_equal_hf(pool, checkpoint, hf_model, tp, pp):
    model_dir = checkpoint("llama-4layers")
    requests = [
        {"prompt_ids": LONG, "max_new_tokens": 5, "ignore_eos": True, "logprobs": 3, "prompt_logprobs": True,
         "temperature": 1.2, "seed": 4, "presence_penalty": 1.0},
        {"prompt_ids": SHORT, "max_new_tokens": 4, "ignore_eos": True, "logprobs": 0, "prompt_logprobs": True},
        {"prompt_ids": SHORT, "max_new_tokens": 3, "ignore_eos": True},
    ]
    results = pool.run(make_plan(model_dir, tp, pp, batch=4), model_dir, GenerateJob(requests, return_logits=False))
    out = results[0]["output"].completions
    model = hf_model(model_dir)
    check(out[0], LONG, model, 3, echo=True)
    check(out[1], SHORT, model, 0, echo=True)
    check(out[2], SHORT, model, None, echo=False)


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_a_joiner_gets_its_logprobs_and_echo(pool, checkpoint, hf_model, tp, pp):
    model_dir = checkpoint("llama-4layers")
    first = {"prompt_ids": LONG, "max_new_tokens": 12, "ignore_eos": True}
    joiner = {"prompt_ids": SHORT, "max_new_tokens": 1, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": True}
    later = {"prompt_ids": SHORT[:3], "max_new_tokens": 3, "ignore_eos": True, "logprobs": 1}
    job = ContinuousJob([first], arrivals={2: [joiner, later]})
    results = pool.run(make_plan(model_dir, tp, pp, max_len=64, batch=2), model_dir, job)
    out = results[0]["output"].completions
    model = hf_model(model_dir)
    check(out[0], LONG, model, None, echo=False)
    check(out[1], SHORT, model, 2, echo=True)
    check(out[2], SHORT[:3], model, 1, echo=False)
