"""Health never lies, over real HTTP against real rank processes: not ready until every rank has
loaded; a hung or a killed rank fails `/health` with a reason naming it within 10 s, the request
in flight ends with an error instead of hanging, and new requests get 503 with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from shard_operator.local import LocalGroup, free_port, plan_local

from .conftest import get, kill_all, wait_for

pytestmark = pytest.mark.slow

DEADLINE = 10.0  # seconds: the promise


def plan(model_dir, tp: int, pp: int):
    return plan_local(model_dir, tp, pp, max_model_len=256, max_batch_size=2, devices="local:1GiB*2",
                      device_kind="cpu")


def status(url: str) -> int:
    response = get(url)
    return response.status_code if response is not None else 0


class InFlight(threading.Thread):
    """A long streaming completion; records every event and when the stream ended."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.events, self.ended = url, [], None
        self.started = threading.Event()

    def run(self) -> None:
        body = {"prompt": "The", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        finally:
            self.ended = time.monotonic()
            self.started.set()


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
        wait_for("/ready", lambda: status(url + "/ready") == 200, timeout=120)
        stream = InFlight(url)
        stream.start()
        stream.started.wait(60)
        group.ranks[1].process.kill()
        check_the_group_is_lost(url, stream, time.monotonic(), rank=1)
        assert group.ranks[0].process.poll() is None  # the leader stays up to say why
