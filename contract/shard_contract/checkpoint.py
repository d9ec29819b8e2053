"""Reading a checkpoint: config.json and safetensors headers, never tensor data, never pickle.

Both planes use it: the operator's profiler (sizes from the headers) and the worker's loader (the
byte ranges of its own slices). A model directory holds `config.json` and either one
`model.safetensors` or several files named by `model.safetensors.index.json`.

Everything read here is checked before it is used, because a checkpoint is input from whoever
wrote the volume: every file it names resolves, symlinks followed, inside the model directory; a
JSON file is at most `MAX_JSON_BYTES` long (a safetensors header `MAX_HEADER_BYTES`) and nested at
most `MAX_JSON_DEPTH` levels; a header holds at most `MAX_TENSORS` tensors, whose data offsets are
integers inside the file's data section, one range per tensor, none overlapping another and each as
long as its dtype x shape; config.json's sizes lie within `LIMITS` (a 600-byte config must not ask
for ten million layers). So reading costs time and memory linear in the input's size with small
constants (the C JSON parser, one pass over its result; no regex over a whole document), and every
violation is a one-line `CheckpointError` that names the file (and the tensor or field), never a
raw OSError, RecursionError, MemoryError or TypeError.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path, PurePosixPath
from typing import Any, TypeGuard

from pydantic import BaseModel, Field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
# config.json's torch_dtype / our dtype names -> bytes per element
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
SAFETENSORS_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}

CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
# Real headers take kilobytes (a Llama-3-8B file ~30 KB); safetensors itself allows 100 MB, which
# the JSON parser turns into gigabytes of objects. These caps leave two orders of magnitude of room.
MAX_HEADER_BYTES = 16 * 2**20
MAX_JSON_BYTES = 16 * 2**20  # config.json, the index, generation_config.json
MAX_JSON_DEPTH = 32  # a header nests 3 levels, an HF config.json about 4
MAX_JSON_CONTAINERS = 2**20  # lists and objects in one file (a header: 3 a tensor); ~70 bytes each parsed
MAX_TENSORS = 2**17  # in one header and in an index: 1024 layers of a biased Llama take ~15k
# config.json's sizes: far above every released model (Llama-3.1-405B: 126 layers, vocab 128k,
# hidden 16k), far below what would make building the expected tensor table costly.
LIMITS = {"num_hidden_layers": 1024, "hidden_size": 2**17, "intermediate_size": 2**20,
          "num_attention_heads": 2**12, "num_key_value_heads": 2**12, "head_dim": 2**12,
          "vocab_size": 2**21, "max_position_embeddings": 2**24}


class CheckpointError(ValueError):
    """A model directory that cannot be read; the message names the file and tensor."""


class TensorInfo(BaseModel):
    file: str = Field(description="The file as the index names it, relative to the model directory.")
    dtype: str
    shape: list[int]
    numel: int
    nbytes: int
    offset: int = Field(description="Byte offset of the tensor's data in its file (past the header).")

    @property
    def aligned(self) -> bool:
        """Its data start at a multiple of its element size, as every standard writer puts them
        (safetensors pads its header to 8 bytes and orders tensors by alignment): a CPU rank can
        compute on it where the file holds it (offload)."""
        return self.offset % DTYPE_BYTES[self.dtype] == 0


# ---------------------------------------------------------------- files and JSON
def model_file(model_dir: str | os.PathLike[str], name: str, where: str = "") -> Path:
    """The real path of file `name` of a model directory: `name` is relative, has no `..`, and
    leads (symlinks followed) to a path inside the directory's real path.

    A symlink from one file of the directory to another is fine; one that leads out of it is not
    (a Hugging Face cache snapshot, whose files link into `../../blobs`, must be copied out with
    its links followed; docs/operations.md says how). Nothing outside is opened or named in the
    error, so the message cannot tell whether a path outside exists. `where` prefixes the message.
    """
    root = Path(os.path.realpath(model_dir))
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    why = ("is not a file name" if not isinstance(name, str) or not name or "\0" in name
           else "is an absolute path" if name.startswith("/")
           else "has a '..' segment" if ".." in parts
           else None)
    if why is None:
        real = Path(os.path.realpath(root / name))
        if real == root or not real.is_relative_to(root):
            why = "leads outside the model directory (through a symlink)"
        else:
            return real
    raise CheckpointError(f"{where or root}: {show_value(name, 300)} {why}; every file must lie inside the model "
                          "directory")


def _open(path: Path) -> Any:
    """A regular file, opened for reading (a FIFO or device named like a checkpoint file is refused
    without blocking on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def _read(fh: Any, path: Path, count: int) -> bytes:
    try:
        data: bytes = fh.read(count)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror})") from None
    return data


