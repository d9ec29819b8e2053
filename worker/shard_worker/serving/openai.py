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
import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from shard_contract.wire import (
    BIAS_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    PENALTY_MAX,
    REPETITION_MAX,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE_MAX,
    Completion,
    GenerateRequest,
)

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # n and best_of
MAX_PROMPTS = 32  # prompts in one completion request
MAX_TOOLS = 64


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
NewTokensOrNone = Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "context"}), Integral]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), Integral]
Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]


Penalty = Annotated[float, Field(ge=-PENALTY_MAX, le=PENALTY_MAX)]
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES), Integral]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral]


class Sampling(WireModel):
    """Fields common to both endpoints."""

    model: ServedModel | None = Field(None, description="The served model (GET /v1/models); another name is 404.")
    max_tokens: NewTokens | None = Field(None, description="New tokens at most. The prompt's tokens plus these "
                                         "must fit the model's context (maxModelLen), else 400.")
    temperature: float | None = Field(None, ge=0.0, le=TEMPERATURE_MAX, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Sample from the smallest set of most likely "
                                "tokens whose probability reaches top_p; default 1.")
    n: Choices = Field(1, description=f"Choices per prompt (at most {MAX_CHOICES}); choice i samples with seed + i.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = Field(None, description="Makes sampling repeatable (a signed "
                             "64-bit integer, as OpenAI's); default: a random one.")
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings; the text ends before the first one met "
                          "(needs the model's tokenizer.json).")
    user: str | None = None
    presence_penalty: Penalty | None = Field(None, description="Subtracted from the logit of each token generated "
                                             "so far.")
    frequency_penalty: Penalty | None = Field(None, description="Subtracted from the logit of each token generated "
                                              "so far, times how often it was.")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-BIAS_MAX, le=BIAS_MAX)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="Token id (as a string) -> a value in [-100, 100] added to its logit.")
    ignore_eos: bool = Field(False, description="Extension: generate past the end-of-sequence token.")
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension: token ids that end the sequence.")
    top_k: Annotated[int, Field(ge=-1), Integral] | None = Field(None, description="Extension: sample from the k "
                                                                 "most likely tokens; 0 or -1 (the default): all.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension: drop tokens less likely than min_p "
                                "times the most likely one.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=REPETITION_MAX, description=(
        "Extension: divide the positive logits (multiply the negative ones) of the tokens of the prompt and of "
        "the output so far by this; 1 (the default) is off."))

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: Text | Ids | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[Ids], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
            description=f"Text, token ids, or a list of up to {MAX_PROMPTS} of either (answered in order: "
                        "the choices of prompt p have indices p * n to p * n + n - 1).")
    max_tokens: NewTokensOrNone | None = Field(None, description="New tokens at most; default 16 (0 with echo: "
                                               "the prompt alone, as evaluation harnesses score it). The prompt's "
                                               "tokens plus these must fit the model's context (maxModelLen), "
                                               "else 400.")
    echo: bool = Field(False, description="Answer the prompt before the completion (with logprobs, the prompt's "
                                          "own log-probabilities too).")
    logprobs: TopLogprobs | None = Field(None, description=f"Each token's log-probability and the up to "
                                         f"{MAX_LOGPROBS} most likely alternatives'.")
    best_of: Choices | None = Field(None, description="Generate this many choices per prompt and answer the n "
                                    "with the highest total log-probability (not with stream).")


class ContentPart(WireModel):
    type: Literal["text"]
    text: str


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (a tool call's arguments as JSON where they parse)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class JsonSchemaFormat(WireModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(WireModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(WireModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(WireModel):
    name: str


class NamedTool(WireModel):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, description="Rendered by the model's chat template.")
    max_completion_tokens: NewTokens | None = Field(None, description="As max_tokens (which it overrides); "
                                                    "default: what the context leaves.")
    logprobs: bool | None = Field(None, description="Each generated token's log-probability.")
    top_logprobs: TopLogprobs | None = Field(None, description="With logprobs: the most likely alternatives.")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the answer is "
                                                   "JSON (valid under the schema), enforced as it is sampled.")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call, rendered by its chat template (which must take tools).")
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = Field(
        None, description="required or a named function: the answer is a call, its arguments valid under the "
                          "function's parameters (enforced as it is sampled).")
    parallel_tool_calls: bool | None = None


