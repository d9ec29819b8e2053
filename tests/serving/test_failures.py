"""Health never lies, over real HTTP against real rank processes: not ready until every rank has
loaded; a hung or a killed rank fails `/health` with a reason naming it within 10 s, the request
in flight ends with an error instead of hanging, and new requests get 503 with the reason. And a
request that fails on its own fails alone: the group serves on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shard_operator.local.launcher import LocalGroup, free_port, plan_local
from shard_worker.engine.sequences import FAILED_ELSEWHERE
from tests.support.checkpoints import break_embedding

from .conftest import InFlight, get, kill_all, wait_for, wait_group_ready

pytestmark = pytest.mark.slow

# The promise is 10 s on a quiet machine (a missed beat, the 5 s a record may go unchanged, and margin);
# the tests bound the wait generously, so that they say "it ends, never hangs" and pass on a busy machine.
DEADLINE = 90.0


def plan(model_dir, tp: int, pp: int):
    return plan_local(model_dir, tp, pp, max_model_len=256, max_batch_size=2, devices="local:1GiB*2",
                      device_kind="cpu")


def status(url: str) -> int:
    response = get(url)
    return response.status_code if response is not None else 0


def check_the_group_is_lost(url: str, stream: InFlight, broken_at: float, rank: int) -> None:
    stream.join(DEADLINE + 5)
    assert stream.ended is not None and stream.ended - broken_at <= DEADLINE, "the request in flight hung"
    error = json.loads(stream.events[-1])["error"]
    assert error["type"] == "service_unavailable" and error["message"].startswith("the group failed: ")
    reason = wait_for("/health names the rank", lambda: (r := get(url + "/health")) is not None
                      and r.status_code == 503 and f"rank {rank} " in r.json()["reason"] and r.json()["reason"],
                      timeout=DEADLINE - (time.monotonic() - broken_at))
    assert f"rank {rank} has sent no heartbeat" in reason
    response = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable" and response.json()["error"]["message"]
    assert status(url + "/ready") == 503


def test_ready_only_when_every_rank_has_loaded_and_a_hung_rank_is_found(tiny_model, tmp_path):
    """Rank 0 alone: alive, never ready, refusing work. Rank 1 joins: ready. Rank 1 stops (SIGSTOP,
    as a hung process): /health fails within 10 s and the request in flight ends with an error."""
    the_plan = plan(tiny_model, 2, 1)
    port = free_port()
    group = LocalGroup(the_plan, tiny_model, tmp_path, leader_port=port, extra_env={"SHARD_HOST": "127.0.0.1"})
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(the_plan.to_json())
    master = free_port()

    def start(rank: int) -> subprocess.Popen:
        log = open(tmp_path / f"rank-{rank}.log", "wb")
        return subprocess.Popen([sys.executable, "-m", "shard_worker"], env=group.rank_env(rank, master, plan_file),
                                stdout=log, stderr=subprocess.STDOUT)

    url = f"http://127.0.0.1:{port}"
    procs = [start(0)]
    try:
        wait_for("rank 0 answers /health", lambda: status(url + "/health") == 200, timeout=120)
        for _ in range(10):  # it stays so: rank 1 has not even started
            ready = get(url + "/ready")
            assert ready.status_code == 503 and ready.json()["ready"] is False
            assert ready.json()["reason"] in ("waiting for the group to assemble",
                                              "waiting for ranks 0, 1 to join and load")
            time.sleep(0.2)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        procs.append(start(1))
        wait_for("/ready", lambda: status(url + "/ready") == 200, timeout=120)
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          timeout=60).status_code == 200

        stream = InFlight(url)
        stream.start()
        stream.started.wait(60)
        os.kill(procs[1].pid, signal.SIGSTOP)
        check_the_group_is_lost(url, stream, time.monotonic(), rank=1)
    finally:
        kill_all(p.pid for p in procs)
        for p in procs:
            p.wait()
        group.stop()  # removes the group's key file


def test_a_killed_rank_is_found_and_the_request_in_flight_ends(tiny_model, tmp_path):
    """Two pipeline stages; the last one is killed (SIGKILL) while it generates."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LocalGroup(plan(tiny_model, 1, 2), tiny_model, tmp_path, leader_port=port,
                    extra_env={"SHARD_HOST": "127.0.0.1"}) as group:
        wait_group_ready(group, url)
        stream = InFlight(url)
        stream.start()
        stream.started.wait(60)
        group.ranks[1].process.kill()
        check_the_group_is_lost(url, stream, time.monotonic(), rank=1)
        assert group.ranks[0].process.poll() is None  # the leader stays up to say why


def test_a_request_whose_token_cannot_be_chosen_fails_alone(tiny_model, tmp_path):
    """Two pipeline stages serving a checkpoint whose embedding of one token is NaN: a sampled
    request whose prompt holds it is answered 500 (the last stage could not choose its token; the
    first stage ends that sequence alone), streamed or not, while a long stream completes; the
    group serves on."""
    token = json.loads((tiny_model / "config.json").read_text())["vocab_size"] - 1
    broken = break_embedding(tiny_model, tmp_path / "broken", token)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LocalGroup(plan(broken, 1, 2), broken, tmp_path / "group", leader_port=port,
                    extra_env={"SHARD_HOST": "127.0.0.1"}) as group:
        wait_group_ready(group, url)
        stream = InFlight(url, max_tokens=100)
        stream.start()
        stream.started.wait(60)
        body = {"prompt": [1, token, 40], "max_tokens": 8, "temperature": 1, "seed": 1}
        failed = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code == 500
        assert failed.json()["error"] == {"message": f"this request failed: {FAILED_ELSEWHERE}",
                                          "type": "server_error", "param": None, "code": None}
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1])["error"]["type"] == "server_error"
        stream.join(120)
        assert len(stream.token_ids()) == 100  # the request beside it ran to its end
        assert status(url + "/health") == 200 and all(r.process.poll() is None for r in group.ranks)
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=60).status_code == 200
