"""The model profile: how many elements every part of a checkpoint holds, and how they shard.

Read from `config.json` plus the safetensors headers only (8 bytes of length + a JSON header per
file; never the tensor data), or computed from `config.json` alone so a 70B model can be planned
before it is downloaded. Counts are kept in elements, not bytes, because the runtime dtype may
differ from the checkpoint's.

How each tensor of a decoder layer splits under tensor parallelism (Megatron-style):
  column  q/gate/up projections (and q bias): rows divided by TP
  kv      k/v projections (and their bias): divided by min(TP, kv heads) -- replicated beyond
  row     o/down projections: columns divided by TP
  replicated  layer norms (every rank holds a copy)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Literal

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

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_COLUMN = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_KV = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW_WEIGHTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed at load


class ProfileError(ValueError):
    """A model directory that cannot be profiled; the message names the file and tensor."""


class TensorInfo(BaseModel):
    file: str
    dtype: str
    shape: list[int]
    numel: int
    nbytes: int


class LayerProfile(BaseModel):
    """Elements of one decoder layer by how they split under tensor parallelism."""

    column: int = 0
    kv: int = 0
    row: int = 0
    replicated: int = 0

    @property
    def numel(self) -> int:
        return self.column + self.kv + self.row + self.replicated


class ModelProfile(BaseModel):
    name: str
    architecture: str
    source: Literal["safetensors", "config"]
    dtype: str = Field(description="Checkpoint dtype (torch name).")
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    embed_numel: int
    lm_head_numel: int = Field(description="0 when tied to the embeddings.")
    final_norm_numel: int
    other_numel: int = Field(0, description="Tensors outside the known layout; held by every rank.")
    layers: list[LayerProfile]
    checkpoint_bytes: int = Field(description="Bytes of all tensors as stored.")
    files: list[str] = Field(default_factory=list)
    tensors: dict[str, TensorInfo] = Field(default_factory=dict, exclude=True)
    digest: str = Field("", description="sha256 of config.json and every safetensors header.")

    @property
    def total_numel(self) -> int:
        return (self.embed_numel + self.lm_head_numel + self.final_norm_numel + self.other_numel
                + sum(layer.numel for layer in self.layers))

    def dtype_bytes(self, dtype: str = "auto") -> int:
        return TORCH_DTYPE_BYTES[self.dtype if dtype == "auto" else dtype]

    def kv_bytes_per_token(self, dtype: str = "auto") -> int:
        """KV-cache bytes one token costs across all layers (keys + values, unsharded)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes(dtype)


