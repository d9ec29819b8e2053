"""`python -m shard_worker.launch --local-ranks N`, the command of a pod that holds a
tensor-parallel group's GPUs: N rank processes with their own RANK, LOCAL_RANK and SHARD_PORT,
kept as one (a rank that fails stops the others and fails the pod; SIGTERM reaches every rank).
The children here are small scripts in the ranks' place; the dev cluster's end-to-end test runs
real ranks this way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shard_contract.env import WorkerEnvError
from shard_worker.launch import rank_environ, supervise

POD = {"RANK": "2", "WORLD_SIZE": "4", "TP_SIZE": "2", "PP_SIZE": "2", "SHARD_PLAN": "/etc/plan.json",
       "SHARD_MODEL_DIR": "/models/m", "SHARD_PORT": "8000", "MASTER_ADDR": "leader.group.ns.svc"}


def test_each_rank_of_the_pod_gets_its_rank_local_rank_and_port():
    envs = [rank_environ(POD, i, 2) for i in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["SHARD_PORT"]) for e in envs] == [("2", "0", "8000"), ("3", "1", "8001")]
    assert all(e["MASTER_ADDR"] == POD["MASTER_ADDR"] and e["WORLD_SIZE"] == "4" for e in envs)
    with pytest.raises(WorkerEnvError, match="RANK=2 with --local-ranks 3 runs ranks past WORLD_SIZE=4"):
        rank_environ(POD, 0, 3)


def child(script: str) -> list[str]:
    return [sys.executable, "-c", "import os, sys, time, signal\n" + script]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_rank_runs_and_the_pod_succeeds_when_all_do(tmp_path):
    script = f"open({str(tmp_path)!r} + '/' + os.environ['LOCAL_RANK'], 'w').write(os.environ['RANK'])"
    assert supervise(3, child(script), {**POD, "RANK": "0", "WORLD_SIZE": "4"}) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "0", "1": "1", "2": "2"}


def test_the_callers_signal_handlers_are_back_after_the_ranks_end():
    def mine(*_):
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert supervise(1, child("sys.exit(0)"), {**POD, "RANK": "0", "WORLD_SIZE": "4"}) == 0
        assert supervise(1, child("sys.exit(5)"), {**POD, "RANK": "0", "WORLD_SIZE": "4"}) == 5
        assert all(signal.getsignal(sig) is mine for sig in before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("how, status", [("sys.exit(3)", 3), ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9)])
def test_a_failing_rank_stops_the_others_and_fails_the_pod(tmp_path, how, status):
    # local rank 1 fails once every rank has written its pid (however slowly they start on a busy
    # machine); the others would run for an hour: stopped, they end long before
    script = (f"d, rank = {str(tmp_path)!r}, os.environ['LOCAL_RANK']\n"
              "open(f'{d}/.pid{rank}', 'w').write(str(os.getpid())); os.rename(f'{d}/.pid{rank}', f'{d}/pid{rank}')\n"
              "if rank == '1':\n"
              "    while len([n for n in os.listdir(d) if n.startswith('pid')]) < 3: time.sleep(0.01)\n"
              f"    {how}\n"
              "time.sleep(3600)")
    start = time.monotonic()
    assert supervise(3, child(script), {**POD, "RANK": "0", "WORLD_SIZE": "4"}) == status
    assert time.monotonic() - start < 600  # a generous bound: far less than the hour they would run
    pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(3)]
    assert not any(alive(pid) for pid in pids)


def test_sigterm_reaches_every_rank_and_a_clean_stop_is_a_success(tmp_path):
    script = (f"signal.signal(signal.SIGTERM, lambda *_: (open({str(tmp_path)!r} + '/stopped' + "
              "os.environ['LOCAL_RANK'], 'w').close(), sys.exit(0)))\n"
              f"open({str(tmp_path)!r} + '/up' + os.environ['LOCAL_RANK'], 'w').close()\ntime.sleep(60)")
    driver = ("import sys; from shard_worker.launch import supervise; "
              f"sys.exit(supervise(2, {json.dumps(child(script))}))")
    launcher = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ, **POD, "RANK": "0"})
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"up{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 0
        assert all((tmp_path / f"stopped{i}").exists() for i in range(2))
    finally:
        launcher.kill()
