"""`shardctl demo-model` writes a checkpoint laid out as Hugging Face lays out a large one, with a
real tokenizer; and `make demo` (the README's first command) runs its recipe end to end."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from shard_contract.checkpoint import expected_tensors
from shard_operator.api import load_sharded_models
from shard_operator.local.demo_model import write_demo_model
from shard_operator.planning import PlanError, plan
from shard_operator.planning.inventory import parse_devices
from shard_operator.planning.profile import profile_model
from shard_worker.serving.tokenizer import TextCodec

from .conftest import TINY

REPO = Path(__file__).resolve().parents[2]


def test_the_checkpoint_is_split_over_several_files_with_an_index(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tiny_model.glob("*.safetensors"))
    assert len(files) == TINY.files and sorted(set(index["weight_map"].values())) == files
    shapes = expected_tensors(config)
    assert set(index["weight_map"]) == set(shapes)  # every tensor the worker expects, nothing else
    total = 0
    for file in files:
        with safe_open(str(tiny_model / file), "np") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                assert index["weight_map"][name] == file and list(tensor.shape) == shapes[name]
                assert str(tensor.dtype) == "float32" and tensor.std() > 0
                total += tensor.nbytes
    assert index["metadata"]["total_size"] == total
    profile = profile_model(tiny_model)
    assert (profile.shape.num_layers, profile.shape.hidden_size, profile.shape.vocab_size) == (TINY.layers, TINY.hidden,
                                                                           config["vocab_size"])


def test_a_real_tokenizer_and_chat_template(tiny_model):
    codec = TextCodec.load(tiny_model)
    config = json.loads((tiny_model / "config.json").read_text())
    assert codec.tokenizer.get_vocab_size() == config["vocab_size"] <= TINY.vocab
    text = "Rivers begin as springs in the mountains, naïvely ✓ 42"
    ids = codec.encode(text)
    assert ids[0] == config["bos_token_id"] and len(ids) < len(text)  # merges learned from the corpus
    assert codec.decode(ids) == text  # byte-level: any text round-trips
    prompt = codec.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt == "<s><|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = codec.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(config["bos_token_id"]) == 1 and codec.tokenizer.id_to_token(ids[1]) == "<|user|>"
    assert config["eos_token_id"] == [codec.tokenizer.token_to_id("</s>"), codec.tokenizer.token_to_id("<|end|>")]


def test_an_existing_model_is_not_overwritten_by_accident(tiny_model):
    with pytest.raises(FileExistsError, match="--force"):
        write_demo_model(tiny_model, TINY)
    assert (tiny_model / "config.json").is_file()


def makefile_value(name: str) -> str:
    return re.search(rf"^{name} \?= (.+)$", (REPO / "Makefile").read_text(), re.M)[1].strip()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo`'s own recipe (all but setting up .venv), with the demo model written afresh."""
    import sys

    model_dir = tmp_path_factory.mktemp("demo") / "demo-model"
    result = subprocess.run(["make", "-s", "demo", "DEMO_SETUP=", f"PY={sys.executable}", f"DEMO_MODEL={model_dir}"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    return result, model_dir


@pytest.mark.slow
def test_make_demo_serves_a_model_sharded_over_two_ranks_and_answers(demo):
    result, model_dir = demo
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert (model_dir / "config.json").is_file()
    assert "ShardedModel demo" in out and "decision tensor=2 x pipeline=1" in out  # the plan
    assert re.search(r"ready in [\d.]+ s: serving http://127\.0\.0\.1:\d+/v1", out)
    table = out[out.index("weights + KV cache per rank"):]  # what each rank measured, in the plan's unit
    assert re.search(r"^rank +stage +tp +layers +predicted MiB +measured MiB", table, re.M)
    assert re.search(r"^0 +0 +0 +0-7 \(8 layers\) +[\d.]+ +[\d.]+", table, re.M)
    assert re.search(r"^1 +0 +1 +0-7 \(8 layers\) +[\d.]+ +[\d.]+", table, re.M)
    assert re.search(r"^  rank 1: loaded 100% \(", out[:out.index("ready in")], re.M)  # progress, before ready
    answer = re.search(r"^answer: '(.*)'$", out, re.M)
    assert answer and "(24 tokens, finish_reason length)" in out


@pytest.mark.slow
def test_the_demo_model_fits_two_of_the_demo_budgets_but_not_one(demo):
    _, model_dir = demo
    (model,) = load_sharded_models(REPO / "examples" / "local-demo.yaml")
    profile = profile_model(model_dir)
    devices = makefile_value("DEMO_DEVICES")
    assert devices.endswith("*2")
    two = plan(profile, model.spec, parse_devices(devices, kind="cpu"))
    assert (two.tensor_parallel * two.pipeline_parallel, two.world_size) == (2, 2)
    with pytest.raises(PlanError) as info:
        plan(profile, model.spec, parse_devices(devices.removesuffix("*2"), kind="cpu"))
    assert info.value.reason == "InsufficientCapacity"
