"""Checkpoint validation (shard_contract.checkpoint), written as the attacks it stops: every entry
of the malicious corpus is refused with a CheckpointError naming the file and tensor, and no input
makes the reader raise anything else or accept a byte range it should not."""

from __future__ import annotations

import json
import math
import re
import struct
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shard_contract.checkpoint import (
    MAX_JSON_DEPTH,
    CheckpointError,
    model_file,
    parse_json,
    read_checkpoint,
    read_safetensors_header,
    read_weights,
)
from tests.support.capped import MiB, run_capped
from tests.support.malicious import CORPUS, HUGE, SECOND, VICTIM, write_attack, write_good, write_raw

TMP = {"suppress_health_check": [HealthCheck.function_scoped_fixture]}


def test_the_corpus_starts_from_a_valid_checkpoint(tmp_path):
    model = write_good(tmp_path / "model")
    facts = read_checkpoint(model)
    weights = read_weights(model)
    assert facts.tensors == weights.tensors and len(weights.files) == 2
    victim = weights.tensors[VICTIM]
    assert weights.path(VICTIM) == (model / SECOND).resolve()
    header_len = struct.unpack("<Q", (model / SECOND).read_bytes()[:8])[0]
    assert victim.offset >= 8 + header_len and victim.nbytes == 64 * 4


@pytest.mark.parametrize("attack", CORPUS, ids=lambda a: a.name)
def test_every_malicious_checkpoint_is_refused_with_a_named_error(attack, tmp_path):
    model = write_attack(attack, tmp_path)
    with pytest.raises(CheckpointError, match=attack.error):
        read_checkpoint(model)


def test_a_symlink_to_another_file_of_the_directory_is_followed(tmp_path):
    model = write_good(tmp_path / "model")
    (model / "blobs").mkdir()
    (model / SECOND).rename(model / "blobs" / "abc123")
    (model / SECOND).symlink_to("blobs/abc123")
    weights = read_weights(model)
    assert weights.path(VICTIM) == model.resolve() / "blobs" / "abc123"


def test_a_hugging_face_cache_snapshot_is_refused_with_the_reason(tmp_path):
    """Its files link into ../../blobs, outside the snapshot directory: copy it out first."""
    repo = tmp_path / "models--org--tiny"
    good = write_good(tmp_path / "good")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in sorted(good.iterdir()):
        (repo / "blobs" / path.name).write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("../../blobs") / path.name)
    with pytest.raises(CheckpointError,
                       match=r"'config\.json' leads outside the model directory \(through a symlink\)"):
        read_checkpoint(snapshot)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 1500, 100_000])
def test_json_nesting_is_bounded(depth):
    text = json.dumps({"a": "[[[{{ brackets inside strings do not count"}).encode()
    raw = b"[" * (depth - 1) + text + b"]" * (depth - 1)
    if depth <= MAX_JSON_DEPTH:
        assert parse_json(raw, Path("x.json"), "x")
    else:
        with pytest.raises(CheckpointError, match=r"x\.json: x nests deeper than 32 levels"):
            parse_json(raw, Path("x.json"), "x")


@given(raw=st.binary(max_size=300) | st.text("[]{}\"\\,:1 ", max_size=300).map(str.encode))
def test_no_bytes_make_the_json_reader_raise_anything_else(raw):
    try:
        parse_json(raw, Path("x.json"), "x")
    except CheckpointError:
        pass


# A hostile checkpoint is read in a child process whose address space is capped: the old reader
# took ~120 bytes a character of a JSON string, gigabytes for 10^7 layers or 1.2M tensors.
CAPPED_READER = """
import sys
from shard_contract.checkpoint import CheckpointError, read_checkpoint
for model in sys.argv[1:]:
    try:
        read_checkpoint(model)
    except CheckpointError as err:
        print(str(err).replace(chr(10), "<newline>"))
    else:
        print("accepted")
"""


def test_huge_hostile_checkpoints_are_refused_under_a_memory_cap(tmp_path):
    models = [write_attack(attack, tmp_path / attack.name) for attack in HUGE]
    done = run_capped(CAPPED_READER, [str(m) for m in models], limit_bytes=768 * MiB)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == len(HUGE)
    for attack, line in zip(HUGE, lines, strict=True):
        assert re.search(attack.error, line), (attack.name, line)
        assert len(line) < 400, (attack.name, line)  # one short line, never the hostile value


