"""Tokenizer files are input from whoever wrote the volume, as the weights are: each goes through the
containment check and a size bound, a broken one is named, and a chat template renders with bounds
(repetition, output, time), so a hostile one fails its request instead of hanging the rank."""

from __future__ import annotations

import array
import json
from pathlib import Path

import pytest

from shard_contract.checkpoint import CheckpointError
from shard_worker.serving.tokenizer import (
    MAX_RENDER_CHARS,
    MAX_TEMPLATE_BYTES,
    TemplateError,
    TextCodec,
    TokenizerError,
)
from tests.support.capped import MiB, run_capped
from tests.support.checkpoints import write_tokenizer

LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MESSAGES = [{"role": "user", "content": "w5 w6"}]


def model(tmp_path: Path, template: str | None = LLAMA3_TEMPLATE) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    write_tokenizer(directory, 16)
    config: dict = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_released_style_template_renders(tmp_path):
    codec = TextCodec.load(model(tmp_path))
    assert codec.render_chat(MESSAGES).startswith("<s><|start_header_id|>user<|end_header_id|>\n\nw5 w6<|eot_id|>")


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"])
def test_every_tokenizer_file_must_lie_inside_the_model_directory(tmp_path, name):
    directory = model(tmp_path, template=None)
    outside = tmp_path / "outside"
    outside.mkdir()
    source = directory / name
    (outside / name).write_bytes(source.read_bytes() if source.exists() else b"SECRET {{ messages }}")
    source.unlink(missing_ok=True)
    source.symlink_to(outside / name)
    with pytest.raises(CheckpointError, match=rf"'{name}' leads outside the model directory"):
        TextCodec.load(directory)


def test_an_oversized_template_is_refused_naming_its_file(tmp_path):
    directory = model(tmp_path, template=None)
    (directory / "chat_template.jinja").write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja: the chat template is larger than \d+ bytes"):
        TextCodec.load(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x" * (MAX_TEMPLATE_BYTES + 1)}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: the chat template is larger"):
        TextCodec.load(directory)


@pytest.mark.parametrize(("content", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, r"tokenizer\.json: not a tokenizer the tokenizers library reads \(.+\)$"),
    (b'{"model": 7}', r"tokenizer\.json: not a tokenizer the tokenizers library reads"),
    (b"\xff\xfe", r"tokenizer\.json: not a tokenizer"),
])
def test_a_broken_tokenizer_json_is_named_in_one_line(tmp_path, content, message):
    directory = model(tmp_path)
    (directory / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as err:
        TextCodec.load(directory)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("config", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, r"tokenizer_config\.json: tokenizer_config\.json nests deeper"),
    (b"[1]", r"tokenizer_config\.json: not a JSON object"),
    (json.dumps({"chat_template": 7}).encode(), r"tokenizer_config\.json: chat_template must be a string"),
])
def test_a_broken_tokenizer_config_is_named(tmp_path, config, message):
    directory = model(tmp_path)
    (directory / "tokenizer_config.json").write_bytes(config)
    with pytest.raises(CheckpointError, match=message):
        TextCodec.load(directory)


# Each of these hung rank 0, took gigabytes, or would: each now fails its request with a TemplateError.
HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     r"took longer than"),
    "a huge repeat": ("{{ 'x' * 1000000000 }}", r"repeats a value past"),
    "a repeated list": ("{% set l = [1] * 1000000000 %}{{ l | length }}", r"repeats a value past"),
    "a huge power": ("{{ 7 ** 100000000 }}", r"raises a number to a power"),
    "huge output": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
                    rf"renders more than {MAX_RENDER_CHARS} characters"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"the chat template failed"),
    "raise_exception": ("{{ raise_exception('roles must alternate') }}", r"roles must alternate"),
    "a broken template": ("{% for %}", r"does not parse"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_fails_its_request_and_never_hangs(tmp_path, name):
    template, message = HOSTILE[name]
    codec = TextCodec.load(model(tmp_path, template))
    # Only the endless loops meet the time bound (they would run for hours); the other templates
    # must fail on their own bound however slow the machine, so theirs is generous.
    codec.render_seconds = 1.0 if name == "nested loops" else 300.0
    with pytest.raises(TemplateError, match=message):
        codec.render_chat(MESSAGES)
    assert codec.render_chat.__self__ is codec  # the codec is still usable: the next request is judged anew


CAPPED_RENDER = """
import json, sys
from shard_worker.serving.tokenizer import TemplateError, TextCodec
for directory in sys.argv[2:]:
    codec = TextCodec.load(directory)
    codec.render_seconds = 1.0 if directory == sys.argv[1] else 300.0
    try:
        codec.render_chat([{"role": "user", "content": "w5"}])
        print("rendered")
    except TemplateError as err:
        print(str(err).splitlines()[0][:200])
"""


def test_the_hostile_templates_stay_within_a_memory_cap(tmp_path):
    directories = [str(model(_mkdir(tmp_path / str(i)), template)) for i, (template, _) in enumerate(HOSTILE.values())]
    done = run_capped(CAPPED_RENDER, [directories[list(HOSTILE).index("nested loops")], *directories],
                      limit_bytes=1024 * MiB)
    assert done.returncode == 0, done.stderr[-2000:]
    import re

    for (name, (_, message)), line in zip(HOSTILE.items(), done.stdout.splitlines(), strict=True):
        assert re.search(message, line), (name, line)


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def test_the_text_worker_refuses_the_request_of_a_hostile_template_and_takes_the_next(tmp_path):
    """Where the leader renders templates (textproc, off the event loop): the endless template's
    request is refused with the reason, and the same codec answers the next request."""
    from shard_worker.serving import textproc

    codec = TextCodec.load(model(tmp_path, HOSTILE["nested loops"][0]))
    codec.render_seconds = 1.0
    status, reason = textproc._work(codec, {"messages": MESSAGES, "max_chars": 10**6})
    assert status == textproc.REFUSED and b"took longer than 1 s" in reason
    status, ids = textproc._work(codec, {"text": "w5 w6", "max_chars": 10**6})
    assert status == textproc.OK and ids == array.array("i", [5, 6]).tobytes()  # w5 w6 (little-endian here)
