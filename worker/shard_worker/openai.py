"""The OpenAI wire format: request bodies in, `GenerateRequest`s out, responses and stream chunks
back. Pure: no server, no engine.

Requests are validated strictly (a string where a number belongs is an error, as are unknown
fields, as OpenAI does), and every refusal is an `ApiError` that renders OpenAI's error body.
Fields this server does not implement are accepted only at their default value, so a client
never silently gets less than it asked for. Two extensions, as vLLM has them: `ignore_eos` and
`stop_token_ids`; and each choice carries the generated `token_ids`.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shard_contract.wire import Completion, GenerateRequest

MAX_STOP_STRINGS = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unavailable(reason: str) -> ApiError:
    return ApiError(503, reason, type="service_unavailable", code="group_unavailable")


# ---------------------------------------------------------------- requests
class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(WireModel):
    include_usage: bool = False


# field -> the only value(s) accepted: the feature is not implemented beyond its default
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (None, 1), "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
    "suffix": (None,), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


class Sampling(WireModel):
    """Fields common to both endpoints."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _implemented(self) -> "Sampling":
        for name, allowed in NOT_IMPLEMENTED.items():
            value = getattr(self, name, None)
            if name in type(self).model_fields and value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported by this server (only {allowed[-1]!r})")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop: give at most {MAX_STOP_STRINGS} non-empty strings")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(WireModel):
    type: Literal["text"]
    text: str


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


def parse(model: type[WireModel], body: bytes) -> Any:
    """The request body as `model`, or a 400 naming the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {first['msg']}") from None
        # Union members (`str`, `list[int]`...) are noise in the location: keep the field path.
        path = [str(p) for p in first["loc"] if isinstance(p, int) or ("[" not in str(p) and p not in
                                                                         ("str", "int", "float", "bool"))]
        param = ".".join(path) or None
        message = first["msg"].removeprefix("Value error, ")
        given = first.get("input")
        shown = "" if first["type"] in ("missing", "extra_forbidden") or isinstance(given, (dict, list)) \
            else f" (got {given!r})"
        raise ApiError(400, f"{param}: {message}{shown}" if param else message + shown, param=param) from None


def prompt_of(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: {len(prompt)} prompts given; this server takes one per request", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    return prompt


def to_generate(request: Sampling, prompt_ids: list[int], *, max_len: int, vocab_size: int,
                max_tokens: int | None, has_tokenizer: bool, param: str = "prompt") -> GenerateRequest:
    """Check a request against the group's limits and build what the engine runs.

    `max_tokens` None means as many as the context allows. A sequence of P prompt tokens and M
    new ones needs P + M - 1 cache positions (the last token is never fed back).
    """
    if not prompt_ids:
        raise ApiError(400, f"{param}: encodes to no tokens", param=param)
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param=param)
    room = max_len + 1 - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"{param}: {len(prompt_ids)} tokens; this model's maximum context length "
                            f"(maxModelLen) is {max_len} tokens", param=param, code="context_length_exceeded")
    new = room if max_tokens is None else max_tokens
    if new > room:
        raise ApiError(400, f"max_tokens: {len(prompt_ids)} prompt tokens + {new} new tokens exceed this model's "
                            f"maximum context length (maxModelLen {max_len}); at most {room} new tokens fit",
                       param="max_tokens", code="context_length_exceeded")
    stops = request.stop_strings
    if stops and not has_tokenizer:
        raise ApiError(400, "stop: stop strings need the model's tokenizer.json; use stop_token_ids", param="stop")
    stop_ids = request.stop_token_ids or []
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise ApiError(400, f"stop_token_ids: ids must lie in [0, {vocab_size})", param="stop_token_ids")
    temperature = 1.0 if request.temperature is None else request.temperature
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return GenerateRequest(prompt_ids=prompt_ids, max_new_tokens=new, temperature=temperature,
                           top_p=1.0 if request.top_p is None else request.top_p, seed=seed, stop=stops,
                           stop_token_ids=stop_ids, ignore_eos=request.ignore_eos)


# ---------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, done: Completion, prompt_tokens: int) -> dict[str, Any]:
    choice = {"index": 0, "text": done.text or "", "token_ids": done.token_ids, "logprobs": None,
              "finish_reason": done.finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, len(done.token_ids))}


def completion_chunk(rid: str, created: int, model: str, text: str, token_ids: list[int],
                     finish_reason: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_body(rid: str, created: int, model: str, done: Completion, prompt_tokens: int) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": done.text or ""},
              "token_ids": done.token_ids, "logprobs": None, "finish_reason": done.finish_reason}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, len(done.token_ids))}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, str], token_ids: list[int],
               finish_reason: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, obj: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


# ---------------------------------------------------------------- streaming text
def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that may still change or be cut: an unfinished UTF-8
    character (decoded as U+FFFD) or the start of a stop string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


def _cut(text: str, stops: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(found)] if found else text


class TextStream:
    """One sequence's tokens so far -> deltas of text and ids that never need taking back.

    The concatenated deltas equal the final completion's text: text that could still turn out
    to be the start of a stop string, or half a character, waits for the next step.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.sent_text, self.sent_ids = "", 0

    def step(self, tokens: list[int]) -> tuple[str, list[int]]:
        ids = tokens[self.sent_ids:]
        self.sent_ids = len(tokens)
        if self.decode is None:
            return "", ids
        text = _cut(self.decode(tokens), self.stops)
        safe = text[:len(text) - _held_back(text, self.stops)]
        if not safe.startswith(self.sent_text):
            return "", ids
        delta, self.sent_text = safe[len(self.sent_text):], safe
        return delta, ids

    def finish(self, done: Completion) -> tuple[str, list[int]]:
        ids = done.token_ids[self.sent_ids:]
        self.sent_ids = len(done.token_ids)
        final = done.text or ""
        delta = final[len(self.sent_text):] if final.startswith(self.sent_text) else ""
        self.sent_text = final
        return delta, ids
