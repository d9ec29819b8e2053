"""Requests with a stop string, a JSON schema (`response_format` json_schema) and log-probabilities
(echo too) that join a running batch under a tiny step budget (SHARD_STEP_TOKENS): their prompts
are computed in chunks that ride with the decode rows in one fused pass (`Runner.defer`,
`Stage.forward_parts`, which counts such passes), and each answers as it does alone: the same
tokens, text and finish reason, its log-probabilities within float32 rounding. On a small demo
model (its trained BPE tokenizer spells JSON, and its stop strings are text)."""

from __future__ import annotations

import json

import pytest

from shard_contract.env import DECODE_GRAPHS_ENV
from shard_operator.local.demo_model import DemoShape, write_demo_model

from .conftest import make_plan
from .pool import ContinuousJob, GenerateJob
from .test_chunked_prefill import RUNNING, prompt_of

pytestmark = pytest.mark.slow

SHAPE = DemoShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=600, max_positions=256, files=1)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("merged") / "demo", SHAPE)


def solo(pool, model_dir, plan, request: dict):
    return pool.run(plan, model_dir, GenerateJob([request], return_logits=False))[0]["output"].completions[0]


def first_stop(text: str) -> tuple[str, int]:
    """A stop string of `text` (two characters from its middle, met nowhere earlier), and where."""
    at = next(i for i in range(len(text) // 3, len(text) - 2)
              if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    return text[at:at + 2], at


@pytest.mark.parametrize("tp", [1, 2])
def test_stop_strings_json_schemas_and_logprobs_of_merged_chunks_answer_as_alone(pool, demo, tp):
    plan = make_plan(demo, tp, 1, max_len=128, batch=4)
    free = {"prompt_ids": prompt_of(37, 1), "max_new_tokens": 24, "temperature": 0.9, "seed": 3, "ignore_eos": True}
    full = solo(pool, demo, plan, free)
    stop, at = first_stop(full.text)
    joiners = [
        {**free, "stop": [stop]},
        {"prompt_ids": prompt_of(41, 2), "max_new_tokens": 30, "temperature": 1.0, "seed": 7,
         "json_schema": json.dumps(SCHEMA)},
        {"prompt_ids": prompt_of(35, 3), "max_new_tokens": 6, "temperature": 0.8, "seed": 2, "ignore_eos": True,
         "logprobs": 3, "prompt_logprobs": True},
    ]
    running = {**RUNNING, "max_new_tokens": 70}
    job = ContinuousJob([running], arrivals={1: joiners}, env={"SHARD_STEP_TOKENS": "4", DECODE_GRAPHS_ENV: "off"})
    results = pool.run(plan, demo, job)
    # chunks rode with the decode row: most of the ~110 prompt tokens, 3 a step beside one decode
    assert results[0]["merged_passes"] >= 20
    out = results[0]["output"].completions
    for got, request in zip(out, [running, *joiners], strict=True):
        expected = solo(pool, demo, plan, request)
        assert (got.token_ids, got.text, got.finish_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason), request
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert got.prompt_logprobs == pytest.approx(expected.prompt_logprobs, abs=1e-4)
        assert [[t for t, _ in a] for a in got.top_logprobs or []] == \
            [[t for t, _ in a] for a in expected.top_logprobs or []]
    stopped, constrained, echoed = out[1:]
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:at]  # the stop string was met
    assert constrained.token_ids and constrained.text.lstrip().startswith("{")  # the grammar held
    assert len(echoed.prompt_logprobs) == 35 and len(echoed.logprobs) == 6 and len(echoed.top_logprobs[0]) == 3
