"""The model profile: bytes from safetensors headers only, or from config.json alone."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shard_contract.checkpoint import CheckpointError, expected_tensors, read_safetensors_header
from shard_operator.planning.profile import profile_from_config, profile_model

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_profile_bytes_equal_the_real_tensors(hf_checkpoint, architecture, max_shard_size):
    directory, sizes = hf_checkpoint(architecture, max_shard_size)
    profile = profile_model(directory)
    assert profile.source == "safetensors"
    assert profile.checkpoint_bytes == sum(sizes.values())
    assert profile.total_numel * 4 == sum(sizes.values())  # float32 checkpoint
    if max_shard_size:
        assert len(profile.files) > 1
    layer_bytes = sum(v for k, v in sizes.items() if k.startswith("model.layers.0."))
    assert profile.layers[0].numel * 4 == layer_bytes
    assert profile.embed_numel * 4 == sizes["model.embed_tokens.weight"]
    assert profile.lm_head_numel * 4 == sizes["lm_head.weight"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_config_alone_gives_the_same_profile(hf_checkpoint, architecture, tmp_path):
    directory, _ = hf_checkpoint(architecture, tie_word_embeddings=True)
    from_weights = profile_model(directory)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((directory / "config.json").read_text())
    from_config = profile_model(config_only)
    assert from_config.source == "config"
    assert from_config.lm_head_numel == 0 and from_weights.lm_head_numel == 0  # tied: stored once
    for field in ("embed_numel", "final_norm_numel", "layers", "shape", "total_numel"):
        assert getattr(from_config, field) == getattr(from_weights, field), field


def test_qwen2_biases_split_with_their_projections(hf_checkpoint):
    directory, sizes = hf_checkpoint("Qwen2ForCausalLM")
    layer = profile_model(directory).layers[0]
    assert sizes["model.layers.0.self_attn.q_proj.bias"] > 0
    q = sizes["model.layers.0.self_attn.q_proj.weight"] + sizes["model.layers.0.self_attn.q_proj.bias"]
    mlp = sizes["model.layers.0.mlp.gate_proj.weight"] + sizes["model.layers.0.mlp.up_proj.weight"]
    assert layer.column * 4 == q + mlp
    kv = sum(sizes[f"model.layers.0.self_attn.{p}_proj.{t}"] for p in "kv" for t in ("weight", "bias"))
    assert layer.kv * 4 == kv


def test_kv_bytes_per_token():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "vocab_size": 128256, "torch_dtype": "bfloat16"}
    profile = profile_from_config(config)
    # 2 (K and V) x 80 layers x 8 heads x 128 dims x 2 bytes = 320 KiB per token
    assert profile.kv_bytes_per_token() == 327680
    assert profile.kv_bytes_per_token("float32") == 655360


def _sparse_checkpoint(directory: Path, config: dict) -> tuple[int, int]:
    """A checkpoint of the config's full size whose data is a hole: the header is real."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, shape in expected_tensors(config).items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path = directory / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return path.stat().st_size, len(raw)


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_profiling_a_multi_gb_checkpoint_reads_under_one_megabyte(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "vocab_size": 32000, "torch_dtype": "bfloat16"}
    size, header_len = _sparse_checkpoint(tmp_path / "llama-7b", config)
    assert size > 12 * 2**30
    before = _bytes_read()
    profile = profile_model(tmp_path / "llama-7b")
    read = _bytes_read() - before
    assert profile.checkpoint_bytes == size - 8 - header_len
    assert profile.total_numel > 6.7e9
    assert read < 2**20, f"read {read} bytes"


# ---------------------------------------------------------------- errors name the file and tensor
def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    with pytest.raises(CheckpointError, match=r"config.json: architecture \['GPT2LMHeadModel'\] is not supported"):
        profile_model(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        profile_model(tmp_path)


def test_file_listed_in_index_is_missing(hf_checkpoint):
    directory, _ = hf_checkpoint(max_shard_size="40KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (directory / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"{victim}: missing \(the index maps tensor .+ to it\)"):
        profile_model(directory)


def test_tensor_in_index_absent_from_its_file(hf_checkpoint):
    directory, _ = hf_checkpoint(max_shard_size="40KB")
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{other}: tensor {name} is listed in the index but absent"):
        profile_model(directory)


def test_header_that_is_not_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10}))
    (tmp_path / "model.safetensors").write_bytes(b"<html>not found</html>")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a safetensors file"):
        profile_model(tmp_path)


def test_truncated_file_names_the_tensor(hf_checkpoint):
    directory, _ = hf_checkpoint()
    path = directory / "model.safetensors"
    header = read_safetensors_header(path)
    last = max(header, key=lambda k: header[k].offset + header[k].nbytes)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor {last}: truncated file"):
        profile_model(directory)


def test_missing_tensor_is_named(hf_checkpoint):
    from safetensors.torch import load_file, save_file
    directory, _ = hf_checkpoint()
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor model.layers.2.self_attn.k_proj.weight is missing"):
        profile_model(directory)


def test_pickle_checkpoints_are_refused(tmp_path, hf_checkpoint):
    directory, _ = hf_checkpoint()
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(CheckpointError, match=r"only pickle checkpoints \(pytorch_model.bin\).+safetensors only"):
        profile_model(directory)


def test_a_profile_cached_without_the_int8_counts_is_profiled_again():
    """The operator re-profiles a cached profile that fails validation; one written before the
    int8 counts existed must fail, not count int8 weights with zeros."""
    import json

    from pydantic import ValidationError

    from shard_operator.planning.profile import ModelProfile

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
    layer = profile_from_config(config).layers[0]
    # q, gate, up rows and elements; k, v; o and down rows (what an int8 rank keeps scales of)
    assert (layer.column_rows, layer.kv_rows, layer.row_rows) == (8192 + 2 * 28672, 2 * 1024, 2 * 8192)
    assert (layer.column_matrix, layer.kv_matrix) == (8192 * 8192 + 2 * 28672 * 8192, 2 * 1024 * 8192)
    profile = profile_from_config(config)
    old = json.loads(profile.model_dump_json())
    for layer in old["layers"]:
        for key in ("column_matrix", "kv_matrix", "column_rows", "kv_rows", "row_rows"):
            del layer[key]
    with pytest.raises(ValidationError):
        ModelProfile.model_validate_json(json.dumps(old))
