"""Generation semantics on real ranks: seeded sampling identical on every TP rank, and the three
ways a sequence stops (EOS, stop strings, max tokens)."""

from __future__ import annotations

import json
import shutil

import pytest

from .conftest import make_plan
from .pool import GenerateJob, JobFailed

PROMPT = [3, 17, 42, 99, 7, 200, 64, 11]
pytestmark = pytest.mark.slow


def generate(pool, model_dir, plan, **request) -> list[dict]:
    job = GenerateJob([{"prompt_ids": PROMPT, "max_new_tokens": 8, **request}], return_logits=False)
    return pool.run(plan, model_dir, job)


def decode(tokens: list[int]) -> str:
    """What the test tokenizer (word `w<id>` per token, ids 0-2 special) decodes."""
    return " ".join(f"w{t}" for t in tokens if t > 2)


def completion(results: list[dict]):
    return results[0]["output"].completions[0]


def test_seeded_sampling_is_identical_on_tp_ranks_and_repeatable(pool, checkpoint):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2, 1)
    first = generate(pool, model_dir, plan, temperature=1.5, top_p=0.95, seed=7, ignore_eos=True)
    # rank 1 sampled on its own, from its own copy of the gathered logits
    assert first[1]["output"].completions[0].token_ids == completion(first).token_ids
    again = generate(pool, model_dir, plan, temperature=1.5, top_p=0.95, seed=7, ignore_eos=True)
    other = generate(pool, model_dir, plan, temperature=1.5, top_p=0.95, seed=8, ignore_eos=True)
    greedy = generate(pool, model_dir, plan, ignore_eos=True)
    nucleus_of_one = generate(pool, model_dir, plan, temperature=1.5, top_p=1e-6, seed=7, ignore_eos=True)
    assert completion(again).token_ids == completion(first).token_ids
    assert completion(other).token_ids != completion(first).token_ids
    assert completion(first).token_ids != completion(greedy).token_ids
    assert completion(nucleus_of_one).token_ids == completion(greedy).token_ids


def test_stops(pool, checkpoint, tmp_path):
    model_dir = checkpoint("llama-4layers")
    plan = make_plan(model_dir, 2, 1)
    full = completion(generate(pool, model_dir, plan, ignore_eos=True))
    tokens = full.token_ids
    assert full.finish_reason == "length" and len(tokens) == 8
    assert full.text == decode(tokens)

    # a stop token: generation ends with it
    at = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 2)
    by_id = completion(generate(pool, model_dir, plan, stop_token_ids=[tokens[at]], ignore_eos=True))
    assert (by_id.token_ids, by_id.finish_reason) == (tokens[:at + 1], "stop")

    # a stop string spanning two tokens: generation ends where the text first holds it, and the
    # text stops before it
    stop = f"{decode(tokens[3:4])} {decode(tokens[4:5])}"
    ends = next(n for n in range(1, 9) if stop in decode(tokens[:n]))
    by_text = completion(generate(pool, model_dir, plan, stop=[stop], ignore_eos=True))
    assert (by_text.token_ids, by_text.finish_reason) == (tokens[:ends], "stop")
    assert by_text.text == full.text[:full.text.index(stop)]

    # EOS from config.json, unless ignore_eos; a second EOS id the answer never holds changes nothing
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    config = json.loads((eos_dir / "config.json").read_text())
    unused = next(t for t in range(config["vocab_size"]) if t not in tokens)
    (eos_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [tokens[at], unused]}))
    (eos_dir / "generation_config.json").unlink()
    eos_plan = make_plan(eos_dir, 2, 1)
    by_eos = completion(generate(pool, eos_dir, eos_plan))
    assert (by_eos.token_ids, by_eos.finish_reason) == (tokens[:at + 1], "stop")


@pytest.mark.parametrize("request_args,message", [
    ({"prompt_ids": [1] * 60, "max_new_tokens": 8}, "exceeds maxModelLen 64"),
    ({"prompt_ids": [1, 250], "max_new_tokens": 2}, r"token ids \[250\] are outside the vocabulary \[0, 250\)"),
])
def test_bad_requests_are_refused_before_any_work(pool, checkpoint, request_args, message):
    model_dir = checkpoint("llama")
    with pytest.raises(JobFailed, match=message) as info:
        pool.run(make_plan(model_dir, 1, 1), model_dir, GenerateJob([request_args]))
    assert info.value.kind == "RequestError"
