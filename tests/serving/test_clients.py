"""Real clients against a served demo model (random weights: the checks are on the protocol): the
official `openai` package (completions, chat, streaming, logprobs equal to HF's, echo, n, best_of,
prompt lists, response_format json_schema whose every answer parses and validates, also under
concurrency, tools), the server's own /tokenize, /detokenize, /version and token counters; and
EleutherAI's lm-eval with its local-completions model on a small local task (loglikelihood and
generate_until), finishing with scores."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch

from tests.support.checkpoints import load_hf

from . import lmeval
from .conftest import shardctl_run, sharded_model_yaml

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# A chat template that offers tools, as Hermes' and Llama 3.1's do.
TOOLS_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
                  "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                                          "celsius": {"type": "boolean"}},
                                                           "required": ["city", "celsius"],
                                                           "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("clients") / "tiny"
    shutil.copytree(tiny_model, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yaml_file = sharded_model_yaml(tmp_path_factory.mktemp("clients") / "tiny.yaml", model_dir, name="tiny",
                                   tensor=1, pipeline=1, batch=4, max_len=512)
    with shardctl_run(yaml_file, "tiny", "--devices", "localhost:1GiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def tokenize(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_completion_logprobs_and_echo_equal_hf(server, client, hf):
    prompt = "The lighthouse keeper climbed"
    ids = tokenize(server, prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                    echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    generated = choice.token_ids  # type: ignore[attr-defined]
    lp = hf_logprobs(hf, ids + generated)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 4 and logprobs.token_logprobs[0] is None
    expected = [float(lp[i - 1, t]) for i, t in enumerate(ids + generated) if i > 0]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for position, top in enumerate(logprobs.top_logprobs[1:]):
        assert max(top.values()) == pytest.approx(float(lp[position].max()), abs=1e-4)
    assert choice.text.startswith(prompt) and out.usage.prompt_tokens == len(ids)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    # max_tokens 0 with echo: the prompt alone, as evaluation harnesses ask
    alone = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert alone.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:len(ids)]
    assert alone.usage.completion_tokens == 0


def test_n_best_of_and_prompt_lists(client):
    many = client.completions.create(model="tiny", prompt=["Once upon", "The sea"], n=2, max_tokens=6, seed=11,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt=["Once upon", "The sea"], n=2, max_tokens=6, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # reproducible with a seed
    assert many.choices[0].text != many.choices[1].text  # distinct seeds, distinct answers
    assert many.usage.completion_tokens == 24
    best = client.completions.create(model="tiny", prompt="Once upon", n=1, best_of=3, max_tokens=5, seed=11,
                                     extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.choices[0].logprobs is None


def test_streaming_n_choices_equal_the_whole_answer(client):
    args = {"model": "tiny", "prompt": "The sea", "n": 2, "max_tokens": 6, "seed": 3, "logprobs": 1,
            "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args)
    texts, logprobs = ["", ""], [[], []]
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                logprobs[choice.index] += choice.logprobs.token_logprobs
    assert texts == [c.text for c in whole.choices]
    assert logprobs == [c.logprobs.token_logprobs for c in whole.choices]


def test_chat_logprobs_and_streaming(client):
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
                                         temperature=0, n=2)
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content  # greedy
    content = out.choices[0].logprobs.content
    assert len(content) == len(out.choices[0].token_ids)  # type: ignore[attr-defined]
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].message.content


def test_json_schema_answers_parse_and_validate_even_four_at_a_time(client):
    def ask(seed: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Describe a person."}], max_tokens=120, seed=seed,
            temperature=1.0, response_format={"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": PERSON, "strict": True}})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(8)))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({a.choices[0].message.content for a in answers}) > 1
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                         max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


def test_tools_calls_are_parsed_back(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice=choice,
                                             max_tokens=60, temperature=0.8, seed=5)
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_unsupported_parameters_are_named(client):
    with pytest.raises(openai.BadRequestError, match="suffix: not supported by this server"):
        client.completions.create(model="tiny", prompt="x", suffix="y")
    with pytest.raises(openai.BadRequestError, match="audio: not supported by this server"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"audio": {"voice": "alloy", "format": "wav"}})


def test_tokenize_detokenize_version_models_and_counters(server):
    ids = tokenize(server, "The sea")
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"].endswith("The sea")
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert chat.json()["count"] == len(chat.json()["tokens"]) > 2
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]
    assert httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 512
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    counters = {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith(("shard_prompt_tokens_total", "shard_generation_tokens_total"))}
    assert counters["shard_prompt_tokens_total"] > 0 and counters["shard_generation_tokens_total"] > 0
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert {"/tokenize", "/detokenize", "/version", "/v1/completions"} <= set(spec["paths"])


def test_lm_eval_local_completions_scores_a_local_task(server, client, model_dir, hf, tmp_path):
    """lm-eval (in its own venv: tests/serving/lmeval.py) scores lmeval_tasks/ through /v1/completions:
    the loglikelihood of each of 6 choices it parsed equals HF's for the tokens it split off, and each
    of 3 greedy answers cut at "." equals the server's own answer to the same token prompt."""
    from transformers import AutoTokenizer

    out = lmeval.evaluate(
        ["shard_choice", "shard_gen"], tmp_path,
        model_args=f"model=tiny,base_url={server.url}/v1/completions,tokenizer={model_dir},"
                   "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,batch_size=2")
    scores, samples = out["results"], out["samples"]
    assert any(abs(scores["shard_choice"]["acc,none"] - k / 3) < 1e-9 for k in range(4))  # 3 questions
    assert any(abs(scores["shard_gen"]["exact_match,none"] - k / 3) < 1e-9 for k in range(4))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731 (as lm-eval's)
    choices = [(arguments, resp) for sample in samples["shard_choice"]
               for arguments, resp in zip(sample["arguments"], sample["filtered_resps"], strict=True)]
    assert len(choices) == 6
    for (context, continuation), (loglikelihood, _greedy) in choices:
        whole, head = encode(context + continuation), encode(context)
        logprobs = hf_logprobs(hf, whole)
        expected = sum(logprobs[at - 1, whole[at]].item() for at in range(len(head), len(whole)))
        assert abs(float(loglikelihood) - expected) < 1e-3, (context, continuation)

    assert len(samples["shard_gen"]) == 3
    for sample in samples["shard_gen"]:
        (context, _kwargs), answer = sample["arguments"][0], sample["filtered_resps"][0]
        ours = client.completions.create(model="tiny", prompt=encode(context), max_tokens=8, temperature=0,
                                         stop=["."])
        assert answer == ours.choices[0].text, context
