"""Text in and out of a model directory: `tokenizer.json` (the `tokenizers` library) and, when
the model has one, its chat template (Hugging Face's convention: `chat_template` in
`tokenizer_config.json`, or a `chat_template.jinja` file), rendered in a sandboxed Jinja
environment as Hugging Face renders it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TemplateError(ValueError):
    """The chat template refused the conversation (it called `raise_exception`) or is broken."""


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return template or None


class TextCodec:
    def __init__(self, tokenizer: Any, chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template: Any = None

    @classmethod
    def load(cls, model_dir: str | Path) -> TextCodec | None:
        """The model's codec, or None when it has no tokenizer.json (token ids only)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(Tokenizer.from_file(str(path)), _chat_template(model_dir, config),
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

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The conversation as the prompt text the model was trained on, ending where the
        assistant's answer begins."""
        if self.chat_template is None:
            raise TemplateError("this model has no chat template")
        if self._template is None:
            from jinja2 import TemplateError as JinjaError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except JinjaError as err:
                raise TemplateError(f"the chat template does not parse: {err}") from None
        from jinja2 import TemplateError as JinjaError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        except JinjaError as err:
            raise TemplateError(f"the chat template failed: {err}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template writes the special tokens itself (a BOS among them): add none.
        return self.encode(self.render_chat(messages), add_special_tokens=False)
