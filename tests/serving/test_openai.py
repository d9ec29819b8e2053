"""The OpenAI wire format, pure: what is refused (and how it is said), what the engine is asked to
run, and streamed text that never needs taking back."""

from __future__ import annotations

import pytest

from shard_worker.serving import openai
from shard_worker.serving.openai import ApiError, ChatRequest, CompletionRequest


def refused(model, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        openai.parse(model, body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body,param,message", [
    (b'{"prompt": "x"', None, "not valid JSON"),
    (b'[1, 2]', None, "Input should be an object"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens", "greater than or equal to 0 (got -1)"),
    (b'{"prompt": "x", "max_tokens": "10"}', "max_tokens", "valid integer (got '10')"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature", "valid number"),
    (b'{"prompt": "x", "temperature": 3}', "temperature", "less than or equal to 2"),
    (b'{"prompt": "x", "top_p": 0}', "top_p", "greater than 0"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "valid boolean"),
    (b'{"prompt": "x", "stop": 5}', "stop", None),
    (b'{"prompt": {"text": "x"}}', "prompt", None),
    (b'{"max_tokens": 3}', "prompt", "Field required"),
    (b'{"prompt": "x", "colour": "blue"}', "colour", "colour: not supported by this server"),
    (b'{"prompt": "x", "suffix": "y"}', "suffix", "suffix: not supported by this server (Llama-family"),
    (b'{"prompt": "x", "n": 17}', "n", "less than or equal to 16 (got 17)"),
    (b'{"prompt": "x", "logprobs": 21}', "logprobs", "less than or equal to 20 (got 21)"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty", "less than or equal to 2"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias", "less than or equal to 100"),
    (b'{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty", "greater than 0"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop", "at most 4 items"),
    (b'{"prompt": "x", "stop": ["a", ""]}', "stop.1", "at least 1 character"),
    # the ranges of OpenAI's API: a seed is a signed 64-bit integer; no NaN or infinity anywhere
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed", "less than or equal to 9223372036854775807"),
    (b'{"prompt": "x", "seed": -9223372036854775809}', "seed", "greater than or equal to"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature", None),
    (b'{"prompt": "x", "top_p": Infinity}', "top_p", None),
    (b'{"prompt": "\\ud800"}', None, "not valid JSON"),  # a lone surrogate: no text to tokenize
])
def test_bad_completion_bodies_are_400_naming_the_field(body, param, message):
    err = refused(CompletionRequest, body)
    assert err.param == param
    if message:
        assert message in err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


def test_a_whole_number_is_an_integer_whatever_its_spelling():
    body = openai.parse(CompletionRequest, b'{"prompt": [[5.0, 6]], "max_tokens": 8.0, "seed": -3.0}')
    assert (body.prompt, body.max_tokens, body.seed) == ([[5, 6]], 8, -3)
    assert refused(CompletionRequest, b'{"prompt": "x", "max_tokens": 8.5}').param == "max_tokens"


def test_chat_bodies():
    err = refused(ChatRequest, b'{"messages": []}')
    assert err.param == "messages"
    err = refused(ChatRequest, b'{"messages": [{"role": "robot", "content": "hi"}]}')
    assert err.param == "messages.0.role"
    body = openai.parse(ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                                     b'{"type": "text", "text": "b"}]}], "max_completion_tokens": 5}')
    assert body.messages[0].text() == "ab" and body.max_completion_tokens == 5


@pytest.mark.parametrize("prompt,expected", [
    ('"hello"', ["hello"]), ("[5, 6]", [[5, 6]]), ('["hello"]', ["hello"]), ("[[5, 6]]", [[5, 6]]),
    ('["a", "b"]', ["a", "b"]), ("[[1], [2, 3]]", [[1], [2, 3]]),
])
def test_prompts_as_text_or_ids_one_or_a_list(prompt, expected):
    assert openai.prompts_of(openai.parse(CompletionRequest, f'{{"prompt": {prompt}}}'.encode())) == expected


@pytest.mark.parametrize("prompt", ['""', "[]", '["a", ""]', "[[1], []]", str([[1]] * 33)])
def test_empty_prompts_or_too_many_are_refused(prompt):
    with pytest.raises(ApiError, match="prompt") as info:
        openai.prompts_of(openai.parse(CompletionRequest, f'{{"prompt": {prompt}}}'.encode()))
    assert info.value.status == 400
    error = info.value.body()["error"]
    assert (error["type"], error["param"].split(".")[0], error["code"]) == ("invalid_request_error", "prompt", None)


def test_the_documented_schema_carries_the_accepted_ranges():
    schemas = openai.request_schemas("llama", vocab_size=100, max_len=64)
    fields = schemas["CompletionRequest"]["properties"]
    temperature, top_p, seed = (fields[name]["anyOf"][0] for name in ("temperature", "top_p", "seed"))
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0.0, 1.0)
    assert (seed["minimum"], seed["maximum"]) == (-2**63, 2**63 - 1)
    assert (fields["n"]["minimum"], fields["n"]["maximum"]) == (1, 16)
    assert "suffix" not in fields and {"echo", "logprobs", "best_of", "logit_bias", "top_k"} <= set(fields)
    assert {"response_format", "tools", "tool_choice", "top_logprobs"} <= set(schemas["ChatRequest"]["properties"])
    # what only the group knows: its model, its vocabulary, its context
    assert fields["model"]["anyOf"][0]["enum"] == ["llama"]
    assert (fields["max_tokens"]["anyOf"][0]["minimum"], fields["max_tokens"]["anyOf"][0]["maximum"]) == (0, 64)
    ids = fields["prompt"]["anyOf"][1]["items"]
    assert (ids["minimum"], ids["maximum"]) == (0, 99) and "x-group-limit" not in str(schemas)
    assert fields["stop"]["anyOf"][1]["maxItems"] == 4 and fields["stop"]["anyOf"][0]["minLength"] == 1
    assert set(schemas) >= {"CompletionRequest", "ChatRequest", "ChatMessage"}
    assert openai.request_body(ChatRequest)["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatRequest"}


def generate(body: str, ids: list[int], max_tokens: int | None = 4, has_tokenizer: bool = True):
    return openai.to_generate(openai.parse(CompletionRequest, body.encode()), ids, max_len=10, vocab_size=100,
                              max_tokens=max_tokens, has_tokenizer=has_tokenizer)


def test_what_the_engine_runs():
    g = generate('{"prompt": "x", "temperature": 0, "stop": "ab", "stop_token_ids": [7], "ignore_eos": true}',
                 [1, 2, 3], max_tokens=8)
    assert (g.prompt_ids, g.max_new_tokens, g.temperature, g.top_p) == ([1, 2, 3], 8, 0.0, 1.0)
    assert (g.stop, g.stop_token_ids, g.ignore_eos) == (["ab"], [7], True)
    # OpenAI's defaults: temperature 1, and without a seed each request samples differently
    a, b = generate('{"prompt": "x"}', [1]), generate('{"prompt": "x"}', [1])
    assert a.temperature == 1.0 and a.seed != b.seed
    assert generate('{"prompt": "x", "seed": 5}', [1]).seed == 5
    # no max_tokens (chat): as many as the context holds; P + M - 1 positions
    assert generate('{"prompt": "x"}', [1, 2, 3], max_tokens=None).max_new_tokens == 8
    assert generate('{"prompt": "x"}', [1, 2, 3], max_tokens=8).max_new_tokens == 8
    # the sampling extensions and penalties, as the engine takes them
    g = generate('{"prompt": "x", "top_k": -1, "min_p": 0.1, "presence_penalty": -2, "frequency_penalty": 1.5, '
                 '"repetition_penalty": 1.1, "logit_bias": {"7": -100, "9": 5.5}}', [1])
    assert (g.top_k, g.min_p, g.presence_penalty, g.frequency_penalty) == (0, 0.1, -2.0, 1.5)
    assert (g.repetition_penalty, g.logit_bias) == (1.1, {7: -100.0, 9: 5.5})


def test_choices_sample_with_successive_seeds_wrapping_in_64_bits():
    base = generate('{"prompt": "x", "seed": 9223372036854775806}', [1])
    seeds = [openai.choice_request(base, i).seed for i in range(3)]
    assert seeds == [2**63 - 2, 2**63 - 1, -2**63]


@pytest.mark.parametrize("ids,max_tokens,has_tokenizer,body,param,message", [
    ([1] * 11, 1, True, "{}", "prompt", "11 tokens; this model's maximum context length (maxModelLen) is 10"),
    ([1, 2, 3], 9, True, "{}", "max_tokens", "3 prompt tokens + 9 new tokens exceed"),
    ([1, 100], 2, True, "{}", "prompt", r"token ids [100] are outside the vocabulary [0, 100)"),
    ([1, 2], 2, False, '{"stop": "x"}', "stop", "stop strings need the model's tokenizer.json"),
    ([1, 2], 2, True, '{"stop_token_ids": [100]}', "stop_token_ids", "ids must lie in [0, 100)"),
    ([1, 2], 2, True, '{"logit_bias": {"100": 1}}', "logit_bias", "keys are token ids in [0, 100)"),
    ([1, 2], 2, True, '{"logit_bias": {"-1": 1}}', "logit_bias", "keys are token ids"),
    # digits str.isdigit takes and int() refuses, and more digits than int() takes: once a 500
    ([1, 2], 2, True, '{"logit_bias": {"\u00b2": 1}}', "logit_bias", "keys are token ids"),
    ([1, 2], 2, True, '{"logit_bias": {"' + "9" * 5000 + '": 1}}', "logit_bias", "keys are token ids"),
])
def test_limits_of_the_group(ids, max_tokens, has_tokenizer, body, param, message):
    with pytest.raises(ApiError) as info:
        generate(body[:-1] + (', ' if body != "{}" else "") + '"prompt": "x"}', ids, max_tokens, has_tokenizer)
    assert (info.value.status, info.value.param) == (400, param)
    assert message in info.value.message
