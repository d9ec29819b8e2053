"""The real entry point, `python -m shard_worker`, started by the local launcher and `shardctl
generate`: it generates what HF generates, fails with the rank's own message, and leaves no
process behind on any way out."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from shard_contract.env import WorkerEnv
from shard_contract.wire import GenerateRequest, GenerateTask
from shard_operator.local.launcher import LaunchError, LocalGroup, free_port, run_generate
from shard_worker.__main__ import name_process
from shard_worker.comm.dist import RendezvousError, Topology, init_comm
from shard_worker.telemetry.accounting import Accounting
from tests.support.processes import children, is_worker, shardctl

from .conftest import make_plan

pytestmark = pytest.mark.slow


def test_shardctl_generate_json(checkpoint, hf_model):
    model_dir = checkpoint("llama-4layers")
    proc = shardctl("generate", "--model-dir", str(model_dir), "--tensor", "2", "--pipeline", "1",
                    "--prompt", "w5 w17 w33 w90", "--max-tokens", "5", "--ignore-eos", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out)
    with torch.no_grad():
        expected = hf_model(model_dir).generate(torch.tensor([[5, 17, 33, 90]]), max_new_tokens=5, do_sample=False,
                                                eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert result["token_ids"] == expected
    assert result["text"] == " ".join(f"w{t}" for t in expected if t > 2)
    assert [(p["rank"], p["stage"], p["tp_rank"], p["layers"]) for p in (r["plan"] for r in result["ranks"])] == \
        [(0, 0, 0, [0, 4]), (1, 0, 1, [0, 4])]
    for entry in result["ranks"]:
        r = entry["report"]
        assert entry["plan"]["predicted_bytes"]["weights"] == r["allocated_bytes"]["weights"] > 0
        assert r["resident_bytes"]["rss_anon"] > 0 and r["load_seconds"] > 0
        assert r["comm_seconds"] > 0 and r["compute_seconds"] > 0 and r["idle_seconds"] == 0


def test_rank_failure_reports_the_ranks_own_error(checkpoint, tmp_path):
    """The plan is made from a good checkpoint that breaks before the ranks load it."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint("llama"), model_dir)
    plan = make_plan(model_dir, 1, 1)
    path = model_dir / "model.safetensors"
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 100)
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=[1, 2], max_new_tokens=2)])
    with pytest.raises(LaunchError, match=r"(?s)rank 0 exited with status 78 \(a restart would fail the same way\)"
                                          r".*CheckpointError: \S+model.safetensors: "
                                          r"tensor model.norm.weight: truncated file") as failed:
        run_generate(plan, model_dir, task, timeout=120)
    assert failed.value.permanent


def test_every_rank_is_stopped_when_the_launcher_gives_up(checkpoint, tmp_path):
    model_dir = checkpoint("llama")
    group = LocalGroup(make_plan(model_dir, 2, 1), model_dir, tmp_path)
    with pytest.raises(LaunchError, match="still running after 0s"):
        with group:
            group.wait(timeout=0.3)  # they are still importing torch
    assert len(group.ranks) == 2
    assert all(r.process.returncode is not None for r in group.ranks)
    assert not any(is_worker(pid) for pid in group.pids)


def test_sigterm_to_shardctl_stops_its_ranks(checkpoint):
    model_dir = checkpoint("llama")
    proc = shardctl("generate", "--model-dir", str(model_dir), "--tensor", "2", "--prompt-ids", "1,2,3",
                    "--max-tokens", "4")
    deadline = time.monotonic() + 60
    while len(ranks := [p for p in children(proc.pid) if is_worker(p)]) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not any(is_worker(pid) for pid in ranks)


def test_without_setproctitle_a_rank_keeps_the_name_python_gave_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "setproctitle", None)  # as where it is not installed: import fails
    before = Path("/proc/self/cmdline").read_bytes()
    name_process("shard-worker model=m group=0 rank=0")
    assert Path("/proc/self/cmdline").read_bytes() == before


@pytest.mark.parametrize("rank", [0, 1])
def test_rendezvous_timeout_names_the_address(rank):
    port = free_port()
    env = WorkerEnv(rank=rank, world_size=2, master_port=port, tp_size=2, pp_size=1, plan_file="-",
                    model_dir="-", rendezvous_timeout=2)
    with pytest.raises(RendezvousError, match=rf"rank {rank} of 2: the group did not assemble at 127\.0\.0\.1:{port} "
                                              r"\(MASTER_ADDR:MASTER_PORT\) within 2s"):
        init_comm(env, Topology(rank, 2, 1), torch.device("cpu"), Accounting())