def json_depth(value: Any) -> int:
    """How many levels of lists and objects `value` nests (0 for a scalar), walked without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return depth


def parse_json(raw: bytes, path: Path, what: str) -> Any:
    """`raw` as JSON, refusing text nested deeper than `MAX_JSON_DEPTH`. The C parser takes time
    and memory linear in `raw` and guards its own recursion (RecursionError past Python's limit);
    the depth is then checked on the result in one pass, so later code may recurse over it."""
    # Brackets inside strings count too: an over-estimate, cheap (C) and before any object exists.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_CONTAINERS:
        raise CheckpointError(f"{path}: {what} holds more than {MAX_JSON_CONTAINERS} lists and objects")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{path}: {what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: {what} is not valid JSON ({_first_line(err)})") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise CheckpointError(f"{path}: {what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return _clip(text[0]) if text else type(err).__name__


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of the checkpoint (config.json, the index, generation_config.json), at most
    `limit` bytes."""
    return parse_json(read_bounded(path, what, limit), path, what)


def read_bounded(path: Path, what: str, limit: int) -> bytes:
    """A regular file's bytes, refused when it is longer than `limit` (read no further)."""
    with _open(path) as fh:
        raw = _read(fh, path, limit + 1)
    if len(raw) > limit:
        raise CheckpointError(f"{path}: {what} is larger than {limit} bytes")
    return raw


# ---------------------------------------------------------------- config.json
_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_OPTIONAL_STRINGS = ("torch_dtype", "dtype")


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = model_file(model_dir, CONFIG)
    if not path.exists():
        raise CheckpointError(f"{path}: missing; a model directory needs the HF config.json")
    return check_config(read_json(path, "config.json"), str(path))


def check_config(config: Any, source: str) -> dict[str, Any]:
    """`config` if it is a config.json of a supported model with sizes of the right types."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: not a JSON object")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise CheckpointError(f"{source}: architectures must be a list of class names "
                              f"(got {show_value(architectures)})")
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise CheckpointError(f"{source}: architecture {architectures or 'unset'} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for key in _REQUIRED_INTS + _OPTIONAL_INTS:
        value = config.get(key)
        if not (_is_int(value) and 1 <= value <= LIMITS[key]) and (key in _REQUIRED_INTS or value is not None):
            raise CheckpointError(f"{source}: {key} must be an integer from 1 to {LIMITS[key]} "
                                  f"(got {show_value(value)})")
    for keys, kind, want in ((_OPTIONAL_BOOLS, bool, "true or false"), (_OPTIONAL_STRINGS, str, "a string")):
        for key in keys:
            if config.get(key) is not None and not isinstance(config[key], kind):
                raise CheckpointError(f"{source}: {key} must be {want} (got {show_value(config[key])})")
    return config


def _is_int(value: Any) -> TypeGuard[int]:
    return type(value) is int  # JSON's true and false are bools, which Python counts as ints


def show_value(value: Any, limit: int = 80) -> str:
    """A value for a one-line message, in bounded time: a huge string or list is not repr'd whole."""
    if isinstance(value, str):
        return _clip(repr(value[:limit]), limit)
    if isinstance(value, dict | list) and len(value) > 8:
        return f"a {'list' if isinstance(value, list) else 'JSON object'} of {len(value)} items"
    return _clip(repr(value)) if json_depth(value) <= 2 else f"a nested {type(value).__name__}"


def _clip(text: str, limit: int = 80) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
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
def read_safetensors_header(path: str | os.PathLike[str], file: str | None = None) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file (named `file` in its TensorInfos), its header checked
    against the file's real size. Reads 8 + header-length bytes and nothing else."""
    path = Path(path)
    with _open(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = _read(fh, path, 8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: not a safetensors file (header length {header_len} is over "
                                  f"the limit of {MAX_HEADER_BYTES} bytes)")
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {header_len} does not fit "
                                  f"in a file of {size} bytes)")
        raw = _read(fh, path, header_len)
    if raw.count(b"data_offsets") > MAX_TENSORS + 1:  # a cheap bound before the parser builds objects
        raise CheckpointError(f"{path}: the safetensors header lists more than {MAX_TENSORS} tensors")
    header = parse_json(raw, path, "the safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    if len(header) > MAX_TENSORS + 1:
        raise CheckpointError(f"{path}: the safetensors header lists more than {MAX_TENSORS} tensors")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + header_len
    infos = {name: _tensor(path, file or path.name, name, entry, data_start, size - data_start)
             for name, entry in header.items()}
    spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in infos.items())
    for (_, end, first), (start, stop, second) in pairwise(spans):
        if start < end:
            raise CheckpointError(f"{path}: tensor {_clip(second, 200)}: data_offsets [{start - data_start}, "
                                  f"{stop - data_start}] overlap those of tensor {_clip(first, 200)}")
    return infos


def _tensor(path: Path, file: str, name: str, entry: Any, data_start: int, data_bytes: int) -> TensorInfo:
    """One header entry, checked: a dtype, a shape of non-negative ints, and a byte range
    [start, stop) of the data section exactly as long as dtype x shape."""
    where = f"{path}: tensor {_clip(name, 200)}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: malformed header entry {show_value(entry)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: dtype {show_value(dtype)} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {show_value(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {show_value(offsets)} is not a pair of integers")
    start, stop = offsets
    if not 0 <= start <= stop:
        raise CheckpointError(f"{where}: data_offsets {offsets} must satisfy 0 <= start <= stop")
    numel = shape_numel(shape)
    nbytes = numel * DTYPE_BYTES[dtype]
    if stop - start != nbytes:
        raise CheckpointError(f"{where}: {stop - start} bytes stored for shape {shape} of {dtype}")
    if stop > data_bytes:
        raise CheckpointError(f"{where}: truncated file (tensor ends at byte {data_start + stop}, "
                              f"the file has {data_start + data_bytes})")
    return TensorInfo(file=file, dtype=dtype, shape=shape, numel=numel, nbytes=nbytes, offset=data_start + start)


@dataclass(frozen=True)
class Weights:
    """A checkpoint's tensors as their headers say, checked: the real path of every file (inside
    the model directory) and every tensor's file, dtype, shape and byte range."""

    files: dict[str, Path]  # the file as the index names it -> its real path
    tensors: dict[str, TensorInfo]

    def path(self, tensor: str) -> Path:
        return self.files[self.tensors[tensor].file]


def read_weights(model_dir: str | os.PathLike[str]) -> Weights | None:
    """The checked view of a model directory's weights, from the index or the single
    `model.safetensors`; None when there are none (config.json alone)."""
    root = Path(os.path.realpath(model_dir))
    index = model_file(root, INDEX)
    if index.exists():
        weight_map = _weight_map(index)
        files: dict[str, Path] = {}
        for name, file in sorted(weight_map.items()):
            if file not in files:
                path = files[file] = model_file(root, file, where=f"{index}: tensor {_clip(name, 200)}")
                if not path.exists():
                    raise CheckpointError(f"{path}: missing (the index maps tensor {_clip(name, 200)} to it)")
        headers = {file: read_safetensors_header(path, file) for file, path in files.items()}
        tensors = {}
        for name, file in sorted(weight_map.items()):
            if name not in headers[file]:
                raise CheckpointError(f"{files[file]}: tensor {_clip(name, 200)} is listed in the index but "
                                      "absent from the file")
            tensors[name] = headers[file][name]
        return Weights(files=files, tensors=tensors)
    single = model_file(root, SINGLE)
    if single.exists():
        return Weights(files={SINGLE: single}, tensors=read_safetensors_header(single, SINGLE))
    pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    if pickles:
        raise CheckpointError(f"{root}: only pickle checkpoints ({', '.join(pickles)}); "
                              "shard-operator loads safetensors only (pickle can run code)")
    return None


def _weight_map(index: Path) -> dict[str, str]:
    data = read_json(index, "the safetensors index")
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map object)")
    if len(data["weight_map"]) > MAX_TENSORS:
        raise CheckpointError(f"{index}: the weight_map lists more than {MAX_TENSORS} tensors")
    for name, file in data["weight_map"].items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: tensor {_clip(name, 200)}: the file name {show_value(file)} is not "
                                  "a string")
    weight_map: dict[str, str] = data["weight_map"]
    return weight_map


