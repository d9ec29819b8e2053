"""A corpus of malicious checkpoints: model directories that each try one way to make a reader
follow a path out of the directory, read bytes that are not the tensor's, or crash on its input.

`write_attack(attack, base)` writes `base/model` (a valid two-file checkpoint of `TINY_LLAMA` with
zero weights, written here byte by byte: no torch) and `base/outside` (a valid file and config the
attack points at), then applies the attack to `base/model`. Every attack's `error` is a regex the
`CheckpointError` message must match: it names the file, and the tensor where there is one.
Torch-free, so the operator's tests use it too.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shard_contract.checkpoint import expected_tensors
from tests.support.cluster import TINY_LLAMA

FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
VICTIM = "model.norm.weight"  # in SECOND; 64 float32 = 256 bytes
TWINS = ("model.layers.3.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight")  # in SECOND


# ---------------------------------------------------------------- writing safetensors by hand
def tensor_shapes(config: dict[str, Any] = TINY_LLAMA) -> dict[str, list[int]]:
    return expected_tensors(config)


def header_for(shapes: dict[str, list[int]]) -> tuple[dict[str, Any], int]:
    """A float32 header with the tensors laid out back to back, and the data section's length."""
    header, offset = {}, 0
    for name in sorted(shapes):
        size = 4
        for dim in shapes[name]:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shapes[name], "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def write_raw(path: Path, header_bytes: bytes, data_len: int, length: int | None = None) -> None:
    """A safetensors file: the 8-byte length (`length`, or the header's true one), the header,
    `data_len` zero bytes."""
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header_bytes) if length is None else length))
        fh.write(header_bytes)
        fh.write(bytes(data_len))


def write_file(path: Path, shapes: dict[str, list[int]], change: Callable[[dict], None] | None = None) -> None:
    header, data_len = header_for(shapes)
    if change is not None:
        change(header)
    write_raw(path, json.dumps({"__metadata__": {"format": "pt"}, **header}).encode(), data_len)