def test_the_memory_cap_catches_a_reader_that_takes_gigabytes(tmp_path):
    """The cap itself works: a child that holds 2 GiB fails with MemoryError."""
    done = run_capped("x = bytearray(2 * 2**30)", limit_bytes=768 * MiB)
    assert done.returncode != 0 and "MemoryError" in done.stderr


@pytest.mark.parametrize(("field", "value"), [("num_hidden_layers", 1025), ("hidden_size", 2**17 + 1),
                                              ("vocab_size", 2**21 + 1), ("num_attention_heads", 0),
                                              ("head_dim", True), ("max_position_embeddings", 2**24 + 1)])
def test_config_sizes_are_capped_with_the_field_named(tmp_path, field, value):
    model = write_good(tmp_path / "model")
    (model / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), field: value}))
    with pytest.raises(CheckpointError, match=rf"config\.json: {field} must be an integer from 1 to \d+ "
                                              rf"\(got {value!r}\)$"):
        read_checkpoint(model)


def test_a_huge_tensor_name_is_clipped_in_the_message(tmp_path):
    path = tmp_path / "m.safetensors"
    write_raw(path, json.dumps({"n" * 1_000_000: {"dtype": "F32", "shape": [1], "data_offsets": [0, 3]}}).encode(), 4)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: tensor n+\.\.\.: 3 bytes stored") as err:
        read_safetensors_header(path)
    assert len(str(err.value)) < 400


# ---------------------------------------------------------------- properties of the header check
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)
SMALL = st.integers(-8, 80)


@st.composite
def plausible(draw) -> dict:
    """An entry whose range is as long as its dtype x shape, or one byte off."""
    dtype, item = draw(st.sampled_from([("F32", 4), ("F16", 2), ("I8", 1)]))
    shape = draw(st.lists(st.integers(0, 4), max_size=2))
    start = draw(st.integers(-4, 60))
    length = item * math.prod(shape) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, start + length]}


@st.composite
def laid_out(draw) -> dict:
    """Plausible entries back to back from a small start, one of them perhaps moved."""
    entries, at = {}, draw(st.integers(0, 4))
    for name in draw(st.lists(st.sampled_from("abcd"), unique=True, max_size=4)):
        entry = draw(plausible())
        length = entry["data_offsets"][1] - entry["data_offsets"][0]
        entries[name] = {**entry, "data_offsets": [at, at + length]}
        at += length
    if entries and draw(st.booleans()):
        entries[draw(st.sampled_from(sorted(entries)))]["data_offsets"] = draw(st.lists(SMALL, min_size=2, max_size=2))
    return entries


ENTRY = plausible() | st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "F16", "I8", "X9"]) | JSON,
    "shape": st.lists(st.integers(-2, 5), max_size=3) | JSON,
    "data_offsets": st.lists(SMALL, min_size=2, max_size=2) | st.tuples(SMALL, SMALL).map(list) | JSON,
}) | JSON


@settings(max_examples=300, deadline=None, **TMP)
@given(entries=laid_out() | st.dictionaries(st.sampled_from("abcd"), ENTRY, max_size=4), data_len=st.integers(0, 200),
       metadata=st.none() | JSON)
def test_a_header_is_refused_with_a_checkpoint_error_or_every_range_is_sound(tmp_path, entries, data_len, metadata):
    path = tmp_path / "m.safetensors"
    header = {**entries, **({} if metadata is None else {"__metadata__": metadata})}
    write_raw(path, json.dumps(header).encode(), data_len)
    try:
        infos = read_safetensors_header(path)
    except CheckpointError as err:
        assert str(err).startswith(str(path))
        return
    start = 8 + len(json.dumps(header).encode())
    spans = sorted((i.offset, i.offset + i.nbytes) for i in infos.values())
    for info in infos.values():
        assert all(type(d) is int and d >= 0 for d in info.shape)
        assert start <= info.offset and info.offset + info.nbytes <= start + data_len
    assert all(a_stop <= b_start for (_, a_stop), (b_start, _) in pairwise(spans))


@settings(max_examples=200, deadline=None, **TMP)
@given(name=st.text(st.sampled_from("ab./\\\x00~"), max_size=12) | JSON)
def test_a_file_name_resolves_inside_the_model_directory_or_is_refused(tmp_path, name):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    if not (model / "link").is_symlink():
        (model / "link").symlink_to("..")
    try:
        path = model_file(model, name)
    except CheckpointError as err:
        assert "every file must lie inside the model directory" in str(err)
        return
    assert path.is_relative_to(model.resolve()) and path != model.resolve()
