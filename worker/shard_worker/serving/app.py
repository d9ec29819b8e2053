"""Every rank's HTTP app.

Every rank serves `GET /health`, `GET /ready`, `GET /v1/shards` and `GET /metrics` on its
SHARD_PORT from the moment it starts (before it has joined its group or loaded anything), so
probes see the truth throughout: alive while loading, ready only once every rank has loaded and
passed its memory check. These stay open whatever the API key: the kubelet, Prometheus and the
operator read them. The leader also serves the OpenAI routes (`routes.py`), their OpenAPI
document at `GET /openapi.json`, and `GET /dashboard`, the group's live page (`dashboard.py`). A
request's own failure is its answer alone: an OpenAI error body.

The app knows the rank through `Probes` only (its verdict, its shards, its metrics), and the
OpenAI routes as a ready-made router: `__main__` composes the rank, the routes and this app, so
no module here imports the rank's lifecycle back. The probes are the rank itself when the app runs
in the engine's process (`lifecycle.RankProbes`), or the engine process's reports across a pipe
when it runs in the leader's HTTP process (`remote.EngineClient`).
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from shard_contract.wire import ShardsResponse

from ..log import first_line
from ..telemetry.health import Verdict
from . import dashboard, openai
from .routes import OpenAIRoutes


class Probes(Protocol):
    """What the app asks of its rank: the verdict and state at once, without blocking (the event
    loop answers `/health` with them); the shards and the metrics may take a round trip."""

    rank: int

    @property
    def state(self) -> str: ...  # loading, ready, failed, broken
    def verdict(self) -> Verdict: ...
    async def shards(self) -> ShardsResponse: ...
    async def exposition(self, ready: bool) -> bytes: ...


def build_app(model: str, probes: Probes, api: OpenAIRoutes | None = None) -> FastAPI:
    """A rank's app: the probes, and on the leader the OpenAI routes `api`."""
    app = FastAPI(title=f"shard_worker: {model}", version="v1", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if api is not None else None)

    @app.exception_handler(openai.ApiError)
    async def api_error(_: Request, err: openai.ApiError) -> JSONResponse:
        if api is not None and err.status != 404:
            api.metrics.outcome("rejected")
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> JSONResponse:
        # A failure of this request's own handling (uvicorn logs its traceback); the group is fine.
        return JSONResponse(openai.error_body(f"this request failed: {first_line(err)}", "server_error"),
                            status_code=500)

    # The probes and /v1/shards are no part of the OpenAPI document: shard_contract.wire is theirs.
    @app.get("/health", include_in_schema=False)
    async def health() -> JSONResponse:
        v = probes.verdict()
        body = {"status": ("ok" if probes.state == "ready" else probes.state) if v.alive else "unhealthy",
                "rank": probes.rank, "reason": v.reason}
        return JSONResponse(body, status_code=200 if v.alive else 503)

    @app.get("/ready", include_in_schema=False)
    async def ready() -> JSONResponse:
        v = probes.verdict()
        return JSONResponse({"ready": v.ready, "reason": v.reason}, status_code=200 if v.ready else 503)

    @app.get("/v1/shards", include_in_schema=False)
    async def shards() -> ShardsResponse:
        return await probes.shards()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body = await probes.exposition(probes.verdict().ready)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    if api is not None:
        app.include_router(api.router)
        app.include_router(dashboard.router(probes.shards), include_in_schema=False)  # the group's live page

        def document() -> dict[str, Any]:
            if app.openapi_schema is None:
                doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                  description="The OpenAI-compatible API of one sharded group.")
                doc.setdefault("components", {}).setdefault("schemas", {}).update(api.schemas())
                app.openapi_schema = doc
            return app.openapi_schema

        app.openapi = document  # type: ignore[method-assign]
    return app
