"""The leader's OpenAI-compatible routes, one FastAPI router: `GET /v1/models`, `POST
/v1/completions` and `POST /v1/chat/completions` (when the model has a chat template), behind
the API key when SHARD_API_KEY_FILE names one.

A request is read and checked (`openai.py`), queued on the engine loop (`batcher.py`), and
answered from its events (`Step`, then `Done` or `Failed`): as one body, or as server-sent
events while it is generated. A client that hangs up has its request cancelled, so the group
stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shard_contract.env import read_api_key
from shard_contract.wire import Completion

from . import openai
from .batcher import Done, EngineLoop, Event, Failed, Pending, Sink, Step, Unavailable
from .config import ModelConfig
from .rankmetrics import RankMetrics
from .text import TextStream
from .textproc import TextError, TextWorkers
from .tokenizer import TextCodec

ERRORS = (400, 401, 404, 429, 500, 503)  # the statuses a route answers with OpenAI's error body


class OpenAIRoutes:
    """The OpenAI routes of a group's leader: its model's tokenizer and chat template, its API key.
    `ready_loop()` is the leader's engine loop once the group is ready to take requests (else it
    raises Unavailable); `metrics` counts each request's outcome. Loading the tokenizer or the API
    key raises when they cannot be read."""

    def __init__(self, model: str, model_dir: str, max_len: int, api_key_file: str | None,
                 ready_loop: Callable[[], EngineLoop], metrics: RankMetrics, text_timeout: float = 10.0):
        self.model, self.model_dir, self.max_len = model, model_dir, max_len
        self.ready_loop, self.metrics = ready_loop, metrics
        self.codec = TextCodec.load(model_dir)
        # Text longer than this cannot fit the context: refused before anyone tokenizes it.
        self.max_chars = self.codec.max_prompt_chars(max_len) if self.codec is not None else 0
        self.text = TextWorkers(model_dir, text_timeout, self.max_chars) if self.codec is not None else None
        self.api_key = read_api_key(api_key_file) if api_key_file else None
        self.created = int(time.time())
        self.router = self._router()

    def schemas(self) -> dict[str, Any]:
        """The request schemas with this group's limits (its vocabulary is known before it loads)."""
        vocab = ModelConfig.from_dir(self.model_dir).vocab_size
        return openai.request_schemas(self.model, vocab, self.max_len)

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
            prompt = openai.prompt_of(body)
            ids = prompt if isinstance(prompt, list) else await self._encode(prompt, "prompt")
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            return await self._run(request, body, ids, max_tokens, "prompt", chat=False)

        @router.post("/v1/chat/completions", openapi_extra=openai.request_body(openai.ChatRequest))
        async def chat(request: Request) -> Response:
            body = openai.parse(openai.ChatRequest, await request.body())
            self._check_model(body.model)
            if self.codec is None or self.codec.chat_template is None:
                raise openai.ApiError(400, "this model has no chat template (tokenizer_config.json "
                                           "chat_template); use /v1/completions", param="messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await self._encode(messages, "messages")
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await self._run(request, body, ids, max_tokens, "messages", chat=True)

        return router

    # ------------------------------------------------------------ a request
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise openai.ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model}`",
                                  param="model", code="model_not_found")

    async def _encode(self, text: str | list[dict[str, str]], param: str) -> list[int]:
        """Token ids of a prompt's text or of a conversation, made by a tokenizer process off this
        event loop (`textproc.py`), once the text's length has shown it may fit the context."""
        if self.text is None:
            raise openai.ApiError(400, f"{param}: this model has no tokenizer.json; send token ids", param=param)
        chars = len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text)
        if chars > self.max_chars:
            raise openai.ApiError(400, f"{param}: {chars} characters; no text of more than {self.max_chars} "
                                       f"characters fits this model's maximum context length (maxModelLen "
                                       f"{self.max_len} tokens)", param=param, code="context_length_exceeded")
        try:
            return await (self.text.encode(text) if isinstance(text, str) else self.text.encode_chat(text))
        except TextError as err:
            raise openai.ApiError(err.status, f"{param}: {err}", param=param if err.status == 400 else None) \
                from None

    async def _run(self, request: Request, body: openai.Sampling, prompt_ids: list[int], max_tokens: int | None,
                   param: str, chat: bool) -> Response:
        """Queue the request on the engine loop and answer it."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            loop = self.ready_loop()
            generate = openai.to_generate(body, prompt_ids, max_len=self.max_len,
                                          vocab_size=loop.engine.config.vocab_size, max_tokens=max_tokens,
                                          has_tokenizer=self.codec is not None, param=param)
            sink = Sink(asyncio.get_running_loop(), stream=body.stream or bool(generate.stop))
            pending = Pending(generate, sink, rid)
            loop.submit(pending)
        except Unavailable as err:
            raise openai.unavailable(err.reason, err.status) from None
        reply = Reply(rid, int(time.time()), self.model, chat, len(prompt_ids), body.include_usage,
                      TextStream(self.codec.decode if self.codec is not None else None, generate.stop))
        if body.stream:
            return StreamingResponse(reply.events(loop, pending), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        event = await _answer(request, loop, pending, reply.text)
        if event is None:
            return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
        return reply.whole(event)


class Reply:
    """One request's answer in OpenAI's form: a whole body, or a stream of chunks; its text made
    by `text` from the engine's token ids."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, prompt_tokens: int, include_usage: bool,
                 text: TextStream):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.prompt_tokens, self.include_usage, self.text = prompt_tokens, include_usage, text

    def whole(self, event: Done | Failed) -> JSONResponse:
        event = settled(event)
        if isinstance(event, Failed):
            return JSONResponse(openai.error_body(event.reason, openai.error_type(event.status)),
                                status_code=event.status)
        build = openai.chat_body if self.chat else openai.completion_body
        return JSONResponse(build(self.rid, self.created, self.model, event.completion, self.prompt_tokens))

    def _chunk(self, delta: str, ids: list[int], finish: str | None, first: bool = False) -> str:
        if self.chat:
            content = {"role": "assistant", "content": delta} if first else {"content": delta}
            data = openai.chat_chunk(self.rid, self.created, self.model, content if delta or first else {}, ids,
                                     finish)
        else:
            data = openai.completion_chunk(self.rid, self.created, self.model, delta, ids, finish)
        return f"data: {json.dumps(data)}\n\n"

    def _last(self, final: Completion) -> list[str]:
        """The stream's last events: the text and ids held back until now with the finish reason,
        usage if asked, and [DONE]."""
        delta, ids = self.text.rest(final)
        events = [self._chunk(delta, ids, final.finish_reason)]
        if self.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            usage = openai.usage_chunk(self.rid, self.created, self.model, obj, self.prompt_tokens,
                                       len(final.token_ids))
            events.append(f"data: {json.dumps(usage)}\n\n")
        return [*events, "data: [DONE]\n\n"]

    async def events(self, loop: EngineLoop, pending: Pending) -> AsyncIterator[str]:
        """Server-sent events: a chunk per step that adds text, the last one, usage if asked, [DONE];
        or an error body."""
        answered = False
        try:
            if self.chat:
                yield self._chunk("", [], None, first=True)
            while not answered:
                event = latest(pending.sink.queue, await pending.sink.queue.get())
                if isinstance(event, Step):
                    delta, ids = self.text.step(event.tokens)
                    if delta or ids:
                        yield self._chunk(delta, ids, None)
                    failed = stepped(loop, pending, self.text)
                    if failed is None:
                        continue
                    event = failed
                elif isinstance(event, Done):
                    event = Done(self.text.finish(event.completion))
                answered = True
                event = settled(event)
                if isinstance(event, Failed):
                    yield f"data: {json.dumps(openai.error_body(event.reason, openai.error_type(event.status)))}\n\n"
                    continue
                for chunk in self._last(event.completion):
                    yield chunk
        finally:  # the client went away mid-stream: the server stopped iterating us
            if not answered:
                loop.cancel(pending)


def latest(queue: asyncio.Queue, event: Event) -> Event:
    """The freshest of `event` and the events already waiting behind it. A Step holds every token
    so far and a final event (Done, Failed) the whole answer, so each makes the Steps before it
    redundant: when this side falls behind the engine, it catches up with one chunk, not one a
    step."""
    while isinstance(event, Step) and not queue.empty():
        event = queue.get_nowait()
    return event


def stepped(loop: EngineLoop, pending: Pending, text: TextStream) -> Failed | None:
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


async def _answer(request: Request, loop: EngineLoop, pending: Pending, text: TextStream) -> Done | Failed | None:
    """The request's answer, or None when its client disconnects first: the request is then
    cancelled, so the group stops generating for nobody. Its Step events (it has stop strings)
    go to `text`, which may stop it."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            answer = asyncio.ensure_future(pending.sink.queue.get())
            done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if answer not in done:
                answer.cancel()
                loop.cancel(pending)
                return None
            event = latest(pending.sink.queue, answer.result())
            if isinstance(event, Failed):
                return event
            if isinstance(event, Done):
                return Done(text.finish(event.completion))
            text.step(event.tokens)
            if (failed := stepped(loop, pending, text)) is not None:
                return failed
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
