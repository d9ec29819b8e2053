"""The leader's OpenAI-compatible routes, one FastAPI router: `GET /v1/models`, `POST
/v1/completions` and `POST /v1/chat/completions` (when the model has a chat template), behind
the API key when SHARD_API_KEY_FILE names one.

A request is read and checked (`openai.py`), queued on the engine loop through a `Link` (the
loop in this process, or in the engine process across a pipe: `events.py`), and answered from its
events (`Step`, then `Done` or `Failed`): as one body, or as server-sent events while it is
generated. A client that hangs up has its request cancelled, so the group stops generating for
nobody. Torch-free: the leader's HTTP process (`front.py`) runs these routes apart from the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shard_contract.env import read_api_key
from shard_contract.wire import Completion

from .. import __version__
from ..engine import grammar
from ..model.config import ModelConfig
from . import choices, openai
from .events import Done, Event, Failed, Link, Outcomes, Pending, Sink, Step, Unavailable
from .text import TextStream
from .textproc import TextError, TextWorkers
from .tokenizer import TextCodec

ERRORS = (400, 401, 404, 429, 500, 503)  # the statuses a route answers with OpenAI's error body


class OpenAIRoutes:
    """The OpenAI routes of a group's leader: its model's tokenizer and chat template, its API key.
    `ready_link()` is the link to the leader's engine loop once the group is ready to take requests
    (else it raises Unavailable); `metrics` counts the requests refused here. Loading the tokenizer
    or the API key raises when they cannot be read."""

    def __init__(self, model: str, model_dir: str, max_len: int, api_key_file: str | None,
                 ready_link: Callable[[], Link], metrics: Outcomes, text_timeout: float = 10.0):
        self.model, self.model_dir, self.max_len = model, model_dir, max_len
        self.ready_link, self.metrics = ready_link, metrics
        self.vocab_size = ModelConfig.from_dir(model_dir).vocab_size
        self.codec = TextCodec.load(model_dir)
        # Text longer than this cannot fit the context: refused before anyone tokenizes it.
        self.max_chars = self.codec.max_prompt_chars(max_len) if self.codec is not None else 0
        self.text = TextWorkers(model_dir, text_timeout, self.max_chars) if self.codec is not None else None
        self.api_key = read_api_key(api_key_file) if api_key_file else None
        self.created = int(time.time())
        self.router = self._router()

    def schemas(self) -> dict[str, Any]:
        """The request schemas with this group's limits (its vocabulary is known before it loads)."""
        return openai.request_schemas(self.model, self.vocab_size, self.max_len)

    def _authorize(self, credentials: HTTPAuthorizationCredentials | None = Depends(
            HTTPBearer(auto_error=False, description="The API key (SHARD_API_KEY_FILE)"))) -> None:
        assert self.api_key is not None
        openai.check_api_key(credentials.credentials if credentials is not None else None, self.api_key)

    def _router(self) -> APIRouter:
        router = APIRouter(dependencies=[Depends(self._authorize)] if self.api_key is not None else [],
                           responses={status: {"model": openai.ErrorResponse} for status in ERRORS})

        @router.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                "owned_by": "shard-operator", "max_model_len": self.max_len}]}

        @router.post("/v1/completions", openapi_extra=openai.request_body(openai.CompletionRequest))
        async def completions(request: Request) -> Response:
            body = openai.parse(openai.CompletionRequest, await request.body())
            self._check_model(body.model)
            prompts = [p if isinstance(p, list) else await self._encode(p, "prompt") for p in openai.prompts_of(body)]
            best_of = body.best_of or body.n
            if best_of < body.n:
                raise openai.ApiError(400, f"best_of: must be at least n ({body.n})", param="best_of")
            if body.stream and best_of > body.n:
                raise openai.ApiError(400, "best_of: cannot stream the best of several choices", param="best_of")
            logprobs = body.logprobs if body.logprobs is not None else (0 if best_of > body.n else None)
            call = Call(chat=False, n=body.n, best_of=best_of, logprobs=logprobs, echo=body.echo,
                        show_logprobs=body.logprobs is not None)
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            if max_tokens == 0:  # the prompt alone: one token is generated, and dropped
                if not body.echo or body.stream:
                    raise openai.ApiError(400, "max_tokens: 0 only with echo (and not stream)", param="max_tokens")
                call.prompt_only, max_tokens = True, 1
            return await self._run(request, body, prompts, max_tokens, "prompt", call)

        @router.post("/v1/chat/completions", openapi_extra=openai.request_body(openai.ChatRequest))
        async def chat(request: Request) -> Response:
            body = openai.parse(openai.ChatRequest, await request.body())
            self._check_model(body.model)
            if self.codec is None or self.codec.chat_template is None:
                raise openai.ApiError(400, "this model has no chat template (tokenizer_config.json "
                                           "chat_template); use /v1/completions", param="messages")
            call = Call(chat=True, n=body.n, best_of=body.n, logprobs=(body.top_logprobs or 0) if body.logprobs
                        else None, show_logprobs=bool(body.logprobs))
            call.schema, tools = self._constraints(body, call)
            messages = [m.for_template() for m in body.messages]
            ids = await self._encode(messages, "messages", tools)
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await self._run(request, body, [ids], max_tokens, "messages", call)

        @router.post("/tokenize", openapi_extra=openai.request_body(openai.TokenizeRequest))
        async def tokenize(request: Request) -> dict[str, Any]:
            body = openai.parse(openai.TokenizeRequest, await request.body())
            self._check_model(body.model)
            if body.messages is not None:
                ids = await self._encode([m.for_template() for m in body.messages], "messages")
            elif body.prompt is not None:
                ids = await self._encode(body.prompt, "prompt")
            else:
                raise openai.ApiError(400, "prompt or messages: one is needed", param="prompt")
            return {"tokens": ids, "count": len(ids), "max_model_len": self.max_len}

        @router.post("/detokenize", openapi_extra=openai.request_body(openai.DetokenizeRequest))
        async def detokenize(request: Request) -> dict[str, Any]:
            body = openai.parse(openai.DetokenizeRequest, await request.body())
            self._check_model(body.model)
            if self.codec is None:
                raise openai.ApiError(400, "tokens: this model has no tokenizer.json", param="tokens")
            if any(t >= self.vocab_size for t in body.tokens):
                raise openai.ApiError(400, f"tokens: ids must lie in [0, {self.vocab_size})", param="tokens")
            return {"prompt": self.codec.decode(body.tokens)}

        @router.get("/version")
        async def version() -> dict[str, str]:
            return {"version": __version__}

        return router

    def _constraints(self, body: openai.ChatRequest, call: Call) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The JSON schema a chat answer is held to (response_format, or a required tool call),
        checked, and the tools its template offers the model."""
        assert self.codec is not None
        schema: str | None = None
        form = body.response_format
        if form is not None and form.type == "json_object":
            schema = grammar.JSON_OBJECT
        elif form is not None and form.type == "json_schema":
            if form.json_schema is None:
                raise openai.ApiError(400, "response_format.json_schema: needed with type json_schema",
                                      param="response_format.json_schema")
            schema = json.dumps(form.json_schema.schema_ if form.json_schema.schema_ is not None else {})
        tools = None
        if body.tools and body.tool_choice != "none":
            if not self.codec.renders_tools:
                raise openai.ApiError(400, "tools: this model's chat template does not render tools",
                                      param="tools")
            tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]
            functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
            call.tools = {f["name"] for f in functions}
            named = body.tool_choice.function.name if isinstance(body.tool_choice, openai.NamedTool) else None
            if named is not None and named not in call.tools:
                raise openai.ApiError(400, f"tool_choice: no tool is named {named!r}", param="tool_choice")
            if named is not None or body.tool_choice == "required":
                if schema is not None:
                    raise openai.ApiError(400, "response_format: not with a required tool call",
                                          param="response_format")
                schema = choices.tool_schema(functions, named)
        elif body.tool_choice not in (None, "none", "auto"):
            raise openai.ApiError(400, "tool_choice: needs tools", param="tool_choice")
        if schema is not None:
            try:
                grammar.grammar_of(schema)
            except ValueError as err:
                raise openai.ApiError(400, f"response_format: {err}", param="response_format") from None
        return schema, tools

    # ------------------------------------------------------------ a request
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise openai.ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model}`",
                                  param="model", code="model_not_found")

    async def _encode(self, text: str | list[dict[str, Any]], param: str,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt's text or of a conversation, made by a tokenizer process off this
        event loop (`textproc.py`), once the text's length has shown it may fit the context."""
        if self.text is None:
            raise openai.ApiError(400, f"{param}: this model has no tokenizer.json; send token ids", param=param)
        chars = len(text) if isinstance(text, str) else sum(len(str(m.get("content") or "")) for m in text)
        if chars > self.max_chars:
            raise openai.ApiError(400, f"{param}: {chars} characters; no text of more than {self.max_chars} "
                                       f"characters fits this model's maximum context length (maxModelLen "
                                       f"{self.max_len} tokens)", param=param, code="context_length_exceeded")
        try:
            return await (self.text.encode(text) if isinstance(text, str) else self.text.encode_chat(text, tools))
        except TextError as err:
            raise openai.ApiError(err.status, f"{param}: {err}", param=param if err.status == 400 else None) \
                from None

    async def _run(self, request: Request, body: openai.Sampling, prompts: list[list[int]], max_tokens: int | None,
                   param: str, call: Call) -> Response:
        """Queue each choice of each prompt on the engine loop and answer them."""
        rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
        replies: list[Reply] = []
        try:
            loop = self.ready_link()
            for p, ids in enumerate(prompts):
                base = openai.to_generate(body, ids, max_len=self.max_len, vocab_size=self.vocab_size,
                                          max_tokens=max_tokens, has_tokenizer=self.codec is not None,
                                          param=param, logprobs=call.logprobs, prompt_logprobs=call.echo and
                                          call.logprobs is not None, json_schema=call.schema)
                for j in range(call.best_of):
                    generate = openai.choice_request(base, j)
                    sink = Sink(asyncio.get_running_loop(), stream=body.stream or bool(generate.stop))
                    reply = Reply(rid, self, call, p * call.best_of + j, ids,
                                  Pending(generate, sink, f"{rid}-{p}-{j}" if len(prompts) * call.best_of > 1
                                          else rid))
                    replies.append(reply)
            await loop.submit([reply.pending for reply in replies])
        except Unavailable as err:
            raise openai.unavailable(err.reason, err.status) from None
        if body.stream:
            return StreamingResponse(streamed(loop, replies, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = await _answers(request, loop, replies)
        if events is None:
            return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
        return whole(replies, events, call)


@dataclass
class Call:
    """What a request asks beyond its sampling: the shape of its answer."""

    chat: bool
    n: int
    best_of: int
    logprobs: int | None  # top alternatives per token (None: no log-probabilities computed)
    show_logprobs: bool  # answered with them (best_of alone computes them to choose)
    echo: bool = False
    schema: str | None = None
    tools: set[str] | None = None
    prompt_only: bool = False  # max_tokens 0 with echo: the generated token is dropped


class Reply:
    """One choice's answer in OpenAI's form: a choice of a whole body, or a stream of chunks;
    its text made by `text` from the engine's token ids."""

    def __init__(self, rid: str, routes: OpenAIRoutes, call: Call, index: int, prompt_ids: list[int],
                 pending: Pending):
        self.rid, self.routes, self.call, self.index = rid, routes, call, index
        self.created, self.model = int(time.time()), routes.model
        self.prompt_ids, self.pending = prompt_ids, pending
        codec = routes.codec
        self.text = TextStream(codec.decode if codec is not None else None, pending.request.stop)
        self.sent_logprobs = 0
        self.failed = False  # its stream ended with an error body (and the whole stream ends there)

    def piece(self, token: int) -> str:
        codec = self.routes.codec
        return codec.decode([token]) if codec is not None else ""

    def prompt_text(self) -> str:
        codec = self.routes.codec
        return codec.decode(self.prompt_ids) if codec is not None else ""

    def choice(self, done: Completion, index: int) -> dict[str, Any]:
        call, text = self.call, done.text or ""
        if call.prompt_only:
            done = done.model_copy(update={"token_ids": [], "logprobs": [] if done.logprobs is not None else None,
                                           "top_logprobs": [] if done.top_logprobs is not None else None,
                                           "finish_reason": "length"})
            text = ""
        if call.chat:
            logprobs = None
            if call.show_logprobs and done.logprobs is not None and done.top_logprobs is not None:
                logprobs = choices.chat_logprobs(done.token_ids[:len(done.logprobs)], done.logprobs,
                                                 done.top_logprobs, self.piece)
            tool_calls = choices.parse_tool_calls(text, call.tools) if call.tools else None
            return openai.chat_choice(index, text, done, logprobs, tool_calls)
        prompt = self.prompt_text() if call.echo else ""
        logprobs = None
        if call.show_logprobs:
            logprobs = choices.completion_choice_logprobs(done, self.prompt_ids if call.echo else None, self.piece, 0)
        return openai.completion_choice(index, prompt + text, done, logprobs)

    def _chunk(self, delta: str, ids: list[int], finish: str | None, step: Step | None = None,
               first: bool = False) -> str:
        logprobs = None
        if self.call.show_logprobs and step is not None and step.logprobs is not None and ids:
            lo = self.sent_logprobs
            hi = min(lo + len(ids), len(step.logprobs))
            lp_ids, lps = step.tokens[lo:hi], step.logprobs[lo:hi]
            tops = (step.top_logprobs or [])[lo:hi]
            self.sent_logprobs = hi
            logprobs = choices.chat_logprobs(lp_ids, lps, tops, self.piece) if self.call.chat else \
                choices.completion_logprobs(lp_ids, lps, tops, self.piece)
        if self.call.chat:
            content = {"role": "assistant", "content": delta} if first else {"content": delta}
            data = openai.chat_chunk(self.rid, self.created, self.model, self.index,
                                     content if delta or first else {}, ids, finish, logprobs)
        else:
            data = openai.completion_chunk(self.rid, self.created, self.model, self.index, delta, ids, finish,
                                           logprobs)
        return f"data: {json.dumps(data)}\n\n"

    async def events(self, loop: Link) -> AsyncIterator[str | Completion]:
        """Server-sent events of this choice: a chunk per step that adds text, the last one (then
        the final Completion itself, for usage); or an error body."""
        pending, answered = self.pending, False
        last: Step | None = None
        try:
            if self.call.chat:
                yield self._chunk("", [], None, first=True)
            elif self.call.echo:
                yield self._chunk(self.prompt_text(), [], None)
            while not answered:
                event = latest(pending.sink.queue, await pending.sink.queue.get())
                if isinstance(event, Step):
                    last = event
                    delta, ids = self.text.step(event.tokens)
                    if delta or ids:
                        yield self._chunk(delta, ids, None, event)
                    failed = stepped(loop, pending, self.text)
                    if failed is None:
                        continue
                    event = failed
                elif isinstance(event, Done):
                    event = Done(self.text.finish(event.completion))
                answered = True
                event = settled(event)
                if isinstance(event, Failed):
                    self.failed = True
                    yield f"data: {json.dumps(openai.error_body(event.reason, openai.error_type(event.status)))}\n\n"
                    continue
                final = event.completion
                delta, ids = self.text.rest(final)
                tail = last if last is not None and final.logprobs is None else \
                    Step(final.token_ids, final.logprobs, final.top_logprobs)
                yield self._chunk(delta, ids, final.finish_reason, tail)
                yield final
        finally:  # the client went away mid-stream: the server stopped iterating us
            if not answered:
                loop.cancel(pending)


async def streamed(loop: Link, replies: list[Reply], include_usage: bool) -> AsyncIterator[str]:
    """The chunks of every choice as they come, then usage if asked, and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(reply: Reply) -> None:
        try:
            async for item in reply.events(loop):
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(r)) for r in replies]
    finals: list[Completion] = []
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Completion):
                finals.append(item)
            else:
                yield item
        if any(r.failed for r in replies):
            return  # an error body ends the stream, as with one choice
        if include_usage:
            call = replies[0].call
            obj = "chat.completion.chunk" if call.chat else "text_completion"
            used = usage_of(replies, finals)
            first = replies[0]
            yield f"data: {json.dumps(openai.usage_chunk(first.rid, first.created, first.model, obj, used))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def usage_of(replies: list[Reply], finals: list[Completion]) -> dict[str, Any]:
    """Prompt tokens once per prompt (its choices share it), completion tokens of every choice."""
    prompts = {r.index // r.call.best_of: len(r.prompt_ids) for r in replies}
    generated = 0 if replies[0].call.prompt_only else sum(len(c.token_ids) for c in finals)
    return openai.usage(sum(prompts.values()), generated,
                        sum(c.cached_tokens for c in finals[:len(prompts)]))


def whole(replies: list[Reply], events: list[Done | Failed], call: Call) -> JSONResponse:
    """The body of a request answered at once: its choices in order (for best_of, the n best of
    each prompt's), or the first failure's error."""
    settled_events = [settled(e) for e in events]
    for event in settled_events:
        if isinstance(event, Failed):
            return JSONResponse(openai.error_body(event.reason, openai.error_type(event.status)),
                                status_code=event.status)
    done = [e.completion for e in settled_events if isinstance(e, Done)]
    out = []
    for p in range(len(replies) // call.best_of):
        group = list(range(p * call.best_of, (p + 1) * call.best_of))
        chosen = [group[i] for i in choices.best([done[k] for k in group], call.n)] if call.best_of > call.n \
            else group
        out += [replies[k].choice(done[k], p * call.n + i) for i, k in enumerate(chosen)]
    first = replies[0]
    used = usage_of(replies, done)
    build = openai.chat_body if call.chat else openai.completion_body
    return JSONResponse(build(first.rid, first.created, first.model, out, used))


def latest(queue: asyncio.Queue, event: Event) -> Event:
    """The freshest of `event` and the events already waiting behind it. A Step holds every token
    so far and a final event (Done, Failed) the whole answer, so each makes the Steps before it
    redundant: when this side falls behind the engine, it catches up with one chunk, not one a
    step."""
    while isinstance(event, Step) and not queue.empty():
        event = queue.get_nowait()
    return event


def stepped(loop: Link, pending: Pending, text: TextStream) -> Failed | None:
    """After `text` took a Step: a text that met a stop string has its sequence stopped at the
    engine's next step boundary (the engine then answers it, finish reason "stop"); a text that
    could not be decoded fails its request now."""
    if text.error is not None:
        loop.cancel(pending)
        return Failed(500, f"this request failed: {text.error}")
    if text.stopped and not text.stop_sent:
        loop.stop(pending)
        text.stop_sent = True
    return None


def settled(event: Done | Failed) -> Done | Failed:
    """An answer whose text failed is this request's failure (500), as the engine's own are."""
    if isinstance(event, Done) and event.completion.finish_reason == "error":
        return Failed(500, f"this request failed: {event.completion.error}")
    return event


async def _settle(loop: Link, pending: Pending, text: TextStream) -> Done | Failed:
    """A choice's answer. Its Step events (it has stop strings) go to `text`, which may stop it."""
    while True:
        event = latest(pending.sink.queue, await pending.sink.queue.get())
        if isinstance(event, Failed):
            return event
        if isinstance(event, Done):
            return Done(text.finish(event.completion))
        text.step(event.tokens)
        if (failed := stepped(loop, pending, text)) is not None:
            return failed


async def _answers(request: Request, loop: Link, replies: list[Reply]) -> list[Done | Failed] | None:
    """Every choice's answer, or None when the client disconnects first: the choices are then
    cancelled, so the group stops generating for nobody."""
    gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    answers: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.gather(*(_settle(loop, r.pending, r.text) for r in replies)))
    try:
        await asyncio.wait([answers, gone], return_when=asyncio.FIRST_COMPLETED)
        if answers.done():
            return list(answers.result())
        answers.cancel()
        for reply in replies:
            loop.cancel(reply.pending)
        return None
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
