"""Reading a checkpoint: config.json and safetensors headers, never tensor data, never pickle.

Both planes use it: the operator's profiler (sizes from the headers) and the worker's loader (the
byte ranges of its own slices). A model directory holds `config.json` and either one
`model.safetensors` or several files named by `model.safetensors.index.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
# config.json's torch_dtype / our dtype names -> bytes per element
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
SAFETENSORS_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


class CheckpointError(ValueError):
    """A model directory that cannot be read; the message names the file and tensor."""


class TensorInfo(BaseModel):
    file: str
    dtype: str
    shape: list[int]
    numel: int
    nbytes: int


# ---------------------------------------------------------------- config.json
def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a model directory needs the HF config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    architectures = config.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: architecture {architectures or 'unset'} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise CheckpointError(f"{path}: {key} must be a positive integer (got {config.get(key)!r})")
    return config


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-family model, from config.json: parsed here once for both planes (the
    planner's profile and the worker's `ModelConfig` both start from it)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        """From a config that `read_config` accepted."""
        heads = config["num_attention_heads"]
        arch = next(a for a in config["architectures"] if a in SUPPORTED_ARCHITECTURES)
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings") or 4096,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(config.get("attention_bias", False)),
            o_bias=not qwen2 and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    def expected_tensors(self) -> dict[str, list[int]]:
        """Name -> shape of every tensor an HF checkpoint of this shape holds."""
        hidden, inter, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [self.vocab_size, hidden]}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = [q_out, hidden]
            shapes[p + "self_attn.k_proj.weight"] = [kv_out, hidden]
            shapes[p + "self_attn.v_proj.weight"] = [kv_out, hidden]
            shapes[p + "self_attn.o_proj.weight"] = [hidden, q_out]
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = [q_out]
                shapes[p + "self_attn.k_proj.bias"] = [kv_out]
                shapes[p + "self_attn.v_proj.bias"] = [kv_out]
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = [hidden]
            shapes[p + "mlp.gate_proj.weight"] = [inter, hidden]
            shapes[p + "mlp.up_proj.weight"] = [inter, hidden]
            shapes[p + "mlp.down_proj.weight"] = [hidden, inter]
            if self.mlp_bias:
                shapes[p + "mlp.gate_proj.bias"] = [inter]
                shapes[p + "mlp.up_proj.bias"] = [inter]
                shapes[p + "mlp.down_proj.bias"] = [hidden]
            shapes[p + "input_layernorm.weight"] = [hidden]
            shapes[p + "post_attention_layernorm.weight"] = [hidden]
        shapes["model.norm.weight"] = [hidden]
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = [self.vocab_size, hidden]
        return shapes


def expected_tensors(config: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> shape of every tensor an HF checkpoint of this config holds."""
    return ModelShape.from_config(config).expected_tensors()


# ---------------------------------------------------------------- safetensors headers
def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of one safetensors file, checked against the file's real size.

    Reads 8 + header-length bytes and nothing else.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb", buffering=0) as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {header_len} "
                                      f"does not fit in a file of {size} bytes)")
            raw = fh.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_bytes = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BYTES \
                or not isinstance(entry.get("shape"), list) or len(entry.get("data_offsets") or []) != 2:
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {entry!r}")
        start, stop = entry["data_offsets"]
        count = shape_numel(entry["shape"])
        if stop - start != count * DTYPE_BYTES[entry["dtype"]]:
            raise CheckpointError(f"{path}: tensor {name}: {stop - start} bytes stored for shape "
                                  f"{entry['shape']} of {entry['dtype']}")
        if stop > data_bytes:
            raise CheckpointError(f"{path}: tensor {name}: truncated file (tensor ends at byte "
                                  f"{8 + header_len + stop}, the file has {size})")
    return header


def checkpoint_files(model_dir: str | os.PathLike[str]) -> dict[str, str] | None:
    """Tensor name -> file name, from the index or the single file; None when no weights exist."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err!r})") from None
        return dict(weight_map)
    single = model_dir / "model.safetensors"
    if single.is_file():
        header = read_safetensors_header(single)
        return {name: single.name for name in header if name != "__metadata__"}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickles:
        raise CheckpointError(f"{model_dir}: only pickle checkpoints ({', '.join(pickles)}); "
                              "shard-operator loads safetensors only (pickle can run code)")
    return None


def read_tensor_infos(model_dir: str | os.PathLike[str]) -> dict[str, TensorInfo] | None:
    """Every tensor's file, dtype and shape from the headers; None when no weights exist."""
    model_dir = Path(model_dir)
    weight_map = checkpoint_files(model_dir)
    if weight_map is None:
        return None
    headers = {}
    for file in sorted(set(weight_map.values())):
        if not (model_dir / file).is_file():
            first = next(n for n, f in sorted(weight_map.items()) if f == file)
            raise CheckpointError(f"{model_dir / file}: missing (the index maps tensor {first} to it)")
        headers[file] = read_safetensors_header(model_dir / file)
    infos = {}
    for name, file in sorted(weight_map.items()):
        entry = headers[file].get(name)
        if entry is None:
            raise CheckpointError(f"{model_dir / file}: tensor {name} is listed in the index but absent from the file")
        count = shape_numel(entry["shape"])
        infos[name] = TensorInfo(file=file, dtype=entry["dtype"], shape=entry["shape"], numel=count,
                                 nbytes=count * DTYPE_BYTES[entry["dtype"]])
    return infos


class CheckpointFacts(BaseModel):
    """What a model directory says about itself: config.json, and every tensor's file, dtype and
    shape from the safetensors headers (None when there are no weights yet: a model can be planned
    from config.json alone). The profiling Pod prints this as one line of JSON."""

    name: str
    config: dict[str, Any]
    tensors: dict[str, TensorInfo] | None
    digest: str = Field(description="sha256 of config.json and every safetensors header.")


def read_checkpoint(model_dir: str | os.PathLike[str]) -> CheckpointFacts:
    """Read and check a model directory: config.json, and when there are weights, every header,
    with every tensor the config implies present in its shape (a partial checkpoint fails here)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    infos = read_tensor_infos(model_dir)
    name = model_dir.resolve().name
    if infos is None:
        return CheckpointFacts(name=name, config=config, tensors=None,
                               digest=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest())
    for tensor, shape in expected_tensors(config).items():
        info = infos.get(tensor)
        if info is None:
            files = ", ".join(sorted({i.file for i in infos.values()}))
            raise CheckpointError(f"{model_dir}: tensor {tensor} is missing from the checkpoint ({files})")
        if info.shape != shape:
            raise CheckpointError(f"{model_dir / info.file}: tensor {tensor} has shape {info.shape}, "
                                  f"config.json implies {shape}")
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in sorted({info.file for info in infos.values()}):
        digest.update(json.dumps({n: i.model_dump() for n, i in infos.items() if i.file == file},
                                 sort_keys=True).encode())
    return CheckpointFacts(name=name, config=config, tensors=infos, digest=digest.hexdigest())


def shape_numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def main(argv: list[str] | None = None) -> int:
    """`python -m shard_contract.checkpoint DIR`: print the directory's `CheckpointFacts` as one
    line of JSON. The profiling Pod runs it (in the worker image) when the operator cannot read the
    model's volume itself; the operator reads the line from the Pod's log."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shard_contract.checkpoint MODEL_DIR", file=sys.stderr)
        return 2
    try:
        facts = read_checkpoint(args[0])
    except (CheckpointError, OSError) as err:
        print(f"reading the checkpoint failed: {err}", file=sys.stderr)
        return 1
    print(facts.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
