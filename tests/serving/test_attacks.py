"""What a hostile client sends, over real HTTP, to one group of TP=2 x PP=2 (four `python -m
shard_worker` processes under `shardctl run --api-key-file`), each answered without harm: the
requests that once failed a whole group; requests without the key; every body the published
OpenAPI document allows or forbids (schemathesis); any sampling parameters in the accepted ranges
(hypothesis). Through it all the same processes serve and /health stays 200; the last test checks
that once more."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from shard_contract.wire import SEED_MAX, SEED_MIN, TEMPERATURE_MAX
from tests.support.processes import rank_port

from .conftest import EDGES, KILLERS, check_edge, check_killer, get, shardctl_run, sharded_model_yaml

pytestmark = pytest.mark.slow

KEY = "sk-shard-operator-test-key"
MAX_LEN = 128


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("attacks")
    key_file = workdir / "api-key"
    key_file.write_text(KEY + "\n")  # a trailing newline is no part of the key
    yaml_file = sharded_model_yaml(workdir / "tiny.yaml", tiny_model, name="tiny", tensor=2, pipeline=2,
                                   max_len=MAX_LEN)
    with shardctl_run(yaml_file, "tiny", "--devices", "localhost:1GiB*4", "--api-key-file", str(key_file),
                      api_key=KEY, log_dir=workdir / "logs") as server:
        server.first_ranks = server.ranks()
        assert len(server.first_ranks) == 4
        yield server


@pytest.mark.parametrize("body,status,param", KILLERS)
def test_requests_that_once_failed_the_group_are_answered_while_another_runs(group, body, status, param):
    check_killer(group, body, status, param)


@pytest.mark.parametrize("name", EDGES)
def test_edge_requests_that_join_a_running_stream_answer_as_alone(group, name):
    check_edge(group, name, MAX_LEN)


def test_the_openai_routes_need_the_key_and_the_probes_do_not(group):
    body = {"prompt": "hi", "max_tokens": 2}
    missing = httpx.post(group.url + "/v1/completions", json=body, timeout=30)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    for header in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Basic {KEY}", KEY, f"Bearer {KEY} x"):
        wrong = httpx.post(group.url + "/v1/completions", json=body, headers={"Authorization": header}, timeout=30)
        assert wrong.status_code == 401, header
    assert httpx.get(group.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(group.url + "/v1/models", headers=group.headers, timeout=30).status_code == 200
    assert group.post("/v1/completions", body).status_code == 200
    for pid in group.ranks().values():  # probes, Prometheus and the operator's poller: open on every rank
        base = f"http://127.0.0.1:{rank_port(pid)}"
        for path in ("/health", "/ready", "/metrics", "/v1/shards"):
            assert get(base + path).status_code == 200, (base, path)


def test_the_openapi_document_of_the_openai_routes(group):
    doc = get(group.url + "/openapi.json").json()  # open: it holds no secret
    assert set(doc["paths"]) == {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                 "/detokenize", "/version"}
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    fields = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["temperature"]["anyOf"][0]["maximum"] == TEMPERATURE_MAX
    assert fields["seed"]["anyOf"][0]["maximum"] == SEED_MAX
    scheme = doc["components"]["securitySchemes"]["HTTPBearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert all(op["security"] == [{"HTTPBearer": []}] for path in doc["paths"].values() for op in path.values())
    assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_body_the_schema_allows_or_forbids_is_a_server_error(group, mode):
    """Schemathesis over the published document: bodies it allows, and bodies it forbids. Bounded:
    20 examples each, each answered within MAX_LEN decode steps. (Its pytest plugin's lazy schema
    does not run under pytest 9, so its strategy drives hypothesis here.)"""
    schema = schemathesis.openapi.from_url(group.url + "/openapi.json")
    schema.config.generation.update(with_security_parameters=False)  # the key is ours to send

    @settings(max_examples=20, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(mode))
    def no_server_error(case) -> None:
        case.call_and_validate(headers=group.headers, checks=[not_a_server_error], timeout=60)

    try:
        no_server_error()
    except Exception as err:
        if group.ranks() != group.first_ranks:  # a rank died: its log says why
            err.add_note(group.rank_logs())
        raise


sampling = st.fixed_dictionaries({
    "prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(3, 500), min_size=1, max_size=10),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0.0, TEMPERATURE_MAX, allow_subnormal=True),
    "top_p": st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True),
    "seed": st.integers(SEED_MIN, SEED_MAX),
    "stream": st.booleans(),
}, optional={"stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
             "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
             "repetition_penalty": st.floats(0.0, 100.0, exclude_min=True, allow_subnormal=True),
             "top_k": st.integers(-1, 600) | st.integers(min_value=601),
             "min_p": st.floats(0.0, 1.0, allow_subnormal=True),
             "logit_bias": st.dictionaries(st.integers(0, 599).map(str), st.floats(-100.0, 100.0), max_size=3),
             "n": st.integers(1, 3), "logprobs": st.integers(0, 20)})


# Each example is a request to the group: no shrinking (a failure prints its example).
@settings(max_examples=20, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=sampling)
def test_any_accepted_sampling_parameters_are_served(group, body):
    response = group.post("/v1/completions", body)
    assert response.status_code == 200, (body, response.text)
    if body["stream"]:
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_after_every_attack_the_same_group_serves(group):
    assert group.proc.poll() is None and group.ranks() == group.first_ranks, group.rank_logs()
    assert get(group.url + "/health").json() == {"status": "ok", "rank": 0, "reason": ""}
    assert group.complete(prompt="hi", max_tokens=4)["choices"][0]["token_ids"]