def write_good(directory: Path, config: dict[str, Any] = TINY_LLAMA) -> Path:
    """A valid checkpoint of `config` in two files and an index, every weight zero."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    names = sorted(shapes)
    split = {FIRST: names[:len(names) // 2], SECOND: names[len(names) // 2:]}
    for file, members in split.items():
        write_file(directory / file, {n: shapes[n] for n in members})
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        n: file for file, members in split.items() for n in members}}))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---------------------------------------------------------------- the attacks
def _members(model: Path, file: str) -> dict[str, list[int]]:
    index = json.loads((model / INDEX).read_text())["weight_map"]
    shapes = tensor_shapes()
    return {n: shapes[n] for n, f in index.items() if f == file}


def _index(model: Path, change: Callable[[dict], Any]) -> None:
    index = json.loads((model / INDEX).read_text())
    replaced = change(index)
    (model / INDEX).write_text(json.dumps(index if replaced is None else replaced))


def _second(model: Path, change: Callable[[dict], None]) -> None:
    write_file(model / SECOND, _members(model, SECOND), change)


def _entry(name: str, **fields: Any) -> Callable[[dict], None]:
    return lambda header: header[name].update(fields)


def _index_points_at(target: str) -> Callable[[Path, Path], None]:
    def attack(model: Path, outside: Path) -> None:
        _index(model, lambda index: index["weight_map"].update({VICTIM: target.format(outside=outside)}))
    return attack


def _symlink(name: str, target: str) -> Callable[[Path, Path], None]:
    def attack(model: Path, outside: Path) -> None:
        (model / name).unlink()
        (model / name).symlink_to(outside / target)
    return attack


def _overlap(header: dict) -> None:
    header[TWINS[1]]["data_offsets"] = header[TWINS[0]]["data_offsets"]


def _past_data(header: dict) -> None:
    end = max(entry["data_offsets"][1] for entry in header.values())
    header[VICTIM]["data_offsets"] = [end, end + 256]


def _huge_header_length(model: Path, _: Path) -> None:
    with open(model / SECOND, "r+b") as fh:
        fh.write(struct.pack("<Q", 2**63))


def _nested_header(model: Path, _: Path) -> None:
    write_raw(model / SECOND, b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 0)


def _nested_config(model: Path, _: Path) -> None:
    config = json.dumps({**TINY_LLAMA, "rope_scaling": "HOLE"})
    (model / "config.json").write_text(config.replace('"HOLE"', "{\"a\":" * 50_000 + "1" + "}" * 50_000))


def _fifo(model: Path, _: Path) -> None:
    (model / SECOND).unlink()
    os.mkfifo(model / SECOND)  # reading it would block the reader forever


@dataclass(frozen=True)
class Attack:
    name: str  # also a Kubernetes object name
    error: str  # regex the CheckpointError's message matches
    apply: Callable[[Path, Path], None]  # (model directory, the directory beside it)


F2, IX = SECOND.replace(".", r"\."), INDEX.replace(".", r"\.")
CORPUS = [
    Attack("index-parent-escape",
           rf"{IX}: tensor model\.norm\.weight: '\.\./outside/x\.safetensors' has a '\.\.' segment",
           _index_points_at("../outside/x.safetensors")),
    Attack("index-absolute-path",
           rf"{IX}: tensor model\.norm\.weight: '/\S+/outside/x\.safetensors' is an absolute path",
           _index_points_at("{outside}/x.safetensors")),
    Attack("symlink-out-of-dir", rf"{IX}: tensor \S+: '{F2}' leads outside the model directory",
           _symlink(SECOND, "x.safetensors")),
    Attack("config-symlink-out", r"model: 'config\.json' leads outside the model directory",
           _symlink("config.json", "config.json")),
    Attack("negative-offsets", rf"{F2}: tensor model\.norm\.weight: data_offsets \[-64, 192\] must satisfy 0 <= start",
           lambda m, _: _second(m, _entry(VICTIM, data_offsets=[-64, 192]))),
    Attack("overlapping-offsets",
           rf"{F2}: tensor {TWINS[1]}: data_offsets \[\d+, \d+\] overlap those of tensor {TWINS[0]}",
           lambda m, _: _second(m, _overlap)),
    Attack("float-offsets",
           rf"{F2}: tensor model\.norm\.weight: data_offsets \[0\.0, 256\.0\] is not a pair of integers",
           lambda m, _: _second(m, _entry(VICTIM, data_offsets=[0.0, 256.0]))),
    Attack("string-offsets",
           rf"{F2}: tensor model\.norm\.weight: data_offsets \['0', '256'\] is not a pair of integers",
           lambda m, _: _second(m, _entry(VICTIM, data_offsets=["0", "256"]))),
    Attack("offsets-past-data", rf"{F2}: tensor model\.norm\.weight: truncated file \(tensor ends at byte \d+",
           lambda m, _: _second(m, _past_data)),
    Attack("negative-shape", rf"{F2}: tensor model\.norm\.weight: shape \[-64\] is not a list of non-negative integers",
           lambda m, _: _second(m, _entry(VICTIM, shape=[-64]))),
    Attack("list-dtype", rf"{F2}: tensor model\.norm\.weight: dtype \['F32'\] is not a safetensors dtype",
           lambda m, _: _second(m, _entry(VICTIM, dtype=["F32"]))),
    Attack("huge-header-length", rf"{F2}: not a safetensors file \(header length 9223372036854775808 is over",
           _huge_header_length),
    Attack("nested-header", rf"{F2}: the safetensors header nests deeper than 32 levels", _nested_header),
    Attack("nested-config", r"config\.json: config\.json nests deeper than 32 levels", _nested_config),
    Attack("index-value-not-string", rf"{IX}: tensor model\.norm\.weight: the file name 7 is not a string",
           lambda m, _: _index(m, lambda i: i["weight_map"].update({VICTIM: 7}))),
    Attack("index-not-object", rf"{IX}: not a safetensors index \(a JSON object with a weight_map object\)",
           lambda m, _: _index(m, lambda i: [i])),
    Attack("weight-map-not-object", rf"{IX}: not a safetensors index",
           lambda m, _: _index(m, lambda i: {"weight_map": list(i["weight_map"].items())})),
    Attack("fifo-for-a-file", rf"{F2}: not a regular file", _fifo),
]
ATTACKS = {attack.name: attack for attack in CORPUS}


def write_attack(attack: Attack, base: Path) -> Path:
    """`base/model`, a checkpoint with `attack` applied (its target in `base/outside`)."""
    model, outside = write_good(base / "model"), base / "outside"
    write_good(outside)
    (outside / SECOND).rename(outside / "x.safetensors")
    attack.apply(model, outside)
    return model


# ---------------------------------------------------------------- huge inputs (run under a memory cap)
def _config_with(model: Path, **fields: Any) -> None:
    (model / "config.json").write_text(json.dumps({**TINY_LLAMA, **fields}))


def _huge_string_config(model: Path, _: Path) -> None:
    """A 15 MB string: under the byte cap, so it is parsed (the old regex took ~120 bytes a character)."""
    _config_with(model, comment="x" * 15_000_000, num_hidden_layers="not a number")


def _oversized_config(model: Path, _: Path) -> None:
    _config_with(model, comment="x" * 60_000_000)


def _huge_metadata(model: Path, _: Path) -> None:
    """A header of ~15 MB of __metadata__: parsed, then its sizes and offsets checked as usual."""
    _second(model, lambda header: header.update({"__metadata__": {"format": 7, "pad": "y" * 15_000_000}}))


def _oversized_header(model: Path, _: Path) -> None:
    _second(model, lambda header: header.update({"__metadata__": {"pad": "y" * 99_000_000}}))


def _many_tensors(model: Path, _: Path) -> None:
    def change(header: dict) -> None:
        header.update({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)})
    _second(model, change)


def _many_small_lists(model: Path, _: Path) -> None:
    write_raw(model / SECOND, b'{"a":[' + b"[]," * 5_000_000 + b"[]]}", 0)


def _deep_config(model: Path, _: Path) -> None:
    config = json.dumps({**TINY_LLAMA, "rope_scaling": "HOLE"})
    (model / "config.json").write_text(config.replace('"HOLE"', "[" * 5_000_000 + "]" * 5_000_000))


HUGE = [
    Attack("huge-string-in-config", r"config\.json: num_hidden_layers must be an integer", _huge_string_config),
    Attack("oversized-config", r"config\.json: config\.json is larger than \d+ bytes", _oversized_config),
    Attack("huge-metadata", rf"{F2}: __metadata__ must map strings to strings", _huge_metadata),
    Attack("oversized-header", rf"{F2}: not a safetensors file \(header length \d+ is over", _oversized_header),
    Attack("ten-million-layers", r"config\.json: num_hidden_layers must be an integer from 1 to 1024 "
                                 r"\(got 10000000\)", lambda m, _: _config_with(m, num_hidden_layers=10_000_000)),
    Attack("huge-vocabulary", r"config\.json: vocab_size must be an integer from 1 to \d+",
           lambda m, _: _config_with(m, vocab_size=2**40)),
    Attack("200k-tensors", rf"{F2}: the safetensors header lists more than \d+ tensors", _many_tensors),
    Attack("millions-of-lists", rf"{F2}: the safetensors header holds more than \d+ lists and objects",
           _many_small_lists),
    Attack("deep-config", r"config\.json: config\.json holds more than \d+ lists and objects", _deep_config),
]