# ---------------------------------------------------------------- config.json
def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ProfileError(f"{path}: missing; a model directory needs the HF config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path}: not valid JSON ({err})") from None
    architectures = config.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ProfileError(f"{path}: architecture {architectures or 'unset'} is not supported; "
                           f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise ProfileError(f"{path}: {key} must be a positive integer (got {config.get(key)!r})")
    return config


def _shape_facts(config: dict[str, Any]) -> dict[str, Any]:
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    arch = next(a for a in config["architectures"] if a in SUPPORTED_ARCHITECTURES)
    return {
        "architecture": arch,
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config.get("max_position_embeddings") or 4096,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "qkv_bias": arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
        "o_bias": arch != "Qwen2ForCausalLM" and bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
    }


def expected_tensors(config: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> shape of every tensor an HF checkpoint of this config holds."""
    f = _shape_facts(config)
    hidden, inter, hd = f["hidden_size"], f["intermediate_size"], f["head_dim"]
    q_out, kv_out = f["num_heads"] * hd, f["num_kv_heads"] * hd
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [f["vocab_size"], hidden]}
    for i in range(f["num_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = [q_out, hidden]
        shapes[p + "self_attn.k_proj.weight"] = [kv_out, hidden]
        shapes[p + "self_attn.v_proj.weight"] = [kv_out, hidden]
        shapes[p + "self_attn.o_proj.weight"] = [hidden, q_out]
        if f["qkv_bias"]:
            shapes[p + "self_attn.q_proj.bias"] = [q_out]
            shapes[p + "self_attn.k_proj.bias"] = [kv_out]
            shapes[p + "self_attn.v_proj.bias"] = [kv_out]
        if f["o_bias"]:
            shapes[p + "self_attn.o_proj.bias"] = [hidden]
        shapes[p + "mlp.gate_proj.weight"] = [inter, hidden]
        shapes[p + "mlp.up_proj.weight"] = [inter, hidden]
        shapes[p + "mlp.down_proj.weight"] = [hidden, inter]
        if f["mlp_bias"]:
            shapes[p + "mlp.gate_proj.bias"] = [inter]
            shapes[p + "mlp.up_proj.bias"] = [inter]
            shapes[p + "mlp.down_proj.bias"] = [hidden]
        shapes[p + "input_layernorm.weight"] = [hidden]
        shapes[p + "post_attention_layernorm.weight"] = [hidden]
    shapes["model.norm.weight"] = [hidden]
    if not f["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [f["vocab_size"], hidden]
    return shapes


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
                raise ProfileError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise ProfileError(f"{path}: not a safetensors file (header length {header_len} "
                                   f"does not fit in a file of {size} bytes)")
            raw = fh.read(header_len)
    except FileNotFoundError:
        raise ProfileError(f"{path}: missing") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise ProfileError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_bytes = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BYTES \
                or not isinstance(entry.get("shape"), list) or len(entry.get("data_offsets") or []) != 2:
            raise ProfileError(f"{path}: tensor {name}: malformed header entry {entry!r}")
        start, stop = entry["data_offsets"]
        numel = _prod(entry["shape"])
        if stop - start != numel * DTYPE_BYTES[entry["dtype"]]:
            raise ProfileError(f"{path}: tensor {name}: {stop - start} bytes stored for shape "
                               f"{entry['shape']} of {entry['dtype']}")
        if stop > data_bytes:
            raise ProfileError(f"{path}: tensor {name}: truncated file (tensor ends at byte "
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
            raise ProfileError(f"{index}: not a safetensors index ({err!r})") from None
        return dict(weight_map)
    single = model_dir / "model.safetensors"
    if single.is_file():
        header = read_safetensors_header(single)
        return {name: single.name for name in header if name != "__metadata__"}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickles:
        raise ProfileError(f"{model_dir}: only pickle checkpoints ({', '.join(pickles)}); "
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
            raise ProfileError(f"{model_dir / file}: missing (the index maps tensor {first} to it)")
        headers[file] = read_safetensors_header(model_dir / file)
    infos = {}
    for name, file in sorted(weight_map.items()):
        entry = headers[file].get(name)
        if entry is None:
            raise ProfileError(f"{model_dir / file}: tensor {name} is listed in the index but absent from the file")
        numel = _prod(entry["shape"])
        infos[name] = TensorInfo(file=file, dtype=entry["dtype"], shape=entry["shape"], numel=numel,
                                 nbytes=numel * DTYPE_BYTES[entry["dtype"]])
    return infos


# ---------------------------------------------------------------- the profile
def _classify(name: str) -> tuple[str, int | None]:
    """Which part of the model a tensor belongs to, and its layer index."""
    if name.startswith("model.embed_tokens."):
        return "embed", None
    if name.startswith("model.norm."):
        return "final_norm", None
    if name.startswith("lm_head."):
        return "lm_head", None
    match = _LAYER.match(name)
    if match:
        layer, rest = int(match.group(1)), match.group(2)
        if rest.endswith(_IGNORED):
            return "ignored", layer
        if rest.startswith(_COLUMN):
            return "column", layer
        if rest.startswith(_KV):
            return "kv", layer
        if rest in _ROW_WEIGHTS:
            return "row", layer
        return "replicated", layer  # norms, and the row-parallel biases, which every rank adds once
    return "other", None


def _build(config: dict[str, Any], infos: dict[str, TensorInfo], source: str, name: str,
           digest: str) -> ModelProfile:
    facts = _shape_facts(config)
    layers = [LayerProfile() for _ in range(facts["num_layers"])]
    parts = {"embed": 0, "lm_head": 0, "final_norm": 0, "other": 0}
    for tensor_name, info in infos.items():
        part, layer = _classify(tensor_name)
        if part == "ignored" or (part == "lm_head" and facts["tie_word_embeddings"]):
            continue
        if layer is not None:
            if layer >= len(layers):
                raise ProfileError(f"tensor {tensor_name} (in {info.file}) names layer {layer}, but "
                                   f"config.json has num_hidden_layers={len(layers)}")
            setattr(layers[layer], part, getattr(layers[layer], part) + info.numel)
        else:
            parts[part] += info.numel
    dtypes = {info.dtype for info in infos.values()}
    checkpoint_dtype = SAFETENSORS_DTYPE.get(dtypes.pop(), "float32") if len(dtypes) == 1 else \
        config.get("torch_dtype") or config.get("dtype") or "float32"
    if source == "config":
        checkpoint_dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    if checkpoint_dtype not in TORCH_DTYPE_BYTES:
        checkpoint_dtype = "float32"
    return ModelProfile(
        name=name, source=source, dtype=checkpoint_dtype,
        **{k: v for k, v in facts.items() if k not in ("qkv_bias", "o_bias", "mlp_bias")},
        embed_numel=parts["embed"], lm_head_numel=parts["lm_head"],
        final_norm_numel=parts["final_norm"], other_numel=parts["other"], layers=layers,
        checkpoint_bytes=sum(info.nbytes for info in infos.values()),
        files=sorted({info.file for info in infos.values()}), tensors=infos, digest=digest,
    )


def profile_from_config(config: dict[str, Any], name: str = "model") -> ModelProfile:
    """The profile an HF checkpoint of this config would have (no weights needed)."""
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    st_dtype = {v: k for k, v in SAFETENSORS_DTYPE.items()}.get(dtype, "F32")
    infos = {n: TensorInfo(file="", dtype=st_dtype, shape=s, numel=_prod(s),
                           nbytes=_prod(s) * DTYPE_BYTES[st_dtype])
             for n, s in expected_tensors(config).items()}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return _build(config, infos, "config", name, digest)


def profile_model(model_dir: str | os.PathLike[str]) -> ModelProfile:
    """Profile a model directory from config.json and, when present, its safetensors headers."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    infos = read_tensor_infos(model_dir)
    name = model_dir.resolve().name
    if infos is None:
        return profile_from_config(config, name=name)
    _check_layout(model_dir, config, infos)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in sorted({info.file for info in infos.values()}):
        digest.update(json.dumps({n: i.model_dump() for n, i in infos.items() if i.file == file},
                                 sort_keys=True).encode())
    return _build(config, infos, "safetensors", name, digest.hexdigest())


def _check_layout(model_dir: Path, config: dict[str, Any], infos: dict[str, TensorInfo]) -> None:
    """Every tensor the config implies is present with its shape (a partial checkpoint fails here)."""
    for name, shape in expected_tensors(config).items():
        info = infos.get(name)
        if info is None:
            files = ", ".join(sorted({i.file for i in infos.values()}))
            raise ProfileError(f"{model_dir}: tensor {name} is missing from the checkpoint ({files})")
        if info.shape != shape:
            raise ProfileError(f"{model_dir / info.file}: tensor {name} has shape {info.shape}, "
                               f"config.json implies {shape}")


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
