"""OpenAI's shapes of what a request asked for beyond the text: log-probabilities (completions'
and chat's), tool calls parsed back from a chat answer, and which of best_of choices to answer.
Pure: token ids in, JSON-ready dicts out; `piece(id)` is a token's text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from shard_contract.wire import Completion

Piece = Callable[[int], str]
Top = list[tuple[int, float]]


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float | None], tops: Sequence[Top | None],
                        piece: Piece, offset: int = 0) -> dict[str, Any]:
    """Completions' `logprobs`: tokens, their log-probabilities, the top alternatives by text,
    and each token's character offset in the answer's text (from `offset`)."""
    tokens = [piece(t) for t in ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [None if top is None else _by_text(top, piece) for top in tops], "text_offset": offsets}


def _by_text(top: Top, piece: Piece) -> dict[str, float]:
    """Alternatives by their text, most likely first; of tokens with the same text (pieces of one
    character, say) the likelier is kept."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(piece(token), logprob)
    return out


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Top], piece: Piece) -> dict[str, Any]:
    """Chat's `logprobs`: per token its text, log-probability, UTF-8 bytes and top alternatives."""
    content = [{**_entry(piece(t), lp), "top_logprobs": [_entry(piece(a), alp) for a, alp in top]}
               for t, lp, top in zip(ids, logprobs, tops, strict=True)]
    return {"content": content, "refusal": None}


def completion_choice_logprobs(done: Completion, prompt_ids: list[int] | None, piece: Piece,
                               offset: int) -> dict[str, Any] | None:
    """A completion choice's logprobs: the prompt's first when it was echoed (prompt_ids)."""
    if done.logprobs is None or done.top_logprobs is None:
        return None
    ids: list[int] = list(done.token_ids[:len(done.logprobs)])
    lps: list[float | None] = list(done.logprobs)
    tops: list[Top | None] = list(done.top_logprobs)
    if prompt_ids is not None:
        prompt_lps = done.prompt_logprobs or [None] * len(prompt_ids)
        prompt_tops = done.prompt_top_logprobs or [None] * len(prompt_ids)
        ids, lps, tops = prompt_ids + ids, list(prompt_lps) + lps, list(prompt_tops) + tops
    return completion_logprobs(ids, lps, tops, piece, offset)


def best(completions: Sequence[Completion], n: int) -> list[int]:
    """The indices of the n completions with the highest total log-probability, best first."""
    total = [sum(c.logprobs or []) for c in completions]
    return sorted(range(len(completions)), key=lambda i: -total[i])[:n]


# ---------------------------------------------------------------- tools
def tool_schema(tools: list[dict[str, Any]], name: str | None) -> str:
    """The JSON schema of a call of one of `tools` (or of the one named), as the chat templates of
    Llama 3.1 and Hermes write it: {"name": ..., "arguments": {...}}."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools if name is None or t["name"] == name]
    return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})


def parse_tool_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """The tool calls an answer makes, or None when it is not one: a JSON object {"name",
    "arguments" (or "parameters")} naming one of `names`, or several such objects (a list, or
    one per line, or each inside <tool_call>...</tool_call>)."""
    body = text.strip()
    for tag in ("<tool_call>", "</tool_call>", "<|python_tag|>"):
        body = body.replace(tag, "\n")
    objects: list[Any] = []
    try:
        whole = json.loads(body)
        objects = whole if isinstance(whole, list) else [whole]
    except ValueError:
        try:
            objects = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError:
            return None
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(arguments)}})
    return calls or None
