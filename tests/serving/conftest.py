"""Fixtures of the serving tests: a tiny demo checkpoint (written by `shardctl demo-model`'s own
code: several safetensors files, a trained BPE tokenizer with a chat template), ShardedModel
YAMLs for it, a group served by `shardctl run`, a long streaming request, and helpers to find and
stop the rank processes a test started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import free_port
from tests.support.processes import shardctl, worker_ranks

TINY = DemoShape(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=600, max_positions=512, files=3)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("serving") / "tiny", TINY)


def sharded_model_yaml(path: Path, model_dir: Path, *, name: str = "tiny", tensor: int | str = 2,
                       pipeline: int | str = 1, max_len: int = 256, batch: int = 4) -> Path:
    path.write_text(f"""apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata:
  name: {name}
spec:
  model:
    path: {model_dir}
    dtype: float32
    maxModelLen: {max_len}
    maxBatchSize: {batch}
  parallelism:
    tensor: {tensor}
    pipeline: {pipeline}
""")
    return path


# ---------------------------------------------------------------- processes
def wait_for(what: str, check, timeout: float, period: float = 0.1):
    """Poll `check()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(period)


def wait_group_ready(group, url: str, timeout: float = 120) -> None:
    """Until the LocalGroup `group` answers /ready at `url`. A rank that exits fails at once with its
    log; the deadline fails with every rank's log (so a failure on CI says why)."""
    def ready() -> bool:
        failure = group.failure()
        assert failure is None, str(failure)
        response = get(url + "/ready")
        return response is not None and response.status_code == 200
    try:
        wait_for("/ready", ready, timeout)
    except AssertionError as error:
        logs = "\n".join(f"--- rank {r.rank} (port {r.port}):\n{r.tail()}" for r in group.ranks)
        raise AssertionError(f"{error}\n{logs}") from None


def get(url: str, **kwargs) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=kwargs.pop("timeout", 5.0), **kwargs)
    except httpx.HTTPError:
        return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- a served group
class Server:
    """A group served by `shardctl run`, as its clients see it."""

    def __init__(self, proc: subprocess.Popen, port: int, model: str, api_key: str | None = None,
                 log_dir: Path | None = None):
        self.proc, self.url, self.model = proc, f"http://127.0.0.1:{port}", model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log_dir = log_dir

    def rank_logs(self, lines: int = 60) -> str:
        """The end of every rank's log (with `log_dir`): what a failure message quotes, so a rank that
        died says why (its traceback and the requests it held)."""
        if self.log_dir is None:
            return "(the ranks' logs were not kept: shardctl_run(log_dir=...))"
        logs = sorted(self.log_dir.glob("attempt-*/rank-*.log"))
        return "\n".join(f"--- {log.relative_to(self.log_dir)}:\n" +
                         "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) for log in logs)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"Content-Type": "application/json", **self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=120, **kwargs)

    def complete(self, **body) -> dict:
        response = self.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()

    def ranks(self) -> dict[int, int]:
        return worker_ranks(self.proc.pid)


@contextmanager
def shardctl_run(yaml_file: Path, model: str, *args: str, api_key: str | None = None,
                 log_dir: Path | None = None) -> Iterator[Server]:
    """`shardctl run -f yaml_file ARGS` on a free port, once every rank is ready; stopped after.
    With `log_dir`, the ranks' logs are kept there (`Server.rank_logs`)."""
    port = free_port()
    logs = ("--log-dir", str(log_dir)) if log_dir is not None else ()
    proc = shardctl("run", "-f", str(yaml_file), "--port", str(port), "--restarts", "0", *logs, *args)
    server = Server(proc, port, model, api_key, log_dir)
    try:
        wait_for("/ready", lambda: proc.poll() is not None or (get(server.url + "/ready") or httpx.Response(0))
                 .status_code == 200, timeout=180)
        assert proc.poll() is None, proc.communicate()
        yield server
    finally:
        stop(proc)


class InFlight(threading.Thread):
    """A long greedy streaming completion; records every event and when the stream ended."""

    def __init__(self, url: str, max_tokens: int = 250, headers: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.headers = url, max_tokens, headers or {}
        self.events: list[str] = []
        self.ended: float | None = None
        self.started = threading.Event()

    def run(self) -> None:
        body = {"prompt": "The", "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers,
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        finally:
            self.ended = time.monotonic()
            self.started.set()

    def token_ids(self) -> list[int]:
        """What it streamed, once it has ended with [DONE] (else an assertion fails)."""
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        return [t for e in self.events[:-1] for c in json.loads(e)["choices"] for t in c["token_ids"]]


# Requests that each once failed their whole group (issue 11): a non-finite probability tensor, a
# top_p that is 0 in float32, a seed past 64 bits; a top_k past int64, which every sampling rank
# failed to place (under PP, all of them followers). Now each is answered: as its limit (greedy; a
# top_k that large keeps every token), or refused naming the parameter.
KILLERS = [
    ({"prompt": "hi", "temperature": 1e-40}, 200, None),
    ({"prompt": "hi", "temperature": 1, "top_p": 1e-300}, 200, None),
    ({"prompt": "hi", "seed": 18446744073709551616}, 400, "seed"),
    ({"prompt": "hi", "temperature": 0, "top_k": 18446744073709551616, "presence_penalty": -1.18}, 200, None),
]


def answered_while_another_runs(server: Server, body: dict, runs_on: bool = True,
                                path: str = "/v1/completions") -> httpx.Response:
    """`body`'s answer (at `path`), sent while a long streaming completion runs; that one completes
    (after it, with `runs_on`), and the group is the same processes, healthy."""
    ranks = server.ranks()
    stream = InFlight(server.url, max_tokens=100, headers=server.headers)
    stream.start()
    assert stream.started.wait(60) and stream.ended is None
    response = server.post(path, body)
    answered = time.monotonic()
    stream.join(120)
    assert len(stream.token_ids()) == 100 and (stream.ended > answered or not runs_on)  # it ran on, to its end
    assert server.proc.poll() is None and server.ranks() == ranks, server.rank_logs()  # no rank restarted
    assert get(server.url + "/health").status_code == 200
    return response


def check_killer(server: Server, body: dict, status: int, param: str | None) -> None:
    body = {**body, "max_tokens": 8, "ignore_eos": True}
    response = answered_while_another_runs(server, body)
    assert response.status_code == status, response.text
    if status == 200:
        greedy = server.complete(**{**body, "temperature": 0, "top_p": 1})["choices"][0]["token_ids"]
        assert response.json()["choices"][0]["token_ids"] == greedy
    else:
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["param"] == param


# Edge requests an adversarial review of the mixed step found (c12e9f8, a932f24): prompts of
# maxModelLen and maxModelLen - 1 tokens for one token (the first hung its group beside a running
# batch), maxModelLen - 1 for two (its second token is decoded at the last column, so no frame holds
# it beside the stream's remaining tokens: its last token waits until the stream is at its end,
# chunking.py, and is answered with it or after it), a prompt that ends at a KV block boundary (16
# tokens), echo with logprobs of a long prompt, n > 1 of a long prompt, stop strings, and a chat
# answer under a JSON schema (response_format). Each joins a running stream, so the CPU's step
# budget (16 tokens) computes its prompt in chunks (on one stage, riding with the stream's decode
# row in one pass); each answers as it does alone. Every prompt is its own (no prefix cache hit
# from another entry).
EDGES = ["max-len-for-1", "max-len-less-1-for-1", "max-len-less-1-for-2", "block-boundary", "echo-logprobs",
         "n-3", "stop-strings", "json-schema"]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def edge_request(name: str, max_len: int) -> tuple[str, dict]:
    """The edge request `name` for a group of `max_len`: its route and body."""
    salt = EDGES.index(name)

    def prompt(length: int) -> list[int]:
        return [(17 * i + 31 * salt + 5) % 500 + 3 for i in range(length)]

    if name == "json-schema":
        words = " ".join(f"item {i} of the long list," for i in range(max_len // 40))
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Describe a person as JSON after reading {words}"}],
            "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    return "/v1/completions", {"temperature": 0, "ignore_eos": True, **{
        "max-len-for-1": {"prompt": prompt(max_len), "max_tokens": 1},
        "max-len-less-1-for-1": {"prompt": prompt(max_len - 1), "max_tokens": 1},
        "max-len-less-1-for-2": {"prompt": prompt(max_len - 1), "max_tokens": 2},
        "block-boundary": {"prompt": prompt(48), "max_tokens": 8},
        "echo-logprobs": {"prompt": prompt(max_len // 2 + 7), "max_tokens": 4, "echo": True, "logprobs": 3},
        "n-3": {"prompt": prompt(max_len // 2 + 3), "max_tokens": 6, "n": 3, "temperature": 0.8, "seed": 5},
        "stop-strings": {"prompt": prompt(max_len // 2 + 5), "max_tokens": 12, "stop": ["e", "a"]},
    }[name]}


def check_edge(server: Server, name: str, max_len: int) -> None:
    """The edge request `name` joins a running stream, is answered (the stream runs to its end, the
    same ranks serve), and answers as it does alone (its log-probabilities within float32 rounding:
    alone, the prefix cache holds its prompt's full blocks)."""
    path, body = edge_request(name, max_len)
    response = answered_while_another_runs(server, body, runs_on=name != "max-len-less-1-for-2", path=path)
    assert response.status_code == 200, response.text
    again = server.post(path, body)
    assert again.status_code == 200, again.text
    joined, alone = response.json()["choices"], again.json()["choices"]
    assert len(joined) == body.get("n", 1)
    for got, expected in zip(joined, alone, strict=True):
        ours, theirs = got.pop("logprobs", None), expected.pop("logprobs", None)
        assert got == expected
        if name == "stop-strings":  # met: the text ends before it
            assert got["finish_reason"] == "stop" and not {"e", "a"} & set(got["text"])
        elif name == "json-schema":  # the grammar held
            assert got["message"]["content"].startswith("{")
        else:
            assert len(got["token_ids"]) == body["max_tokens"] and got["finish_reason"] == "length"
        if body.get("logprobs") is None:
            continue
        assert len(ours["tokens"]) == len(body["prompt"]) + body["max_tokens"]  # echo: the prompt's too
        assert (ours["tokens"], ours["text_offset"]) == (theirs["tokens"], theirs["text_offset"])
        assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-4)
        for a, b in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
            assert (a is None and b is None) or (a.keys() == b.keys() and a == pytest.approx(b, abs=1e-4))
