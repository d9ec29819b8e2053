"""`shardctl run` watches its group: a rank that dies is reported by rank and cause, the group is
restarted within its budget and serves again, and past the budget shardctl exits non-zero with no
process left behind, keeping the ranks' logs. A port another process holds fails it at once."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
from pathlib import Path

import httpx
import pytest
import torch

from shard_operator.cli import main
from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import free_port, plan_local
from shard_operator.local.run import run_local
from tests.support.malicious import ATTACKS, write_attack, write_good
from tests.support.offload import streaming_plan
from tests.support.processes import alive, rank_port, shardctl, worker_ranks

from .conftest import get, sharded_model_yaml, stop, wait_for

pytestmark = pytest.mark.slow


def test_a_crashed_rank_restarts_the_group_then_exhausts_the_budget(tiny_model, tmp_path):
    yaml_file = sharded_model_yaml(tmp_path / "m.yaml", tiny_model, name="crashy", tensor=1, pipeline=2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = shardctl("run", "-f", str(yaml_file), "--port", str(port), "--devices", "localhost:1GiB*2",
                    "--restarts", "1")
    seen: list[int] = []
    try:
        for attempt in range(2):
            wait_for("/ready", lambda: proc.poll() is not None or ((r := get(url + "/ready")) is not None
                     and r.status_code == 200), timeout=180)
            assert proc.poll() is None
            answer = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "model": "crashy"},
                                timeout=60)
            assert answer.status_code == 200, answer.text
            page = httpx.get(url + "/dashboard/layout.svg", timeout=10)  # the live page, on shardctl run's port
            assert page.status_code == 200 and page.text.count('data-alive="true"') == 2
            ranks = worker_ranks(proc.pid)
            assert sorted(ranks) == [0, 1] and not set(ranks.values()) & set(seen)  # a fresh group each time
            seen += ranks.values()
            os.kill(ranks[1], signal.SIGKILL)
            if attempt == 0:  # the group is replaced: rank 0 stops answering, then a new one is ready
                wait_for("the old group stops", lambda: not alive(ranks[0]), timeout=60)
        out, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode == 3
    assert err.count("shardctl: rank 1 was killed by SIGKILL; its log ends:") == 2
    assert "restarting the group (1 of 1)" in err
    assert "the group failed 2 times; no restarts left" in err
    assert not any(alive(pid) for pid in seen)
    # The logs it named are still there to read, and it says so.
    named = logs_named(out)
    assert [p.name for p in named] == ["attempt-0", "attempt-1"]
    try:
        assert f"shardctl: the ranks' logs are kept in {named[0].parent}" in err
        for attempt in named:
            assert "loaded in" in (attempt / "rank-1.log").read_text()  # the rank that was killed
    finally:
        shutil.rmtree(named[0].parent)


def logs_named(out: str) -> list[Path]:
    """The log directories `shardctl run` told its user about."""
    return [Path(p) for p in re.findall(r"logs in (\S+)\)", out)]


def test_ctrl_c_stops_every_rank(tiny_model, tmp_path):
    yaml_file = sharded_model_yaml(tmp_path / "m.yaml", tiny_model, name="interrupted", tensor=2, pipeline=1)
    port = free_port()
    proc = shardctl("run", "-f", str(yaml_file), "--port", str(port), "--devices", "localhost:1GiB*2")
    said = []
    try:
        while (line := proc.stdout.readline()) and not line.startswith("Ctrl-C stops every rank"):  # it serves
            said.append(line)
        ranks = worker_ranks(proc.pid)
        assert sorted(ranks) == [0, 1]
        ports = {rank: rank_port(pid) for rank, pid in ranks.items()}
        assert ports[0] == port
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    out = "".join(said) + out
    assert proc.returncode == 130 and "stopped every rank" in err
    assert not any(alive(pid) for pid in ranks.values())
    assert f"each rank's metrics (Prometheus text):\n  rank 0  http://127.0.0.1:{port}/metrics\n" \
           f"  rank 1  http://127.0.0.1:{ports[1]}/metrics\n" in out
    (logs,) = logs_named(out)
    assert not logs.parent.exists() and "kept" not in err  # nothing failed: its temporary logs are gone


def test_a_rank_refuses_a_malicious_checkpoint_and_the_run_exits_with_its_message(tmp_path):
    """The checkpoint was good when it was planned and is malicious when the rank loads it: a
    restart would read the same bytes, so the run gives up at once, restarts left or not."""
    attack = ATTACKS["negative-offsets"]  # before: header bytes loaded silently as model.norm.weight
    plan = plan_local(write_good(tmp_path / "planned"), 1, 1, max_model_len=64, devices="localhost:1GiB",
                      device_kind="cpu")
    lines: list[str] = []
    code = run_local(plan, write_attack(attack, tmp_path / "loaded"), port=free_port(), restarts=2,
                     ready_timeout=120, out=lines.append, err=lines.append, log_dir=tmp_path / "logs")
    text = "\n".join(lines)
    assert code == 3
    assert re.search(r"shardctl: rank 0 exited with status 78 \(a restart would fail the same way\); its log ends:\n"
                     r"(?s:.*)CheckpointError: \S+" + attack.error, text), text
    assert "not restarting the group: a restart would fail the same way" in text
    assert "restarting the group (" not in text
    assert logs_named("\n".join(lines)) == [tmp_path / "logs" / "attempt-0"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rank planned on a GPU starts where there is CUDA")
def test_a_rank_planned_on_a_gpu_without_cuda_fails_at_once(tiny_model, tmp_path):
    """`--device-kind gpu` on a machine without CUDA: the rank refuses its plan (PlanMismatch), which
    no restart can change, so `shardctl run` fails at once with the rank's message instead of
    starting the group twice more (its default --restarts 2)."""
    yaml_file = sharded_model_yaml(tmp_path / "m.yaml", tiny_model, name="nogpu", tensor=1, pipeline=1)
    proc = shardctl("run", "-f", str(yaml_file), "--port", "0", "--devices", "localhost:16GiB",
                    "--device-kind", "gpu", "--log-dir", str(tmp_path / "logs"))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode == 3, err
    assert re.search(r"shardctl: rank 0 exited with status 78 \(a restart would fail the same way\); its log ends:\n"
                     r"(?s:.*)PlanMismatch: the plan puts rank 0 on cuda:0, but CUDA is not available in this process",
                     err), err
    assert "not restarting the group" in err and "restarting the group (" not in err
    assert logs_named(out) == [tmp_path / "logs" / "attempt-0"]


def test_logs_go_to_the_log_dir_and_stay(tiny_model, tmp_path):
    yaml_file = sharded_model_yaml(tmp_path / "m.yaml", tiny_model, name="logged", tensor=1, pipeline=1)
    proc = shardctl("run", "-f", str(yaml_file), "--port", "0", "--devices", "localhost:1GiB",
                    "--log-dir", str(tmp_path / "logs"), "--prompt", "x", "--max-tokens", "2")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert logs_named(out) == [tmp_path / "logs" / "attempt-0"]
    assert "loaded in" in (tmp_path / "logs" / "attempt-0" / "rank-0.log").read_text()


@pytest.mark.parametrize("flag", ["--port", "--rendezvous-port"])
def test_a_port_another_process_holds_fails_at_once_naming_it(capsys, flag):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        other = ["--port", "0"] if flag == "--rendezvous-port" else []
        code = main(["run", "-f", "no-such-file.yaml", flag, str(port), *other])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""  # before anything is planned or started
    assert err == (f"shardctl: {flag} {port}: cannot listen on 127.0.0.1:{port} (Address already in use); another "
                   f"process holds it: stop it, or choose another port ({flag} 0 takes a free one)\n")


def test_a_model_twice_the_devices_budget_is_served_by_streaming_half_its_layers(tmp_path):
    """`shardctl run` on a --devices budget that holds half the model's layers (offload auto): it
    plans to stream the other half, serves, and answers exactly as with every layer resident."""
    model = write_demo_model(tmp_path / "deep", DemoShape(layers=8, hidden=128, intermediate=256, heads=4, kv_heads=2,
                                                          vocab=600, max_positions=512, files=2))
    budget = streaming_plan(model, 1, 1, 0.5).ranks[0].capacity_bytes
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text(f"""apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata:
  name: deep
spec:
  model: {{path: {model}, dtype: float32, maxModelLen: 64, maxBatchSize: 1}}
  parallelism: {{tensor: 1, pipeline: 1}}
  placement: {{offload: {{policy: auto}}}}
""")
    answers = {}
    for devices in (f"localhost:{budget}B", "localhost:1GiB"):
        proc = shardctl("run", "-f", str(yaml_file), "--port", "0", "--devices", devices, "--prompt", "the model",
                        "--max-tokens", "8")
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        answers[devices] = re.search(r"answer: (.*)", out)[1]
        if devices != "localhost:1GiB":
            assert "offload auto: the devices cannot hold every layer: rank 0 streams 4 of its 8 layers" in out
            assert re.search(r"^\s+0\s+1,3,5,7\s+2\s", out, re.M), out  # the table: layers 1, 3, 5, 7 in 2 slots
    assert answers[f"localhost:{budget}B"] == answers["localhost:1GiB"]
