"""`shardctl plan` and `shardctl crd`, run in-process and once through the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shard_operator.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table_for_a_node_pool(capsys):
    code, out, err = run(capsys, "plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--nodes", str(EXAMPLES / "nodes.yaml"))
    assert code == 0, err
    assert "decision tensor=8 x pipeline=1" in out
    assert "skipped gpu-l40s-b: cordoned" in out
    assert out.count("gpu-h100-a     cuda:") == 8 and out.count("gpu-h100-b     cuda:") == 8
    assert "group 1: critical path est." in out
    assert "█" in out


def test_plan_json_has_the_documented_fields(capsys):
    code, out, _ = run(capsys, "plan", "-f", str(EXAMPLES / "pipeline-explicit.yaml"),
                       "--model-dir", str(EXAMPLES / "models" / "llama-3-8b"), "--devices", "n1:24GiB*2,n2:24GiB*2", "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["tensor_parallel"], data["pipeline_parallel"], data["replicas"]) == (2, 2, 1)
    assert data["stages"] == [{"stage": 0, "layers": [0, 18], "seconds_per_token": data["stages"][0]["seconds_per_token"]},
                              {"stage": 1, "layers": [18, 32], "seconds_per_token": data["stages"][1]["seconds_per_token"]}]
    assert data["imbalance"] > 0  # 18 vs 14 layers on equal devices
    rank = data["ranks"][3]
    for key in ("replica", "rank", "stage", "tp_rank", "node", "device", "layers", "capacity_bytes", "predicted_bytes"):
        assert key in rank
    assert (rank["rank"], rank["stage"], rank["tp_rank"], rank["node"], rank["layers"]) == (3, 1, 1, "n2", [18, 32])
    predicted = rank["predicted_bytes"]
    assert predicted["total"] == sum(predicted[k] for k in ("weights", "kv_cache", "activations", "overhead"))


def test_plan_of_a_real_checkpoint(capsys, hf_checkpoint):
    directory, _ = hf_checkpoint(max_shard_size="40KB")
    code, out, err = run(capsys, "plan", "-f", str(EXAMPLES / "shardedmodel.yaml"), "--model-dir", str(directory),
                         "--devices", "local:300MiB*2", "--device-kind", "cpu", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert {r["device"] for r in data["ranks"]} <= {"cpu:0", "cpu:1"}


def test_infeasible_exits_2_with_the_reason_on_stderr(capsys):
    code, out, err = run(capsys, "plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:24GiB*2")
    assert code == 2 and out == ""
    assert err.startswith("shardctl: InsufficientCapacity: llama-3-70b does not fit")
    assert "To make it fit:" in err


@pytest.mark.parametrize("argv, message", [
    (["plan", "-f", "/nonexistent.yaml", "--devices", "a:1GiB"], "No such file"),
    (["plan", "-f", str(EXAMPLES / "nodes.yaml"), "--devices", "a:1GiB"], "no object of kind ShardedModel"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:lots"], "write NODE:MEMORY"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:80XB"], "is not a memory size"),
    (["plan", "-f", str(EXAMPLES / "shardedmodel.yaml"), "--devices", "a:1GiB"], "config.json: missing"),
])
def test_bad_input_exits_1(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 1 and message in err


def test_run_refuses_an_api_key_file_it_cannot_use_before_any_rank_starts(capsys, hf_checkpoint, tmp_path):
    directory, _ = hf_checkpoint()
    key_file = tmp_path / "key"
    for key in (None, "", " \n"):
        if key is not None:
            key_file.write_text(key)
        code, out, err = run(capsys, "run", "-f", str(EXAMPLES / "shardedmodel.yaml"), "--model-dir", str(directory),
                             "--devices", "local:300MiB*2", "--api-key-file", str(key_file))
        assert code == 1 and f"shardctl: SHARD_API_KEY_FILE {key_file}" in err
        assert ("No such file or directory" if key is None else "is empty") in err
        assert "starting" not in out  # no rank was started


def test_invalid_parallelism_is_bad_input_not_infeasible(capsys, tmp_path):
    text = (EXAMPLES / "llama-70b.yaml").read_text().replace("tensor: auto", "tensor: 3")
    (tmp_path / "models").symlink_to(EXAMPLES / "models")
    (tmp_path / "sm.yaml").write_text(text)
    code, _, err = run(capsys, "plan", "-f", str(tmp_path / "sm.yaml"), "--devices", "a:80GiB*8")
    assert code == 1
    assert "InvalidParallelism: spec.parallelism.tensor: tensor=3 does not divide the 64 attention heads" in err


def test_console_script_prints_the_crd():
    shardctl = Path(sys.executable).with_name("shardctl")
    out = subprocess.run([str(shardctl), "crd"], capture_output=True, text=True, check=True).stdout
    assert out == (ROOT / "crds" / "shardedmodels.yaml").read_text()
