"""Grammar-constrained sampling, pure: with random logits (the worst a model can do), every row
constrained by a JSON schema ends with an end-of-sequence token after text that parses and
validates, greedy or sampled, side by side with other constrained and free rows, in rows that
held another grammar before; a schema that cannot be used fails its row alone, with why."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shard_contract.wire import GenerateRequest
from shard_operator.local.demo_model import train_tokenizer
from shard_worker.engine.grammar import JSON_OBJECT, Grammars, grammar_of
from shard_worker.engine.sampling import FAILED, Sampler

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CHOICE = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
VOCAB = 800  # the model's rows: more than the tokenizer's tokens, as checkpoints often pad


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(1024)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer.to_str(), VOCAB, [tokenizer.token_to_id("</s>")])


def run(sampler: Sampler, rows: int, steps: int, seed: int) -> list[list[int]]:
    """Decode `steps` steps of random logits; each row's tokens up to its end-of-sequence."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(steps):
        logits = torch.randn(rows, VOCAB, generator=gen) * 4
        tokens = sampler.sample(logits).to_host().tokens
        sampler.accept(0, tokens)
        for row, token in enumerate(tokens):
            out[row].append(token)
    return out


def answer(tokenizer, tokens: list[int], eos: int) -> str:
    assert eos in tokens, "the grammar never let the sequence end"
    return tokenizer.decode(tokens[:tokens.index(eos)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_row_answers_valid_json_beside_free_rows(tokenizer, grammars, temperature):
    eos = tokenizer.token_to_id("</s>")
    schemas = [PERSON, CHOICE, None, json.loads(JSON_OBJECT), CHOICE]
    requests = [GenerateRequest(prompt_ids=[1], temperature=temperature, seed=row,
                                json_schema=json.dumps(s) if s is not None else None)
                for row, s in enumerate(schemas)]
    sampler = Sampler(len(requests), lambda: grammars)
    for row, request in enumerate(requests):
        sampler.place(row, request)
    out = run(sampler, len(requests), 120, seed=int(temperature))
    for schema, tokens in zip(schemas, out, strict=True):
        if schema is None:
            continue
        assert FAILED not in tokens
        if schema == json.loads(JSON_OBJECT) and eos not in tokens:  # any object may go on past 120 tokens
            assert tokenizer.decode(tokens).startswith("{")
            continue
        jsonschema.validate(json.loads(answer(tokenizer, tokens, eos)), schema)


def test_a_row_reused_for_another_grammar_starts_afresh(tokenizer, grammars):
    eos = tokenizer.token_to_id("</s>")
    sampler = Sampler(1, lambda: grammars)
    for i, schema in enumerate([PERSON, CHOICE, PERSON]):
        sampler.place(0, GenerateRequest(prompt_ids=[1], temperature=1.0, seed=i, json_schema=json.dumps(schema)))
        tokens = run(sampler, 1, 80, seed=i)[0]
        jsonschema.validate(json.loads(answer(tokenizer, tokens, eos)), schema)


def test_an_unusable_schema_fails_its_row_alone(grammars):
    sampler = Sampler(2, lambda: grammars)
    sampler.place(0, GenerateRequest(prompt_ids=[1], json_schema='{"type": "no such type"}'))
    sampler.place(1, GenerateRequest(prompt_ids=[1], temperature=1.0, json_schema=json.dumps(CHOICE)))
    tokens = sampler.sample(torch.randn(2, VOCAB)).to_host().tokens
    assert tokens[0] == FAILED and tokens[1] != FAILED
    why = sampler.failures(tokens)
    assert list(why) == [0] and "JSON schema" in why[0]


def test_without_a_tokenizer_a_constrained_row_fails_alone():
    sampler = Sampler(1)
    sampler.place(0, GenerateRequest(prompt_ids=[1], json_schema=JSON_OBJECT))
    tokens = sampler.sample(torch.randn(1, VOCAB)).to_host().tokens
    assert tokens == [FAILED] and "tokenizer.json" in sampler.failures(tokens)[0]


def test_schemas_are_checked_before_any_tokenizer():
    assert grammar_of(json.dumps(PERSON))
    with pytest.raises(ValueError, match="JSON schema"):
        grammar_of("[1, 2")
