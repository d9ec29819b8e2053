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
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shard_contract.env import read_api_key

from . import openai
from .batcher import Done, EngineLoop, Event, Failed, Pending, Sink, Step, Unavailable
from .config import ModelConfig
from .log import first_line
from .tokenizer import TemplateError, TextCodec

if TYPE_CHECKING:
    from .rank import Rank

ERRORS = (400, 401, 404, 429, 500, 503)  # the statuses a route answers with OpenAI's error body


class OpenAIRoutes:
    """The OpenAI routes of the leader `rank`: its model's tokenizer and chat template, its API key."""

    def __init__(self, rank: Rank):
        self.rank, env = rank, rank.env
        self.model, self.max_len = env.model_name, rank.plan.max_model_len
        self.codec = TextCodec.load(env.model_dir)
        self.api_key = read_api_key(env.api_key_file) if env.api_key_file else None
        self.created = int(time.time())
        self.router = self._router()

    def schemas(self) -> dict[str, Any]:
        """The request schemas with this group's limits (its vocabulary is known before it loads)."""
        vocab = ModelConfig.from_dir(self.rank.env.model_dir).vocab_size
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
            ids = prompt if isinstance(prompt, list) else self._encode(prompt, "prompt")
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            return await self._run(request, body, ids, max_tokens, "prompt", chat=False)

        @router.post("/v1/chat/completions", openapi_extra=openai.request_body(openai.ChatRequest))
        async def chat(request: Request) -> Response:
            body = openai.parse(openai.ChatRequest, await request.body())
            self._check_model(body.model)
            if self.codec is None or self.codec.chat_template is None:
                raise openai.ApiError(400, "this model has no chat template (tokenizer_config.json "
                                           "chat_template); use /v1/completions", param="messages")
            try:
                ids = self.codec.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
            except TemplateError as err:
                raise openai.ApiError(400, f"messages: {err}", param="messages") from None
            except Exception as err:  # noqa: BLE001 -- tokenizers raises plain exceptions on text it cannot take
                raise untokenizable("messages", err) from None
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await self._run(request, body, ids, max_tokens, "messages", chat=True)

        return router

    # ------------------------------------------------------------ a request
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise openai.ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model}`",
                                  param="model", code="model_not_found")

    def _encode(self, text: str, param: str) -> list[int]:
        if self.codec is None:
            raise openai.ApiError(400, f"{param}: this model has no tokenizer.json; send token ids", param=param)
        try:
            return self.codec.encode(text)
        except Exception as err:  # noqa: BLE001 -- tokenizers raises plain exceptions on text it cannot take
            raise untokenizable(param, err) from None

    async def _run(self, request: Request, body: openai.Sampling, prompt_ids: list[int], max_tokens: int | None,
                   param: str, chat: bool) -> Response:
        """Queue the request on the engine loop and answer it."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            loop = self.rank.ready_loop()
            generate = openai.to_generate(body, prompt_ids, max_len=self.max_len,
                                          vocab_size=loop.engine.config.vocab_size, max_tokens=max_tokens,
                                          has_tokenizer=self.codec is not None, param=param)
            pending = Pending(generate, Sink(asyncio.get_running_loop(), stream=body.stream), rid)
            loop.submit(pending)
        except Unavailable as err:
            raise openai.unavailable(err.reason, err.status) from None
        text = openai.TextStream(self.codec.decode if self.codec is not None else None, generate.stop)
        reply = Reply(rid, int(time.time()), self.model, chat, len(prompt_ids), body.include_usage)
        if body.stream:
            return StreamingResponse(reply.events(loop, pending, text), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        event = await _answer(request, loop, pending)
        if event is None:
            return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
        return reply.whole(event)


class Reply:
    """One request's answer in OpenAI's form: a whole body, or a stream of chunks."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, prompt_tokens: int, include_usage: bool):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage

    def whole(self, event: Done | Failed) -> JSONResponse:
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

    async def events(self, loop: EngineLoop, pending: Pending, text: openai.TextStream) -> AsyncIterator[str]:
        """Server-sent events: a chunk per step that adds text, the last one, usage if asked, [DONE];
        or an error body."""
        answered = False
        try:
            if self.chat:
                yield self._chunk("", [], None, first=True)
            while not answered:
                event: Event = await pending.sink.queue.get()
                if isinstance(event, Step):
                    delta, ids = text.step(event.tokens)
                    if delta or ids:
                        yield self._chunk(delta, ids, None)
                    continue
                answered = True
                if isinstance(event, Failed):
                    yield f"data: {json.dumps(openai.error_body(event.reason, openai.error_type(event.status)))}\n\n"
                    continue
                done = event.completion
                delta, ids = text.finish(done)
                yield self._chunk(delta, ids, done.finish_reason)
                if self.include_usage:
                    obj = "chat.completion.chunk" if self.chat else "text_completion"
                    usage = openai.usage_chunk(self.rid, self.created, self.model, obj, self.prompt_tokens,
                                               len(done.token_ids))
                    yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream: the server stopped iterating us
            if not answered:
                loop.cancel(pending)


async def _answer(request: Request, loop: EngineLoop, pending: Pending) -> Done | Failed | None:
    """The request's final event, or None when its client disconnects first: the request is then
    cancelled, so the group stops generating for nobody."""
    answer = asyncio.ensure_future(pending.sink.queue.get())
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    for task in (answer, gone):
        task.cancel()
    if answer in done:
        return answer.result()
    loop.cancel(pending)
    return None


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def untokenizable(param: str, err: Exception) -> openai.ApiError:
    return openai.ApiError(400, f"{param}: the tokenizer cannot encode it: {first_line(err)}", param=param)
