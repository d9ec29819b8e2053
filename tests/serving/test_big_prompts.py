"""Issue 24, item 1, over real HTTP against one `shardctl run` group: a huge body is refused with
413 before it is buffered, a text prompt too long for the context is refused before it is
tokenized, a chat template that runs past SHARD_TEXT_TIMEOUT fails its request alone, and through
each `/health` answers and the group serves on with the same processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading

import httpx
import pytest

from .conftest import Server, get, shardctl, sharded_model_yaml, stop, wait_for

pytestmark = pytest.mark.slow

TEXT_TIMEOUT = 2
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    """A TP=1 group of the tiny model whose chat template loops (almost) forever for a
    conversation that starts with a `loop` message, and renders the others as usual."""
    workdir = tmp_path_factory.mktemp("big")
    model = workdir / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['content'] == 'loop' %}" + LOOPS + "{% else %}"
                               + config["chat_template"] + "{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    yaml_file = sharded_model_yaml(workdir / "tiny.yaml", model, tensor=1, max_len=128)
    from shard_operator.local.launcher import free_port

    port = free_port()
    env = {**os.environ, "SHARD_TEXT_TIMEOUT": str(TEXT_TIMEOUT)}
    proc = shardctl("run", "-f", str(yaml_file), "--port", str(port), "--restarts", "0", env=env)
    server = Server(proc, port, "tiny")
    try:
        wait_for("/ready", lambda: proc.poll() is not None or (get(server.url + "/ready") or httpx.Response(0))
                 .status_code == 200, timeout=180)
        assert proc.poll() is None, proc.communicate()
        server.first_ranks = server.ranks()
        yield server
    finally:
        stop(proc)


class HealthPoller(threading.Thread):
    """Asks /health over and over until stopped; every answer's status (None: no answer)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.statuses = url, []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            response = get(self.url + "/health", timeout=30)
            self.statuses.append(response.status_code if response is not None else None)

    def __enter__(self) -> HealthPoller:
        self.start()
        wait_for("a first /health answer", lambda: self.statuses, 60)
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join(60)


def served_on(group: Server) -> None:
    """The same processes serve a request as before."""
    assert group.proc.poll() is None and group.ranks() == group.first_ranks
    assert group.complete(prompt="hello", max_tokens=3, temperature=0)["choices"][0]["finish_reason"] == "length"


def test_a_huge_body_is_refused_before_it_is_read(group):
    with HealthPoller(group.url) as health, \
            socket.create_connection(("127.0.0.1", int(group.url.rsplit(":", 1)[1])), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"SHARD_MAX_BODY_BYTES" in answer, answer[:300]
    assert set(health.statuses) == {200}
    served_on(group)


def test_a_text_prompt_too_long_for_the_context_is_refused_before_tokenizing(group):
    with HealthPoller(group.url) as health:
        response = group.post("/v1/completions", {"prompt": "x" * 4_000_000, "max_tokens": 1})
        chat = group.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "y " * 2_000_000}]})
    for refused, param in ((response, "prompt"), (chat, "messages")):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert "characters" in error["message"] and "maxModelLen 128" in error["message"]
    assert set(health.statuses) == {200}
    served_on(group)


def test_a_template_that_runs_past_its_bound_fails_alone_while_health_answers(group):
    with HealthPoller(group.url) as health:
        before = len(health.statuses)
        response = group.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "loop"}]})
        during = len(health.statuses) - before
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
    if "SHARD_TEXT_TIMEOUT" in response.json()["error"]["message"]:  # it ran to the bound (no sandbox cut it)
        assert during > 0  # /health answered while it ran
    assert set(health.statuses) == {200}
    served_on(group)
    chat = group.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text
