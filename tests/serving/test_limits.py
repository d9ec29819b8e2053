"""Slow and big clients against a real uvicorn server with the worker's limits (`limits.py`): a
body over SHARD_MAX_BODY_BYTES is refused with 413 before it is buffered, a body or a request head
that does not arrive within SHARD_READ_TIMEOUT is cut off, and `/health` answers throughout.
Every wait is a generous bound on a condition; the server's own bounds are what is tested."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from shard_contract.env import WorkerEnv
from shard_operator.local.launcher import free_port
from shard_worker.serving.limits import BoundedBodies, server_limits

from .conftest import wait_for

LIMIT = 64 * 1024
READ_TIMEOUT = 1.0
PATIENCE = 60  # seconds a test waits for what the server must do within READ_TIMEOUT


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[int]]]:
    """A server of the worker's limits around an app that records the size of each body it gets."""
    app, seen = FastAPI(), []

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append(len(body))
        return {"bytes": len(body)}

    port = free_port()
    config = uvicorn.Config(BoundedBodies(app, LIMIT, READ_TIMEOUT), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off", **server_limits(READ_TIMEOUT))
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_for("the server", lambda: _health(url), PATIENCE)
    yield url, seen
    uv.should_exit = True
    thread.join(PATIENCE)


def _health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
    except httpx.HTTPError:
        return False


def _connect(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=PATIENCE)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (within PATIENCE)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_within_the_limit_reaches_the_app(server):
    url, seen = server
    response = httpx.post(url + "/echo", content=b"x" * LIMIT, timeout=PATIENCE)
    assert response.status_code == 200 and response.json() == {"bytes": LIMIT}
    assert seen[-1] == LIMIT


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(server):
    url, seen = server
    before = len(seen)
    with _connect(url) as sock:  # says 100 MB, sends none of it: the answer comes all the same
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"SHARD_MAX_BODY_BYTES" in answer and str(LIMIT).encode() in answer
    assert len(seen) == before  # the app never ran


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    url, seen = server
    before = len(seen)

    def chunks() -> Iterator[bytes]:
        for _ in range(1000):  # 64 MB if it were all read
            yield b"x" * LIMIT

    response = httpx.post(url + "/echo", content=chunks(), timeout=PATIENCE)
    assert response.status_code == 413 and "SHARD_MAX_BODY_BYTES" in response.json()["error"]["message"]
    assert len(seen) == before


def test_a_body_that_stalls_is_cut_off_while_health_answers(server):
    url, seen = server
    before = len(seen)
    with _connect(url) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        assert _health(url)  # the stalled request holds nothing the probes need
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"SHARD_READ_TIMEOUT" in answer and len(seen) == before


@pytest.mark.parametrize("head", [b"", b"GET /hea", b"POST /echo HTTP/1.1\r\nHost: x\r\n"])
def test_a_request_head_that_never_ends_is_cut_off(server, head):
    url, _ = server
    with _connect(url) as sock:
        sock.sendall(head)
        assert _health(url)
        assert _read_all(sock) == b""  # closed without an answer: there was no request to answer


def test_a_connection_is_cut_off_when_no_second_request_comes(server):
    url, _ = server
    with _connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_all(sock)  # the answer, then the close: keep-alive does not keep a silent client
    assert answer.startswith(b"HTTP/1.1 200")


def test_the_limits_are_set_by_environment_variables_and_left_out_at_their_defaults():
    base = {"RANK": "0", "WORLD_SIZE": "1", "TP_SIZE": "1", "PP_SIZE": "1", "SHARD_PLAN": "p", "SHARD_MODEL_DIR": "m"}
    env = WorkerEnv.from_env(base)
    assert (env.max_body_bytes, env.read_timeout, env.text_timeout) == (8 << 20, 30.0, 10.0)
    assert not {"SHARD_MAX_BODY_BYTES", "SHARD_READ_TIMEOUT", "SHARD_TEXT_TIMEOUT"} & set(env.to_env())
    tuned = WorkerEnv.from_env({**base, "SHARD_MAX_BODY_BYTES": "65536", "SHARD_TEXT_TIMEOUT": "2.5"})
    assert (tuned.max_body_bytes, tuned.text_timeout) == (65536, 2.5)
    assert tuned.to_env()["SHARD_MAX_BODY_BYTES"] == "65536"
    assert WorkerEnv.from_env(tuned.to_env()) == tuned
