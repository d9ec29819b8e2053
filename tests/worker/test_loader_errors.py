"""A bad checkpoint fails loading with an error that names the file and the tensor. Loading needs
no process group (it never communicates), so these run in the test process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shard_contract.checkpoint import CheckpointError
from shard_worker.comm.dist import Comm, Topology
from shard_worker.model.config import ModelConfig
from shard_worker.model.loader import load_stage
from shard_worker.model.model import Stage
from shard_worker.model.slices import Layout
from shard_worker.telemetry.accounting import Accounting
from tests.support.checkpoints import write_checkpoint
from tests.support.malicious import CORPUS, write_attack

from .conftest import MODELS


def stage_for(model_dir: Path, tp: int = 1, tp_rank: int = 0) -> Stage:
    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=tp, tp_rank=tp_rank, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    comm = Comm(Topology(rank=tp_rank, tp=tp, pp=1), Accounting())
    return Stage(layout, comm, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    args = dict(MODELS["llama"])
    return write_checkpoint(tmp_path_factory.mktemp("good"), args.pop("family"), **args)


@pytest.fixture
def copy(good, tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(good, target)
    return target


def rewrite(model_dir: Path, change) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_good_checkpoint_loads_every_tensor(good):
    stage = stage_for(good)
    stats = load_stage(stage, good)
    full = load_file(good / "model.safetensors")
    assert torch.equal(stage.tensors()["layers.1.down.weight"], full["model.layers.1.mlp.down_proj.weight"])
    assert stats.bytes_read == sum(t.numel() * 4 for t in stage.tensors().values())


def test_column_slices_read_only_their_columns_into_place(good):
    """Rank 1 of 2 reads the right half of each row of the row-parallel weights, many rows per call."""
    stage = stage_for(good, tp=2, tp_rank=1)
    stats = load_stage(stage, good)
    full = load_file(good / "model.safetensors")
    down = full["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(stage.tensors()["layers.0.down.weight"], down[:, down.shape[1] // 2:])
    assert stats.scratch_bytes > 0  # the other rank's columns went to scratch, not into our tensors


def test_missing_tensor(copy):
    rewrite(copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError,
                       match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing .*model\.safetensors"):
        load_stage(stage_for(copy), copy)


def test_shape_mismatch(copy):
    rewrite(copy, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(60, 64)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.q_proj\.weight "
                                              r"has shape \[60, 64\], config\.json implies \[64, 64\]"):
        load_stage(stage_for(copy), copy)


def test_dtype_mismatch(copy):
    rewrite(copy, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.norm\.weight has dtype I32"):
        load_stage(stage_for(copy), copy)


def test_truncated_file(copy):
    path = copy / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor \S+: truncated file"):
        load_stage(stage_for(copy), copy)


def test_pickle_checkpoints_are_refused(copy):
    (copy / "model.safetensors").unlink()
    (copy / "pytorch_model.bin").write_bytes(b"not unpickled, ever")
    with pytest.raises(CheckpointError, match=r"only pickle checkpoints \(pytorch_model\.bin\).*safetensors only"):
        load_stage(stage_for(copy), copy)


def test_index_naming_a_missing_file(tmp_path):
    args = dict(MODELS["qwen2"])
    model_dir = write_checkpoint(tmp_path / "split", args.pop("family"), **args)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    victim = index["model.layers.1.self_attn.k_proj.weight"]
    (model_dir / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"{victim}: missing \(the index maps tensor \S+ to it\)"):
        load_stage(stage_for(model_dir), model_dir)


@pytest.mark.parametrize("attack", CORPUS, ids=lambda a: a.name)
def test_every_malicious_checkpoint_is_refused_by_the_loader(attack, tmp_path):
    """What a rank does: read config.json, then load its slices (the plan came from elsewhere)."""
    model_dir = write_attack(attack, tmp_path)
    with pytest.raises(CheckpointError, match=attack.error):
        load_stage(stage_for(model_dir), model_dir)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_load_progress_counts_every_byte_of_the_ranks_tensors_once(good, tp_rank):
    stage = stage_for(good, tp=2, tp_rank=tp_rank)
    calls: list[tuple[int, int]] = []
    load_stage(stage, good, progress=lambda loaded, total: calls.append((loaded, total)))
    total = sum(t.numel() * t.element_size() for t in stage.tensors().values())
    assert len(calls) == len(stage.tensors()) and {t for _, t in calls} == {total}
    loaded = [n for n, _ in calls]
    assert loaded == sorted(loaded) and loaded[0] > 0 and loaded[-1] == total
