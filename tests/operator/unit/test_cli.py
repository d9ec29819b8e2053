"""`shardctl plan` and `shardctl crd`, run in-process and once through the console script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shard_operator.api import load_sharded_models, resolve_model_dir
from shard_operator.cli import build_parser, inventory_for, main
from shard_operator.planning.inventory import inventory_from_nodes, load_nodes, local_kind
from shard_operator.planning.profile import profile_model
from shard_operator.planning.replan import choose_plan
from shard_operator.settings import Settings
from tests.support.malicious import ATTACKS, CORPUS, write_attack

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table_for_a_node_pool(capsys):
    code, out, err = run(capsys, "plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--nodes",
                         str(EXAMPLES / "nodes.yaml"))
    assert code == 0, err
    assert "decision tensor=8 x pipeline=1" in out
    assert "skipped gpu-l40s-b: cordoned" in out
    assert out.count("gpu-h100-a     cuda:") == 8 and out.count("gpu-h100-b     cuda:") == 8
    assert "group 1: critical path est." in out
    assert "█" in out


def test_plan_json_has_the_documented_fields(capsys):
    code, out, _ = run(capsys, "plan", "-f", str(EXAMPLES / "pipeline-explicit.yaml"),
                       "--model-dir", str(EXAMPLES / "models" / "llama-3-8b"), "--devices", "n1:24GiB*2,n2:24GiB*2",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert (data["tensor_parallel"], data["pipeline_parallel"], data["replicas"]) == (2, 2, 1)
    assert data["stages"] == [{"stage": 0, "layers": [0, 18],
                               "seconds_per_token": data["stages"][0]["seconds_per_token"]},
                              {"stage": 1, "layers": [18, 32],
                               "seconds_per_token": data["stages"][1]["seconds_per_token"]}]
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
    assert "To make it fit (each checked by planning again): add 14 more devices of 24.0 GiB (gpu) to node a" in err


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
    (["plan", "-f", "/nonexistent.yaml", "--devices", "a:1GiB"], "shardctl: /nonexistent.yaml: no such file\n"),
    (["plan", "-f", str(EXAMPLES / "nodes.yaml"), "--devices", "a:1GiB"], "no object of kind ShardedModel"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:lots"], "write NODE:MEMORY"),
    (["plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:80XB"], "is not a memory size"),
    (["plan", "-f", str(EXAMPLES / "shardedmodel.yaml"), "--devices", "a:1GiB"],
     "no such directory (spec.model.path 'tiny-llama'"),
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
    code, out, err = run(capsys, "plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--devices", "a:80GiB*3")
    assert code == 2
    assert "1 of 2 replicas (the others do not fit)" in out and "group 0: critical path" in out
    assert "group 1" not in out
    # 256 running rows (maxBatchSize unset) fit three stages, not two tensor-parallel ranks
    assert err.startswith("shardctl: InsufficientCapacity: 2 replicas wanted, 1 fits: tensor=1 x pipeline=3 x 2 "
                          "replicas needs 6 devices; the pool has 3")


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


# ---------------------------------------------------------------- one device kind, and tables
@pytest.fixture
def demo_config(tmp_path) -> Path:
    """The config.json of `make demo`'s model (the planner profiles it from the config alone)."""
    from shard_operator.local.demo_model import DemoShape, hf_config
    (tmp_path / "config.json").write_text(json.dumps(hf_config(DemoShape(), 1024, 1, [2])))
    return tmp_path


def test_plan_and_run_read_the_readme_demo_devices_alike(capsys, demo_config):
    """`--devices localhost:...` is what `shardctl run` runs on: this machine's kind, in both."""
    argv = ["-f", str(EXAMPLES / "local-demo.yaml"), "--model-dir", str(demo_config), "--devices", "localhost:256MiB*2"]
    code, out, err = run(capsys, "plan", *argv, "--json")
    assert code == 0, err
    assert {r["kind"] for r in json.loads(out)["ranks"]} == {local_kind()}
    model = load_sharded_models(EXAMPLES / "local-demo.yaml")[0]
    as_plan = inventory_for(build_parser().parse_args(["plan", *argv]), model)
    as_run = inventory_for(build_parser().parse_args(["run", *argv]), model, here=True)
    assert as_plan == as_run


def test_small_gpu_budgets_that_fit_as_cpu_ranks_get_a_hint(capsys, demo_config):
    code, _, err = run(capsys, "plan", "-f", str(EXAMPLES / "local-demo.yaml"), "--model-dir", str(demo_config),
                       "--devices", "a:256MiB*2")
    assert code == 2 and err.startswith("shardctl: InsufficientCapacity: ") and " does not fit: " in err
    assert err.endswith("These devices were planned as GPUs (2.5 GiB of runtime each): if they are CPU rank budgets, "
                        "--device-kind cpu plans them so, and then it fits.\n")
    code, _, err = run(capsys, "plan", "-f", str(EXAMPLES / "local-demo.yaml"), "--model-dir", str(demo_config),
                       "--devices", "a:256MiB*2", "--device-kind", "cpu")
    assert code == 0, err


def test_plan_table_writes_layer_ranges_one_way_in_one_unit_with_a_legend(capsys, demo_config):
    code, out, _ = run(capsys, "plan", "-f", str(EXAMPLES / "local-demo.yaml"), "--model-dir", str(demo_config),
                       "--devices", "localhost:300MiB*2", "--device-kind", "cpu", "--pipeline", "2", "--tensor", "1")
    assert code == 0
    assert "decision tensor=1 x pipeline=2 as given" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [" ".join(row[5:8]) for row in rows] == ["0-3 (4 layers)", "4-7 (4 layers)"]
    assert any(line.endswith("use  MiB") for line in out.splitlines())  # the table's one unit, in its header
    assert "bar: █ predicted, ░ free below the headroom" in out
    assert "1 replica," in out and "replica(s)" not in out


def test_explain_lists_the_layouts_compared_and_why_each_lost(capsys):
    code, out, _ = run(capsys, "plan", "-f", str(EXAMPLES / "llama-70b.yaml"), "--nodes", str(EXAMPLES / "nodes.yaml"),
                       "--explain")
    assert code == 0
    explained = out.split("\n\n")[-1].splitlines()
    assert re.fullmatch(r"\d+ layouts compared \(the most replicas first.*", explained[0])
    verdicts = dict(line.strip().split(": ", 1) for line in explained[1:])
    assert verdicts["tensor=8 x pipeline=1"].endswith(": chosen")
    assert "no split of the layers fits" in verdicts["tensor=1 x pipeline=1"]
    assert any("slower than" in v for v in verdicts.values())
    assert len(explained) - 1 == int(explained[0].split()[0])
