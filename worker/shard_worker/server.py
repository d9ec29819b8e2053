"""Serving: every rank's HTTP face, and the leader's OpenAI-compatible API.

Every rank serves `GET /health`, `GET /ready`, `GET /v1/shards` and `GET /metrics` on its
SHARD_PORT from the moment it starts (before it has joined its group or loaded anything), so
probes see the truth throughout: alive while loading, ready only once every rank has loaded and
passed its memory check. Rank 0 also serves `POST /v1/completions`, `POST /v1/chat/completions`
(when the model has a chat template), `GET /v1/models` and `GET /dashboard`, the group's live page
(`dashboard.py`).

Threads of one rank: uvicorn's event loop on the main thread (it owns SIGTERM / SIGINT); the
engine thread, which joins the group, loads, and then runs batches (leader) or follows the
leader's commands (others); and the heartbeat thread (`health.py`). Only the engine thread
touches torch.distributed.

SHARD_HOST (default 0.0.0.0) is the address to listen on; `shardctl run` binds 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, NoReturn

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shard_contract.env import WorkerEnv
from shard_contract.plan import Plan
from shard_contract.wire import ShardEntry, ShardsResponse

from . import dashboard, openai
from .accounting import MemorySample
from .batcher import EngineLoop, Pending, Sink, Unavailable
from .health import Heartbeat, Record, Verdict, memory_problems, read_group_key
from .rankmetrics import RankMetrics
from .runtime import Worker
from .tokenizer import TemplateError, TextCodec

HOST_ENV = "SHARD_HOST"
GRACEFUL_SECONDS = 10.0  # in-flight requests get this long to finish on SIGTERM
JOIN_SECONDS = 15.0


def log(rank: int, message: str) -> None:
    print(f"[shard_worker rank {rank}] {message}", file=sys.stderr, flush=True)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class RankServer:
    """One rank: its state, its engine thread, its heartbeat, and its HTTP app."""

    def __init__(self, env: WorkerEnv, plan: Plan, baseline: MemorySample, known_errors: tuple[type, ...] = ()):
        self.env, self.plan, self.baseline, self.known_errors = env, plan, baseline, known_errors
        self.rank_plan = plan.rank_plan(env.replica, env.rank)
        self.leader = env.rank == 0
        self.metrics = RankMetrics(env.model_name, env.replica, self.rank_plan, self.leader)
        self.worker: Worker | None = None
        self.state, self.error, self.problems = "loading", "", []
        self.progress: tuple[int, int] | None = None  # set by the engine thread as it loads
        self.loop: EngineLoop | None = None
        self.codec = TextCodec.load(env.model_dir) if self.leader else None
        self.heartbeat = Heartbeat(env.master_addr, env.master_port, env.rank, env.world_size, self._record,
                                   read_group_key(env.group_secret_file), on_lost=self._lost,
                                   on_rejected=self._rejected)
        self.exit_code = 0
        self.server: uvicorn.Server | None = None
        self.engine_thread = threading.Thread(target=self._engine, name="engine", daemon=True)
        self.created = int(time.time())

    # ------------------------------------------------------------ state
    def _record(self, seq: int) -> Record:
        report = self.worker.report() if self.worker is not None else None
        return Record(rank=self.env.rank, seq=seq, state=self.state, problems=self.problems, error=self.error,
                      report=report, progress=self.progress)

    def _lost(self, reason: str) -> None:
        log(self.env.rank, f"the group is lost: {reason}")
        if self.loop is not None:
            self.loop.fail_all(reason)

    def _rejected(self, reason: str) -> None:
        log(self.env.rank, f"ignored a heartbeat record: {reason}")
        self.metrics.heartbeat_rejected()

    def verdict(self) -> Verdict:
        if self.state == "failed":
            return Verdict(False, False, f"rank {self.env.rank} failed: {self.error}", {})
        verdict = self.heartbeat.verdict()
        if self.state == "broken" and verdict.alive:  # before the heartbeats name the cause
            return Verdict(False, False, f"rank {self.env.rank} lost its group: {self.error}", verdict.ranks_alive)
        if verdict.alive and verdict.ready and self.leader and (self.loop is None or not self.loop.started.is_set()):
            return Verdict(True, False, "the leader's engine is starting", verdict.ranks_alive)
        return verdict

    def _stop_serving(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            self.server.should_exit = True

    # ------------------------------------------------------------ the engine thread
    def _engine(self) -> None:
        rank = self.env.rank
        start = time.perf_counter()
        try:
            worker = Worker.start(self.env, self.plan, self.baseline,
                                  progress=lambda loaded, total: setattr(self, "progress", (loaded, total)))
        except BaseException as err:  # noqa: BLE001 -- reported, and the process exits non-zero
            self.state, self.error = "failed", first_line(err)
            known = isinstance(err, self.known_errors)
            log(rank, f"{type(err).__name__}: {err}" if known else traceback.format_exc())
            self._stop_serving(1)
            return
        r, rp = worker.resident, self.rank_plan
        log(rank, f"stage {rp.stage} tp {rp.tp_rank} layers {list(rp.layers)}: loaded in {worker.load_seconds:.2f}s "
                  f"(ready in {time.perf_counter() - start:.2f}s); weights {r.weights / 2**20:.1f} MiB, "
                  f"KV cache {r.kv_cache / 2**20:.1f} MiB resident")
        self.problems = memory_problems(rp, worker.resident, self.env.memory_budget_bytes)
        for problem in self.problems:
            log(rank, f"memory check failed: {problem}")
        self.worker = worker
        self.state = "ready"
        try:
            if self.leader:
                idle = max(1.0, min(30.0, self.env.rendezvous_timeout / 4))
                self.loop = EngineLoop(worker.engine, self.plan.max_batch_size, self.plan.max_model_len,
                                       self.metrics, idle_seconds=idle)
                self.loop.run()
            else:
                worker.engine.follow()  # until the leader says shutdown
                self._stop_serving(0)
        except Exception as err:  # noqa: BLE001 -- a collective failed: the group is lost
            self.state, self.error = "broken", f"a collective failed: {first_line(err)}"
            log(rank, f"lost the group: {self.error}")
            if not self.leader:
                self._stop_serving(1)

    # ------------------------------------------------------------ run
    def serve(self) -> NoReturn:
        host = os.environ.get(HOST_ENV, "0.0.0.0")
        config = uvicorn.Config(self.app(), host=host, port=self.env.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=GRACEFUL_SECONDS)
        self.server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it has shut down; handlers of our own
        # let the process finish here instead (tell the followers, then exit).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        self.heartbeat.start()
        self.engine_thread.start()
        try:
            self.server.run()
        except SystemExit as err:  # uvicorn could not bind the port
            self.exit_code = int(err.code or 1)
        if self.loop is not None:
            self.loop.close()  # the engine thread finishes its batch, then tells the followers
        self.engine_thread.join(JOIN_SECONDS if self.loop is not None else 0.5)  # only a leader's batch is worth waiting for
        self.heartbeat.stop()
        # A thread still running is blocked in a collective with a lost group (or this is a
        # follower stopped while its leader lives): nothing to tear down cleanly.
        if self.worker is not None and not self.engine_thread.is_alive():
            self.worker.close()
        # Leave now: the interpreter's own teardown waits seconds on the store's and the
        # heartbeat's sockets, and everything this rank had to say is said.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)

    # ------------------------------------------------------------ HTTP
    def app(self) -> FastAPI:
        app = FastAPI(title=f"shard_worker rank {self.env.rank}", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(openai.ApiError)
        async def api_error(_: Request, err: openai.ApiError) -> JSONResponse:
            if self.leader and err.status != 404:
                self.metrics.outcome("rejected")
            return JSONResponse(err.body(), status_code=err.status)

        @app.get("/health")
        async def health() -> JSONResponse:
            v = self.verdict()
            body = {"status": ("ok" if self.state == "ready" else self.state) if v.alive else "unhealthy",
                    "rank": self.env.rank, "reason": v.reason}
            return JSONResponse(body, status_code=200 if v.alive else 503)

        @app.get("/ready")
        async def ready() -> JSONResponse:
            v = self.verdict()
            return JSONResponse({"ready": v.ready, "reason": v.reason}, status_code=200 if v.ready else 503)

        @app.get("/v1/shards")
        async def shards() -> ShardsResponse:
            return self.shards()

        @app.get("/metrics")
        async def metrics() -> Response:
            body = self.metrics.exposition(self.worker, self.verdict().ready)
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        if self.leader:
            self._api_routes(app)
            app.include_router(dashboard.router(self.shards))
        return app

    def shards(self) -> ShardsResponse:
        """`GET /v1/shards`: every rank of the plan, with its latest published report once it has
        loaded."""
        verdict, records = self.verdict(), self.heartbeat.records()
        ranks = []
        for rp in self.plan.group(self.env.replica):
            record = records.get(rp.rank)
            measured: dict[str, Any] = dict(record.report) if record is not None and record.report else {}
            measured["alive"] = verdict.ranks_alive.get(rp.rank, verdict.alive)
            measured["state"] = record.state if record is not None else "starting"
            measured["problems"] = record.problems if record is not None else []
            if record is not None and record.progress:
                measured["load_progress"] = {"loaded": record.progress[0], "total": record.progress[1]}
            ranks.append(ShardEntry.planned(rp, **measured))
        group = next(g for g in self.plan.groups if g.replica == self.env.replica)
        return ShardsResponse(model=self.env.model_name, replica=self.env.replica, ready=verdict.ready,
                              reason=verdict.reason, predicted_step_seconds=group.critical_path_seconds, ranks=ranks)

    # ------------------------------------------------------------ the leader's API
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.env.model_name:
            raise openai.ApiError(404, f"The model `{name}` does not exist; this server serves "
                                       f"`{self.env.model_name}`", param="model", code="model_not_found")

    def _encode(self, text: str, param: str) -> list[int]:
        if self.codec is None:
            raise openai.ApiError(400, f"{param}: this model has no tokenizer.json; send token ids", param=param)
        return self.codec.encode(text)

    def _submit(self, request: openai.Sampling, prompt_ids: list[int], max_tokens: int | None,
                param: str) -> tuple[Pending, Any]:
        verdict = self.verdict()
        if not verdict.ready or self.worker is None or self.loop is None:
            raise openai.unavailable(verdict.reason or "the group is not ready")
        generate = openai.to_generate(request, prompt_ids, max_len=self.plan.max_model_len,
                                      vocab_size=self.worker.engine.config.vocab_size, max_tokens=max_tokens,
                                      has_tokenizer=self.codec is not None, param=param)
        pending = Pending(generate, Sink(asyncio.get_running_loop(), stream=request.stream))
        try:
            self.loop.submit(pending)
        except Unavailable as err:
            raise openai.ApiError(err.status, err.reason, type="service_unavailable", code="group_unavailable")
        decode = self.codec.decode if self.codec is not None else None
        return pending, openai.TextStream(decode, generate.stop)

    def _api_routes(self, app: FastAPI) -> None:
        name = self.env.model_name

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": name, "object": "model", "created": self.created,
                                                "owned_by": "shard-operator",
                                                "max_model_len": self.plan.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = openai.parse(openai.CompletionRequest, await request.body())
            self._check_model(body.model)
            prompt = openai.prompt_of(body)
            ids = prompt if isinstance(prompt, list) else self._encode(prompt, "prompt")
            pending, text = self._submit(body, ids, 16 if body.max_tokens is None else body.max_tokens, "prompt")
            return await self._respond(request, pending, text, body, len(ids), chat=False)

        @app.post("/v1/chat/completions")
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
            max_tokens = body.max_completion_tokens or body.max_tokens
            pending, text = self._submit(body, ids, max_tokens, "messages")
            return await self._respond(request, pending, text, body, len(ids), chat=True)

    async def _answer(self, request: Request, pending: Pending) -> tuple | None:
        """The request's final event, or None when its client disconnects first: the request is
        then cancelled, so the group stops generating for nobody."""
        answer = asyncio.ensure_future(pending.sink.queue.get())
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in (answer, gone):
            task.cancel()
        if answer in done:
            return answer.result()
        self.loop.cancel(pending)
        return None

    async def _respond(self, request: Request, pending: Pending, text: openai.TextStream, body: openai.Sampling,
                       prompt_tokens: int, chat: bool) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created, model = int(time.time()), self.env.model_name
        if not body.stream:
            event = await self._answer(request, pending)
            if event is None:
                return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
            if event[0] == "error":
                status, reason = event[1], event[2]
                kind = "service_unavailable" if status == 503 else "invalid_request_error"
                return JSONResponse(openai.error_body(reason, kind), status_code=status)
            build = openai.chat_body if chat else openai.completion_body
            return JSONResponse(build(rid, created, model, event[1], prompt_tokens))

        async def events() -> AsyncIterator[str]:
            def chunk(delta: str, ids: list[int], finish: str | None, first: bool = False) -> str:
                if chat:
                    content = {"role": "assistant", "content": delta} if first else {"content": delta}
                    data = openai.chat_chunk(rid, created, model, content if delta or first else {}, ids, finish)
                else:
                    data = openai.completion_chunk(rid, created, model, delta, ids, finish)
                return f"data: {json.dumps(data)}\n\n"

            answered = False
            try:
                if chat:
                    yield chunk("", [], None, first=True)
                while not answered:
                    event = await pending.sink.queue.get()
                    if event[0] == "step":
                        delta, ids = text.step(event[1])
                        if delta or ids:
                            yield chunk(delta, ids, None)
                    elif event[0] == "done":
                        answered, done = True, event[1]
                        delta, ids = text.finish(done)
                        yield chunk(delta, ids, done.finish_reason)
                        if body.include_usage:
                            obj = "chat.completion.chunk" if chat else "text_completion"
                            usage = openai.usage_chunk(rid, created, model, obj, prompt_tokens, len(done.token_ids))
                            yield f"data: {json.dumps(usage)}\n\n"
                        yield "data: [DONE]\n\n"
                    else:
                        answered = True
                        kind = "service_unavailable" if event[1] == 503 else "invalid_request_error"
                        yield f"data: {json.dumps(openai.error_body(event[2], kind))}\n\n"
            finally:  # the client went away mid-stream: the server stopped iterating us
                if not answered:
                    self.loop.cancel(pending)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _disconnected(request: Request) -> None:
    """Return when the client closes its connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def serve(env: WorkerEnv, plan: Plan, baseline: MemorySample, known_errors: tuple[type, ...] = ()) -> int:
    """Run this rank until it is told to stop (SIGTERM, SIGINT, or the leader's shutdown); the
    process then exits with the status (0, or 1 when it failed)."""
    if not Path(env.model_dir).is_dir():
        log(env.rank, f"SHARD_MODEL_DIR {env.model_dir} is not a directory")
        return 1
    try:
        rank = RankServer(env, plan, baseline, known_errors)
    except Exception as err:  # noqa: BLE001 -- no such rank in the plan; an unreadable tokenizer (tokenizers raises Exception)
        log(env.rank, f"cannot serve: {first_line(err)}")
        return 1
    return rank.serve()