class CheckpointFacts(BaseModel):
    """What a model directory says about itself: config.json, and every tensor's file, dtype,
    shape and offset from the safetensors headers (None when there are no weights yet: a model can
    be planned from config.json alone). The profiling Pod prints this as one line of JSON."""

    name: str
    config: dict[str, Any]
    tensors: dict[str, TensorInfo] | None
    digest: str = Field(description="sha256 of config.json and every safetensors header.")


def read_checkpoint(model_dir: str | os.PathLike[str]) -> CheckpointFacts:
    """Read and check a model directory: config.json, and when there are weights, every header,
    with every tensor the config implies present in its shape (a partial checkpoint fails here)."""
    config = read_config(model_dir)
    weights = read_weights(model_dir)
    name = Path(os.path.realpath(model_dir)).name
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    if weights is None:
        return CheckpointFacts(name=name, config=config, tensors=None, digest=digest.hexdigest())
    infos = weights.tensors
    for tensor, shape in expected_tensors(config).items():
        info = infos.get(tensor)
        if info is None:
            files = ", ".join(sorted(weights.files))
            raise CheckpointError(f"{os.path.realpath(model_dir)}: tensor {tensor} is missing from the checkpoint "
                                  f"({files})")
        if info.shape != shape:
            raise CheckpointError(f"{weights.files[info.file]}: tensor {tensor} has shape {info.shape}, "
                                  f"config.json implies {shape}")
    for file in sorted(weights.files):
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
