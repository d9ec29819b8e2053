"""Grammar-constrained decoding: `response_format` json_object and json_schema, with llguidance
(Microsoft's Rust library behind Guidance; chosen over xgrammar for its per-step mask cost and
because it needs neither triton nor TVM, see docs/benchmarks.md "Constrained decoding").

A request's grammar is a JSON schema (`GenerateRequest.json_schema`, as text). Each sampling rank
of the last stage keeps a matcher per constrained row (`Sampler`): before a step it fills the row's
allowed-token bitmask on the host (llguidance drops the GIL), the sampler masks the logits on the
device, and after the step the matcher consumes the chosen token. Every such rank sees the same
tokens, so their matchers agree. Once the grammar is complete it allows the end-of-sequence tokens
alone, so the sequence stops there.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a mask is built: the leader's HTTP process only checks schemas
    import torch

JSON_OBJECT = json.dumps({"type": "object"})  # response_format json_object: any JSON object


def grammar_of(schema: str) -> str:
    """llguidance's grammar for a JSON schema (text); ValueError when it is not one it can take."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    except Exception as err:  # noqa: BLE001 -- llguidance raises ValueError and RuntimeError alike
        raise ValueError(f"not a usable JSON schema: {err}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"not a usable JSON schema: {messages[0]}")
    return grammar


class Grammars:
    """The model's tokenizer as llguidance sees it (built once a process: about a second on a
    large vocabulary), and the matchers of requests."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: list[int]):
        import llguidance

        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos_ids)

    def matcher(self, schema: str) -> Any:
        """A fresh matcher for a JSON schema; ValueError when the schema is not usable."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(schema), log_level=0)
        if matcher.is_error():
            raise ValueError(f"not a usable JSON schema: {matcher.get_error()}")
        return matcher


@cache
def load(model_dir: Path, vocab: int, eos_ids: tuple[int, ...]) -> Grammars | None:
    path = model_dir / "tokenizer.json"
    return Grammars(path.read_text(), vocab, list(eos_ids)) if path.is_file() else None


def fill(matchers: list[Any], bitmask: torch.Tensor) -> list[int]:
    """Each matcher's allowed tokens into its row of `bitmask` [rows, words] (int32, host), a
    matcher None allowing all; returns the rows whose matcher allows no token (it met a token it
    could not take, or its limits)."""
    import llguidance.torch as lltorch

    empty = []
    for i, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[i] = -1
            continue
        if not matcher.is_error():
            lltorch.fill_next_token_bitmask(matcher, bitmask, i)
        if matcher.is_error() or not bool(bitmask[i].any()):
            empty.append(i)
    return empty


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask [rows, words] (on the logits' device) as booleans [rows, vocab]."""
    import torch

    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
