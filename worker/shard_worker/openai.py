"""The OpenAI wire format: request bodies in, `GenerateRequest`s out, responses and stream chunks
back. Pure: no server, no engine.

Requests are validated strictly (a string where a number belongs is an error, as are unknown
fields, as OpenAI does), and every refusal is an `ApiError` that renders OpenAI's error body,
naming the parameter. The request models are the API's documented schema (`GET /openapi.json`):
every accepted range is a constraint there (temperature, top_p and seed as OpenAI's; the group
bounds max_tokens by its context length). Fields this server does not implement are accepted only
at their default value, so a client never silently gets less than it asked for. Two extensions,
as vLLM has them: `ignore_eos` and `stop_token_ids`; and each choice carries the generated
`token_ids`.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from shard_contract.wire import SEED_MAX, SEED_MIN, TEMPERATURE_MAX, Completion, GenerateRequest

MAX_STOP_STRINGS = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    if status in (429, 503):
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (4xx), server_error (500: this request failed alone), "
                                  "service_unavailable (429, 503: the group is lost, starting or busy)")
    param: str | None = Field(None, description="The request parameter at fault.")
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


def unavailable(reason: str, status: int = 503) -> ApiError:
    """The group cannot take the request: it is not ready, lost, shutting down (503) or busy (429)."""
    return ApiError(status, reason, code="group_unavailable")


def check_api_key(given: str | None, key: bytes) -> None:
    """Refuse, with OpenAI's 401, a request whose bearer token (None: it sent none) is not `key`.
    Compared in constant time: how long it takes says nothing of how much of the key matched."""
    if given is None:
        raise ApiError(401, "You didn't provide an API key: send it as `Authorization: Bearer YOUR_KEY`")
    # The header arrives decoded as Latin-1 (HTTP's bytes): encoding it back gives those bytes.
    if not hmac.compare_digest(given.encode("latin-1"), key):
        raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")


# ---------------------------------------------------------------- requests
class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(WireModel):
    include_usage: bool = False


def only(default: Any) -> str:
    return f"Not implemented: only {default!r} (the default) is accepted."


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field's validator: JSON has numbers only, so 16.0 is the integer 16 (as JSON Schema
# says), "16" is none.
Integral = BeforeValidator(_integral)


# What only the group knows (its model's name, its vocabulary, its context length) is marked here
# and filled in when its document is served (`request_schemas`).
LIMIT = "x-group-limit"
ServedModel = Annotated[str, Field(json_schema_extra={LIMIT: "model"})]
TokenId = Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "token"}), Integral]
NewTokens = Annotated[int, Field(ge=1, json_schema_extra={LIMIT: "context"}), Integral]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), Integral]
Zero = Annotated[int, Field(ge=0, le=0), Integral]
One = Annotated[int, Field(ge=1, le=1), Integral]
Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]


class Sampling(WireModel):
    """Fields common to both endpoints."""

    model: ServedModel | None = Field(None, description="The served model (GET /v1/models); another name is 404.")
    max_tokens: NewTokens | None = Field(None, description="New tokens at most. The prompt's tokens plus these "
                                         "must fit the model's context (maxModelLen), else 400.")
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Sample from the smallest set of most likely "
                                "tokens whose probability reaches top_p; default 1.")
    n: Literal[1] = Field(1, description=only(1))
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = Field(None, description="Makes sampling repeatable (a signed "
                             "64-bit integer, as OpenAI's); default: a random one.")
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings; the text ends before the first one met "
                          "(needs the model's tokenizer.json).")
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=0, le=0, description=only(0))
    frequency_penalty: float | None = Field(None, ge=0, le=0, description=only(0))
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description=only({}))
    ignore_eos: bool = Field(False, description="Extension: generate past the end-of-sequence token.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension: token ids that end the sequence.")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: Text | Ids | Annotated[list[Text], Field(min_length=1, max_length=1)] | \
        Annotated[list[Ids], Field(min_length=1, max_length=1)] = Field(
            description="One prompt: text, token ids, or a list holding one of either.")
    max_tokens: NewTokens | None = Field(None, description="New tokens at most; default 16. The prompt's tokens "
                                         "plus these must fit the model's context (maxModelLen), else 400.")
    echo: Literal[False] = Field(False, description=only(False))
    logprobs: Zero | None = Field(None, description=only(None))
    best_of: One | None = Field(None, description=only(1))
    suffix: None = Field(None, description=only(None))


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
    messages: list[ChatMessage] = Field(min_length=1, description="Rendered by the model's chat template.")
    max_completion_tokens: NewTokens | None = Field(None, description="As max_tokens (which it overrides); "
                                                    "default: what the context leaves.")
    logprobs: Literal[False] | None = Field(None, description=only(None))
    top_logprobs: Zero | None = Field(None, description=only(None))


REQUEST_MODELS = (CompletionRequest, ChatRequest)
SCHEMAS = "#/components/schemas/"  # where an OpenAPI document keeps its schemas


def request_schemas(model: str, vocab_size: int, max_len: int) -> dict[str, Any]:
    """The JSON schemas of the request models and of what they refer to, for an OpenAPI
    document's components, with the limits of a group that serves `model`."""
    limits: dict[str, dict[str, Any]] = {"model": {"enum": [model]}, "token": {"maximum": vocab_size - 1},
                                         "context": {"maximum": max_len}}

    def fill(node: Any) -> None:
        if isinstance(node, dict):
            node.update(limits[node.pop(LIMIT)] if LIMIT in node else {})
            for value in node.values():
                fill(value)
        elif isinstance(node, list):
            for value in node:
                fill(value)

    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template=SCHEMAS + "{model}")
    fill(top)
    return top["$defs"]


def request_body(model: type[WireModel]) -> dict[str, Any]:
    """An OpenAPI operation's JSON request body of `model` (see `request_schemas`)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": SCHEMAS + model.__name__}}}}}


# Union members in a validation error's location (`str`, `list[int]`, `constrained-str`...):
# noise next to the field path.
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


def parse(model: type[WireModel], body: bytes) -> Any:
    """The request body as `model`, or a 400 naming the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        # Each member of a union reports; the one whose type matched says what is wrong.
        first = next((e for e in errors if e["loc"][:1] == first["loc"][:1] and not e["type"].endswith("_type")),
                     first)
        if first["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {first['msg']}") from None
        path = [str(p) for p in first["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
        param = ".".join(path) or None
        message = first["msg"].removeprefix("Value error, ")
        given = first.get("input")
        shown = "" if first["type"] in ("missing", "extra_forbidden") or isinstance(given, (dict, list)) \
            else f" (got {given!r})"
        raise ApiError(400, f"{param}: {message}{shown}" if param else message + shown, param=param) from None


def prompt_of(request: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (its schema allows one): text or token ids."""
    prompt = request.prompt
    return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt


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
