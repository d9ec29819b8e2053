"""`shardctl plan` and `shardctl crd`, run in-process and once through the console script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shard_operator.api import load_sharded_models, resolve_model_dir
from shard_operator.cli import main
from shard_operator.inventory import inventory_from_nodes, load_nodes
from shard_operator.profile import profile_model
from shard_operator.replan import choose_plan
from shard_operator.settings import Settings
from tests.support.malicious import ATTACKS, CORPUS, write_attack

ROOT = Path(__file__).resolve().parents[3]
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


# The operator's planner_options: more runtime memory per GPU rank, a slow collective inside a pod.
PLANNER_OPTIONS = '{"runtime_overhead": {"gpu": 3221225472}, "transport": {"collective_in_pod": {"gpu": 0.001}}}'


@pytest.mark.parametrize("given", ["flag", "environment"])
def test_plan_takes_the_operators_planner_options(capsys, monkeypatch, given):
    """The same JSON, as --planner-options or the operator's own variable, plans what the operator plans."""
    argv = ["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--nodes", str(EXAMPLES / "nodes.yaml"), "--json"]
    default = json.loads(run(capsys, *argv)[1])
    if given == "flag":
        argv += ["--planner-options", PLANNER_OPTIONS]
    else:
        monkeypatch.setenv("SHARD_OPERATOR_PLANNER_OPTIONS", PLANNER_OPTIONS)
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    model = load_sharded_models(EXAMPLES / "llama-70b.yaml")[0]
    settings = Settings.from_env({"SHARD_OPERATOR_PLANNER_OPTIONS": PLANNER_OPTIONS})
    operators = choose_plan(None, profile_model(resolve_model_dir(model.spec.model, base=EXAMPLES)), model.spec,
                            inventory_from_nodes(load_nodes(EXAMPLES / "nodes.yaml"), model.spec.placement),
                            options=settings.planner_options).plan
    assert json.loads(out) == json.loads(operators.to_json()) != default
    assert {r["predicted_bytes"]["overhead"] for r in json.loads(out)["ranks"]} == {3 * 2**30}


@pytest.mark.parametrize("argv, message", [
    (["plan", "-f", "/nonexistent.yaml", "--devices", "a:1GiB"], "No such file"),
    (["plan", "-f", str(EXAMPLES / "nodes.yaml"), "--devices", "a:1GiB"], "no object of kind ShardedModel"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:lots"], "write NODE:MEMORY"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:80XB"], "is not a memory size"),
    (["plan", "-f", str(EXAMPLES / "shardedmodel.yaml"), "--devices", "a:1GiB"], "config.json: missing"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:80GiB", "--planner-options", '{"tolerance": 1'],
     "--planner-options: planner options"),
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
    assert "InvalidParallelism: spec.parallelism.tensor: tensor=3 does not divide the 64 attention heads; " \
           "valid: 1, 2, 4, 8, 16, 32, 64" in err


def test_replicas_that_do_not_all_fit_print_the_plan_of_those_that_do_and_exit_2(capsys):
    code, out, err = run(capsys, "plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:80GiB*4")
    assert code == 2
    assert "1 of 2 replicas (the others do not fit)" in out and "group 0: critical path" in out
    assert "group 1" not in out
    assert err.startswith("shardctl: InsufficientCapacity: 2 replicas wanted, 1 fits: 1 more needs about")


def test_impossible_parallelism_is_named_before_the_devices_are_looked_at(capsys, tmp_path):
    text = (EXAMPLES / "llama-70b.yaml").read_text().replace("pipeline: auto", "pipeline: 100") \
        .replace("sharding.dev/pool: inference", "sharding.dev/pool: nowhere")  # no node either
    (tmp_path / "models").symlink_to(EXAMPLES / "models")
    (tmp_path / "sm.yaml").write_text(text)
    code, _, err = run(capsys, "plan", "-f", str(tmp_path / "sm.yaml"), "--nodes", str(EXAMPLES / "nodes.yaml"))
    assert code == 1
    assert "InvalidParallelism: spec.parallelism.pipeline=100 exceeds the 80 decoder layers; valid: 1 to 80" in err


def test_dev_cluster_faults_are_checked_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["dev-cluster", "--faults", "error=0.1,eror=0.2"])
    assert exit_.value.code == 2 and "unknown fault 'eror'" in capsys.readouterr().err


def test_console_script_prints_the_crd():
    shardctl = Path(sys.executable).with_name("shardctl")
    out = subprocess.run([str(shardctl), "crd"], capture_output=True, text=True, check=True).stdout
    assert out == (ROOT / "crds" / "shardedmodels.yaml").read_text()


MODEL_IN_VOLUME = """apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata: {{name: m}}
spec:
  model: {{path: {path}, volume: {{hostPath: {{path: {volume}}}}}}}
"""


def write_sm(tmp_path: Path, path: str, volume: Path) -> Path:
    (tmp_path / "sm.yaml").write_text(MODEL_IN_VOLUME.format(path=path, volume=volume))
    return tmp_path / "sm.yaml"


@pytest.mark.parametrize("attack", CORPUS, ids=lambda a: a.name)
def test_plan_refuses_every_malicious_checkpoint_in_one_line(capsys, tmp_path, attack):
    write_attack(attack, tmp_path)
    code, out, err = run(capsys, "plan", "-f", str(write_sm(tmp_path, "model", tmp_path)), "--devices", "a:1GiB")
    assert (code, out) == (1, "")
    assert err.startswith("shardctl: ") and err.count("\n") == 1 and re.search(attack.error, err), err


@pytest.mark.parametrize("name", ["index-parent-escape", "negative-offsets"])
def test_run_refuses_a_malicious_checkpoint_before_any_rank_starts(capsys, tmp_path, name):
    write_attack(ATTACKS[name], tmp_path)
    code, out, err = run(capsys, "run", "-f", str(write_sm(tmp_path, "model", tmp_path)), "--devices", "a:1GiB")
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and re.search(ATTACKS[name].error, err), err
