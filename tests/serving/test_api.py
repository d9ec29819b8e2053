"""The API over real HTTP, against one group started by `shardctl run` (TP=2: two real
`python -m shard_worker` processes) and shared by every test of this module: it answers what
`shardctl generate` answers, streams, lets requests join a running batch and answers each as it
finishes, refuses bad input without harm, and reports its ranks and metrics. The last test stops it with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shard_worker.telemetry.metrics import FAMILIES
from shard_worker.telemetry.rankmetrics import LEADER_FAMILIES
from tests.support.processes import alive, children, cmdline, rank_port

from .conftest import EDGES, KILLERS, check_edge, check_killer, get, shardctl_run, sharded_model_yaml, wait_for

pytestmark = pytest.mark.slow

PROMPT = "The lighthouse keeper climbed"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    yaml_file = sharded_model_yaml(tmp_path_factory.mktemp("api") / "tiny.yaml", tiny_model, name="tiny",
                                   tensor=2, pipeline=1)
    with shardctl_run(yaml_file, "tiny", "--devices", "localhost:1GiB*2") as srv:
        yield srv


def generate_json(tiny_model, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "shard_operator.cli", "generate", "--model-dir", str(tiny_model),
                          "--tensor", "2", "--json", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_completions_equal_shardctl_generate(server, tiny_model):
    """Text prompt with seeded sampling, and token ids greedily: the tokens `shardctl generate`
    (a one-shot group of the same TP) gives for the same seed."""
    sampled = server.complete(prompt=PROMPT, max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)
    expected = generate_json(tiny_model, "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "0.9",
                             "--seed", "11", "--ignore-eos")
    choice = sampled["choices"][0]
    assert choice["token_ids"] == expected["token_ids"] and len(expected["token_ids"]) == 12
    assert choice["text"] == expected["text"]
    assert sampled["usage"]["completion_tokens"] == 12

    greedy = server.complete(prompt=[1, 40, 41, 42, 43], max_tokens=10, temperature=0, ignore_eos=True)
    expected = generate_json(tiny_model, "--prompt-ids", "1,40,41,42,43", "--max-tokens", "10", "--ignore-eos")
    assert greedy["choices"][0]["token_ids"] == expected["token_ids"]
    assert greedy["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert server.complete(prompt=[[1, 40, 41, 42, 43]], max_tokens=10, temperature=0,
                           ignore_eos=True)["choices"][0]["token_ids"] == expected["token_ids"]


def sse(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streaming_sends_the_same_completion_piece_by_piece(server):
    body = dict(prompt=PROMPT, max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)
    whole = server.complete(**body)["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    choices = [c["choices"][0] for c in chunks]
    assert len(choices) > 2  # tokens arrive as they are generated, not in one piece
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)


def test_a_stop_string_ends_the_text_whole_streamed_and_in_shardctl_generate_alike(server, tiny_model):
    """The text side finds the stop string (text.py); the engine stops the sequence at the next
    step boundary: the ids end with the token that completed it, the text before it, in every
    path that makes text."""
    body = dict(prompt=PROMPT, max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)
    free = server.complete(**body)["choices"][0]
    stop = free["text"][len(free["text"]) // 2:len(free["text"]) // 2 + 2]
    assert stop and free["text"].count(stop) >= 1
    whole = server.complete(**body, stop=stop)["choices"][0]
    cut = free["text"].index(stop)
    assert (whole["text"], whole["finish_reason"]) == (free["text"][:cut], "stop")
    kept = whole["token_ids"]
    assert kept == free["token_ids"][:len(kept)] and len(kept) < 16
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={**body, "stop": stop, "stream": True}) as response:
        choices = [e["choices"][0] for e in sse(response)[:-1]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert [t for c in choices for t in c["token_ids"]] == kept and choices[-1]["finish_reason"] == "stop"
    expected = generate_json(tiny_model, "--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0.7",
                             "--seed", "3", "--ignore-eos", "--stop", stop)
    assert (expected["token_ids"], expected["text"], expected["finish_reason"]) == (kept, whole["text"], "stop")


def test_chat_completions_through_the_chat_template(server):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    # the template's prompt: BOS, each message between its role token and <|end|>, then the assistant's turn
    prompt = "<|system|>\nBe brief.<|end|>\n<|user|>\nHello!<|end|>\n<|assistant|>\n"
    same = server.complete(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
    assert answer["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
    assert answer["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"]

    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as response:
        events = sse(response)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == answer["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def batch_counts(server) -> tuple[float, float]:
    """Steps so far, and the sequences they carried (the tokens taken)."""
    text = get(server.url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shard_batch_size")
    values = {s.name: s.value for s in family.samples}
    return values["shard_batch_size_count"], values["shard_batch_size_sum"]


def test_requests_that_arrive_while_a_batch_runs_join_it_and_are_answered_before_it_ends(server):
    """Continuous batching: six short requests sent while a long one streams join its batch (three
    free rows of maxBatchSize 4, then the rows they leave) and are all answered before it ends,
    each with the tokens it gets alone."""
    prompts = [[1, 30 + i, 50 + 2 * i, 70] for i in range(6)] + [[1, 99]]
    solo = [server.complete(prompt=p, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
            for p in prompts[:6]]
    steps_before, carried_before = batch_counts(server)
    answered: list[str] = []  # in the order the answers arrived

    async def short(client: httpx.AsyncClient, prompt: list[int]) -> httpx.Response:
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                               "ignore_eos": True})
        answered.append("short")
        return response

    async def rest_of(lines) -> None:
        async for line in lines:
            if line == "data: [DONE]":
                answered.append("long")

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            long = {"prompt": prompts[6], "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=long) as first:
                lines = first.aiter_lines()
                await anext(lines)  # it is running
                *answers, _ = await asyncio.gather(*(short(client, p) for p in prompts[:6]), rest_of(lines))
            return answers

    answers = asyncio.run(together())
    assert [a.status_code for a in answers] == [200] * 6
    assert [a.json()["choices"][0]["token_ids"] for a in answers] == solo  # joining changes no answer
    assert answered == ["short"] * 6 + ["long"]
    steps_after, carried_after = batch_counts(server)
    assert steps_after - steps_before == 250  # the long one's steps: the others took theirs alongside
    # a joiner takes two tokens in the step it joins at (its prefill's, then its first decode's)
    assert carried_after - carried_before == 250 + 6 * 11


def requests_with_outcome(server, outcome: str) -> float:
    text = get(server.url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shard_requests")
    return next(s.value for s in family.samples if s.name == "shard_requests_total" and s.labels["outcome"] == outcome)


def test_a_client_that_hangs_up_stops_its_generation(server):
    """A streaming client that closes the connection after its first chunk, and a client that gives
    up waiting for a whole answer: both requests are cancelled, the group stops computing them
    long before their 250 tokens, and serves the next request."""
    steps_before, _ = batch_counts(server)
    cancelled_before = requests_with_outcome(server, "cancelled")
    long = {"prompt": [1, 99], "max_tokens": 250, "temperature": 0, "ignore_eos": True}

    async def hang_up_mid_stream() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                await anext(response.aiter_lines())  # it runs; leaving the block closes the connection

    asyncio.run(hang_up_mid_stream())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=long, timeout=0.1)  # 250 steps take longer
    wait_for("both requests cancelled", lambda: requests_with_outcome(server, "cancelled") == cancelled_before + 2,
             timeout=30)
    assert server.complete(prompt=[1, 2], max_tokens=4, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
    steps_after, _ = batch_counts(server)
    assert steps_after - steps_before < 250  # fewer steps for all three than one long answer takes


@pytest.mark.parametrize("body,status,param", [
    (b'{"prompt": "hello", "max_tokens": 4', 400, None),  # malformed JSON
    (b'{"prompt": "hello", "max_tokens": "four"}', 400, "max_tokens"),  # a field of the wrong type
    (b'{"prompt": 7}', 400, "prompt"),
    (b'{"prompt": "hello", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"prompt": "hello", "max_tokens": 4, "temperature": -1}', 400, "temperature"),
    (json.dumps({"prompt": [5] * 300, "max_tokens": 4}).encode(), 400, "prompt"),  # longer than maxModelLen 256
    (json.dumps({"prompt": [5] * 250, "max_tokens": 100}).encode(), 400, "max_tokens"),
    (b'{"prompt": [1, 100000], "max_tokens": 2}', 400, "prompt"),  # not in the vocabulary
    (b'{"prompt": "hello", "model": "gpt-4"}', 404, "model"),
])
def test_bad_input_is_refused_with_an_openai_error_and_the_server_keeps_serving(server, body, status, param):
    response = server.post("/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert server.complete(prompt="hello", max_tokens=2, model="tiny")["choices"][0]["finish_reason"] in (
        "length", "stop")


@pytest.mark.parametrize("body,status,param", KILLERS)
def test_requests_that_once_failed_the_group_are_answered_while_another_runs(server, body, status, param):
    check_killer(server, body, status, param)


@pytest.mark.parametrize("name", EDGES)
def test_edge_requests_that_join_a_running_stream_answer_as_alone(server, name):
    check_edge(server, name, 256)


def test_models_and_shards(server):
    models = get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    shards = get(server.url + "/v1/shards").json()
    assert (shards["model"], shards["replica"], shards["ready"]) == ("tiny", 0, True)
    assert shards["kv_cache_tokens"] == 4 * 256 and 0 <= shards["kv_cache_used_tokens"] <= 4 * 256
    # what the leader's paged pool gives sequences is the plan's capacity on every rank
    assert {r["plan"]["kv_cache_tokens"] for r in shards["ranks"]} == {shards["kv_cache_tokens"]}
    assert [(p["rank"], p["stage"], p["tp_rank"], p["layers"]) for p in (r["plan"] for r in shards["ranks"])] == \
        [(0, 0, 0, [0, 4]), (1, 0, 1, [0, 4])]
    for entry in shards["ranks"]:  # the contract the operator reads (shard_contract.wire.ShardsResponse)
        assert set(entry) == {"plan", "report", "alive", "state", "problems", "load_progress"}
        assert entry["alive"] and entry["state"] == "ready" and entry["problems"] == []
        p, r = entry["plan"], entry["report"]
        assert set(p["predicted_bytes"]) == {"weights", "kv_cache", "activations", "overhead", "staging", "total"}
        assert p["predicted_bytes"]["staging"] == 0 and p["offload"] is None  # it streams nothing
        assert {"weights", "kv_cache", "rss_anon", "cuda_allocated", "total"} <= set(r["resident_bytes"])
        # the warm-up ran before ready: its activations measured, within the peak it reports
        assert 0 < r["resident_bytes"]["activations"] <= r["resident_bytes"]["peak"]
        assert p["predicted_bytes"]["weights"] == r["allocated_bytes"]["weights"]
        assert p["predicted_bytes"]["kv_cache"] == r["allocated_bytes"]["kv_cache"]  # its reserved blocks too
        assert r["load_seconds"] > 0 and r["compute_seconds"] > 0 and r["comm_seconds"] > 0
        assert r["idle_seconds"] == 0  # one stage: nobody waits for another
    health = get(server.url + "/health").json()
    assert health == {"status": "ok", "rank": 0, "reason": ""}


def test_a_shared_prompt_prefix_is_computed_once_and_reported(server):
    """The paged KV cache's prefix cache over HTTP: a prompt of 40 tokens answered, then the same
    prompt again takes its two full blocks (32 tokens) from the cache, answers the same, and says
    so in usage, /v1/shards and /metrics."""
    prompt = [(7 * i + 3) % 200 + 1 for i in range(40)]
    before = get(server.url + "/v1/shards").json()
    first = server.complete(prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True)
    again = server.complete(prompt=prompt, max_tokens=4, temperature=0, ignore_eos=True)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    shards = get(server.url + "/v1/shards").json()
    assert shards["prefix_cache_hits"] - before["prefix_cache_hits"] == 2
    assert shards["prefix_cache_queries"] - before["prefix_cache_queries"] == 4
    hits = scrape(int(server.url.rsplit(":", 1)[1]))["shard_prefix_cache_hits"].samples
    assert next(s.value for s in hits if s.name == "shard_prefix_cache_hits_total") >= 2


def scrape(port: int) -> dict:
    text = get(f"http://127.0.0.1:{port}/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_rank_is_named_in_ps_and_exposes_its_metrics(server):
    server.complete(prompt=PROMPT, max_tokens=4, temperature=0)
    ranks = server.ranks()
    assert sorted(ranks) == [0, 1] and rank_port(ranks[0]) == int(server.url.rsplit(":", 1)[1])
    for rank, pid in ranks.items():
        title = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
        assert title == f"shard-worker model=tiny group=0 rank={rank} port={rank_port(pid)}"
        text = get(f"http://127.0.0.1:{rank_port(pid)}/metrics").text
        assert "_created" not in text  # no creation-time series beside counters and histograms
        families = scrape(rank_port(pid))
        expected = set(FAMILIES) if rank == 0 else set(FAMILIES) - set(LEADER_FAMILIES)
        for name in expected:
            samples = families[name].samples
            assert samples, (rank, name)
            assert all(s.labels["model"] == "tiny" and s.labels["group"] == "0" and s.labels["rank"] == str(rank)
                       and s.labels["stage"] == "0" and s.labels["tp_rank"] == str(rank) for s in samples)

        def value(name: str, suffix: str = "", **labels: str) -> float:
            return next(s.value for s in families[name].samples
                        if s.name == name + suffix and labels.items() <= s.labels.items())

        assert value("shard_resident_bytes", kind="total") > 0 and value("shard_predicted_bytes", kind="total") > 0
        assert value("shard_comm_bytes", "_total", op="all_reduce") > 0
        assert value("shard_compute_seconds", "_total") > 0
        assert value("shard_group_ready") == 1
        if rank == 0:
            assert value("shard_tokens_generated", "_total") >= 4
            assert value("shard_requests", "_total", outcome="completed") >= 1
            assert value("shard_time_to_first_token_seconds", "_count") >= 1
            assert value("shard_time_per_output_token_seconds", "_count") >= 1
            assert (value("shard_kv_cache_capacity_rows"), value("shard_kv_cache_capacity_tokens")) == (4, 4 * 256)
            # vLLM's serving families: every request that started counted its prompt and its wait; a
            # stream of 4 tokens took 3 gaps
            started = value("shard_request_queue_time_seconds", "_count")
            assert started >= 1 and value("shard_prompt_tokens", "_total") >= 2 * started  # prompts of 2+ tokens
            assert value("shard_inter_token_latency_seconds", "_count") >= 3
    follower = scrape(rank_port(ranks[1]))
    assert not any(family.samples for name, family in follower.items() if name in set(LEADER_FAMILIES))


def test_sigterm_stops_every_rank(server):
    """Last: `shardctl run` stopped by SIGTERM leaves no process behind: neither its ranks nor the
    leader's HTTP process and tokenizer processes."""
    ranks = server.ranks()
    assert len(ranks) == 2
    (http,) = [pid for pid in children(ranks[0]) if cmdline(pid).startswith(b"shard-worker-http ")]
    helpers = [http, *children(http)]
    assert len(helpers) == 3  # the HTTP process and its two tokenizer processes
    server.proc.send_signal(signal.SIGTERM)
    server.proc.communicate(timeout=60)
    assert server.proc.returncode == 128 + signal.SIGTERM
    assert not any(alive(pid) for pid in [*ranks.values(), *helpers])
