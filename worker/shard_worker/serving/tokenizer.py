"""Text in and out of a model directory: `tokenizer.json` (the `tokenizers` library) and, when
the model has one, its chat template (Hugging Face's convention: `chat_template` in
`tokenizer_config.json`, or a `chat_template.jinja` file), rendered in a sandboxed Jinja
environment as Hugging Face renders it.

These files are input from whoever wrote the volume, as the weights are: each goes through the
same containment check (`model_file`) and a size bound before it is read, and a broken one is a
`TokenizerError` naming the file (a CheckpointError: the worker exits with the no-retry status).
A template is rendered with bounds: `range` as the sandbox bounds it, repetition (`*`, `**`) that
would build more than `MAX_RENDER_CHARS`, output past `MAX_RENDER_CHARS`, and a time bound
(`RENDER_SECONDS`, checked on every line the template's code runs), so a hostile template fails
its request with a `TemplateError` and never hangs the rank.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from shard_contract.checkpoint import LIMITS, CheckpointError, model_file, read_bounded, read_json

MAX_TOKENIZER_BYTES = 32 * 2**20  # tokenizer.json: Llama 3's is 9 MB (128k tokens), Qwen2's 7 MB
MAX_TOKENIZER_CONFIG_BYTES = 4 * 2**20  # tokenizer_config.json: tens of kilobytes in released models
MAX_TEMPLATE_BYTES = 256 * 2**10  # a chat template: a few kilobytes in released models
MAX_RENDER_CHARS = 16 * 2**20  # a rendered prompt (any longer is refused by its length anyway)
RENDER_SECONDS = 5.0  # released templates render in milliseconds


class TokenizerError(CheckpointError):
    """A tokenizer file of the model directory that cannot be used; the message names the file."""


class TemplateError(ValueError):
    """The chat template refused the conversation (it called `raise_exception`) or is broken."""


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    where = model_file(model_dir, "tokenizer_config.json")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{where}: chat_template must be a string or a list of named templates")
    if template is None:
        jinja_file = model_file(model_dir, "chat_template.jinja")
        if jinja_file.exists():
            where = jinja_file
            raw = read_bounded(jinja_file, "the chat template", MAX_TEMPLATE_BYTES)
            try:
                template = raw.decode()
            except UnicodeDecodeError:
                raise TokenizerError(f"{jinja_file}: the chat template is not UTF-8 text") from None
    if template is not None and len(template.encode()) > MAX_TEMPLATE_BYTES:
        raise TokenizerError(f"{where}: the chat template is larger than {MAX_TEMPLATE_BYTES} bytes")
    return template or None


class TextCodec:
    def __init__(self, tokenizer: Any, chat_template: str | None = None, bos_token: str = "", eos_token: str = "",
                 render_seconds: float = RENDER_SECONDS):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.render_seconds = render_seconds
        self._template: Any = None

    @classmethod
    def load(cls, model_dir: str | Path) -> TextCodec | None:
        """The model's codec, or None when it has no tokenizer.json (token ids only). Every file
        lies inside the model directory and within its size bound; a TokenizerError names the one
        that does not, or that its library cannot read."""
        model_dir = Path(model_dir)
        path = model_file(model_dir, "tokenizer.json")
        if not path.exists():
            return None
        from tokenizers import Tokenizer

        raw = read_bounded(path, "tokenizer.json", MAX_TOKENIZER_BYTES)
        try:
            tokenizer = Tokenizer.from_str(raw.decode())
        except BaseException as err:  # the Rust library's errors, a pyo3 PanicException (a BaseException) too
            if isinstance(err, KeyboardInterrupt | SystemExit):
                raise
            text = str(err).strip().splitlines()
            raise TokenizerError(f"{path}: not a tokenizer the tokenizers library reads "
                                 f"({text[0][:200] if text else type(err).__name__})") from None
        if tokenizer.get_vocab_size(with_added_tokens=True) > LIMITS["vocab_size"]:
            raise TokenizerError(f"{path}: {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, more than "
                                 f"{LIMITS['vocab_size']}")
        config_path = model_file(model_dir, "tokenizer_config.json")
        config = read_json(config_path, "tokenizer_config.json", MAX_TOKENIZER_CONFIG_BYTES) \
            if config_path.exists() else {}
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_path}: not a JSON object")
        return cls(tokenizer, _chat_template(model_dir, config),
                   _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def max_prompt_chars(self, max_tokens: int) -> int:
        """No text longer than this encodes to `max_tokens` tokens or fewer: no token stands for
        more characters than its longest vocabulary entry (byte-level entries write one character
        a byte, SentencePiece's one a character; WordPiece's are longer than the text). A
        normalizer that deletes characters could make a longer text fit; it is refused all the same."""
        longest = max((len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return max_tokens * max(longest, 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens added as the tokenizer's post-processor says
        (a BOS for Llama), exactly as `shardctl generate --prompt` encodes."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes the `tools` it is given (Llama 3.1's, Hermes'...)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the prompt text the model was trained on, ending where the
        assistant's answer begins (with `tools`, those the template offers the model); a
        TemplateError when the template refuses it or exceeds a bound."""
        if self.chat_template is None:
            raise TemplateError("this model has no chat template")
        if self._template is None:
            from jinja2 import TemplateError as JinjaError

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = _bounded_environment()(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except (JinjaError, RecursionError, MemoryError) as err:
                raise TemplateError(f"the chat template does not parse: {err}") from None
        extra = {"tools": tools} if tools else {}
        return render_bounded(self._template, self.render_seconds, messages=messages, add_generation_prompt=True,
                              bos_token=self.bos_token, eos_token=self.eos_token, **extra)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template writes the special tokens itself (a BOS among them): add none.
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)


@functools.cache
def _bounded_environment() -> Any:
    """The environment class, made on first use: jinja2 is imported only when a template renders."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        """Hugging Face's sandbox, and repetition that cannot build a huge string or list in one step."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(left, int | float) and isinstance(right, int | float) \
                    and abs(right) > 64 and abs(left) > 1:
                raise TemplateError("the chat template raises a number to a power above 64")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(times, int) \
                            and len(seq) * times > MAX_RENDER_CHARS:
                        raise TemplateError(f"the chat template repeats a value past {MAX_RENDER_CHARS} items")
            return super().call_binop(context, operator, left, right)

    return Bounded


class _Deadline(BaseException):
    """Raised by the trace function; a BaseException so no `except Exception` in Jinja holds it."""


def render_bounded(template: Any, seconds: float, **context: Any) -> str:
    """`template` rendered, refused past `seconds` (checked on every line its code runs, in this
    thread only) or past `MAX_RENDER_CHARS` of output."""
    from jinja2 import TemplateError as JinjaError

    deadline = time.monotonic() + seconds

    def check(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _Deadline
        return check

    previous = sys.gettrace()
    sys.settrace(check)
    parts, size = [], 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise TemplateError(f"the chat template renders more than {MAX_RENDER_CHARS} characters")
            parts.append(chunk)
    except _Deadline:
        raise TemplateError(f"the chat template took longer than {seconds:g} s to render") from None
    except (JinjaError, RecursionError, MemoryError, OverflowError) as err:
        raise TemplateError(f"the chat template failed: {err}") from None
    finally:
        sys.settrace(previous)
    return "".join(parts)