class TokenizeRequest(WireModel):
    """`POST /tokenize`: a prompt's text, or a conversation as the chat template renders it."""

    model: ServedModel | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(WireModel):
    model: ServedModel | None = None
    tokens: list[TokenId]


REQUEST_MODELS = (CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest)
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
        unknown = next((e for e in errors if e["type"] == "extra_forbidden"), None)
        if unknown is not None:
            raise not_supported(".".join(str(p) for p in unknown["loc"])) from None
        path = [str(p) for p in first["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
        param = ".".join(path) or None
        message = first["msg"].removeprefix("Value error, ")
        given = first.get("input")
        shown = "" if first["type"] in ("missing", "extra_forbidden") or isinstance(given, (dict, list)) \
            else f" (got {given!r})"
        raise ApiError(400, f"{param}: {message}{shown}" if param else message + shown, param=param) from None


# Why a parameter of OpenAI's is refused, where more can be said than that.
WHY_NOT = {"suffix": "Llama-family models do not fill in the middle"}


def not_supported(param: str) -> ApiError:
    why = WHY_NOT.get(param)
    return ApiError(400, f"{param}: not supported by this server" + (f" ({why})" if why else ""), param=param)


def prompts_of(request: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts, in order: each text or token ids."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)  # type: ignore[arg-type]


def to_generate(request: Sampling, prompt_ids: list[int], *, max_len: int, vocab_size: int,
                max_tokens: int | None, has_tokenizer: bool, param: str = "prompt", logprobs: int | None = None,
                prompt_logprobs: bool = False, json_schema: str | None = None) -> GenerateRequest:
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
    bias: dict[int, float] = {}
    for key, value in (request.logit_bias or {}).items():
        # ASCII digits alone: str.isdigit takes "²", which int() refuses (a 500), and int() of more
        # than 4300 digits raises too; a key longer than any id of the vocabulary is out of it
        digits = key.lstrip("0") or "0"
        if not (key.isascii() and key.isdigit()) or len(digits) > len(str(vocab_size)) or int(digits) >= vocab_size:
            raise ApiError(400, f"logit_bias: keys are token ids in [0, {vocab_size}) (got {key[:20]!r})",
                           param="logit_bias")
        bias[int(digits)] = value
    if json_schema is not None and request.ignore_eos:
        raise ApiError(400, "ignore_eos: a constrained answer ends at its end-of-sequence token; drop ignore_eos",
                       param="ignore_eos")
    temperature = 1.0 if request.temperature is None else request.temperature
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return GenerateRequest(prompt_ids=prompt_ids, max_new_tokens=new, temperature=temperature,
                           top_p=1.0 if request.top_p is None else request.top_p, seed=seed, stop=stops,
                           stop_token_ids=stop_ids, ignore_eos=request.ignore_eos,
                           top_k=max(request.top_k or 0, 0), min_p=request.min_p or 0.0,
                           presence_penalty=request.presence_penalty or 0.0,
                           frequency_penalty=request.frequency_penalty or 0.0,
                           repetition_penalty=request.repetition_penalty or 1.0, logit_bias=bias,
                           logprobs=logprobs, prompt_logprobs=prompt_logprobs, json_schema=json_schema)


def choice_request(base: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index` of a request: the same, sampling with seed + index (wrapped into 64 bits)."""
    if index == 0:
        return base
    seed = (base.seed + index - SEED_MIN) % 2**64 + SEED_MIN
    return base.model_copy(update={"seed": seed})


# ---------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                    used: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": used}


def completion_choice(index: int, text: str, done: Completion, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "token_ids": done.token_ids, "logprobs": logprobs,
            "finish_reason": done.finish_reason}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, token_ids: list[int],
                     finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "token_ids": token_ids, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_body(rid: str, created: int, model: str, choices: list[dict[str, Any]],
              used: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": used}


def chat_choice(index: int, text: str, done: Completion, logprobs: dict[str, Any] | None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls else text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish = "tool_calls" if tool_calls else done.finish_reason
    return {"index": index, "message": message, "token_ids": done.token_ids, "logprobs": logprobs,
            "finish_reason": finish}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any], token_ids: list[int],
               finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "token_ids": token_ids, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, obj: str, used: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": used}
