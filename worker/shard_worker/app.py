"""Every rank's HTTP app.

Every rank serves `GET /health`, `GET /ready`, `GET /v1/shards` and `GET /metrics` on its
SHARD_PORT from the moment it starts (before it has joined its group or loaded anything), so
probes see the truth throughout: alive while loading, ready only once every rank has loaded and
passed its memory check. These stay open whatever the API key: the kubelet, Prometheus and the
operator read them. The leader also serves the OpenAI routes (`routes.py`), their OpenAPI
document at `GET /openapi.json`, and `GET /dashboard`, the group's live page (`dashboard.py`). A
request's own failure is its answer alone: an OpenAI error body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from shard_contract.wire import ShardsResponse

from . import dashboard, openai
from .log import first_line
from .routes import OpenAIRoutes

if TYPE_CHECKING:
    from .rank import Rank


def build_app(rank: Rank) -> FastAPI:
    """The rank's app; on the leader this loads the tokenizer and the API key (it raises when it
    cannot)."""
    api = OpenAIRoutes(rank) if rank.leader else None
    app = FastAPI(title=f"shard_worker: {rank.env.model_name}", version="v1", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if api is not None else None)

    @app.exception_handler(openai.ApiError)
    async def api_error(_: Request, err: openai.ApiError) -> JSONResponse:
        if rank.leader and err.status != 404:
            rank.metrics.outcome("rejected")
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
        v = rank.verdict()
        body = {"status": ("ok" if rank.state == "ready" else rank.state) if v.alive else "unhealthy",
                "rank": rank.env.rank, "reason": v.reason}
        return JSONResponse(body, status_code=200 if v.alive else 503)

    @app.get("/ready", include_in_schema=False)
    async def ready() -> JSONResponse:
        v = rank.verdict()
        return JSONResponse({"ready": v.ready, "reason": v.reason}, status_code=200 if v.ready else 503)

    @app.get("/v1/shards", include_in_schema=False)
    async def shards() -> ShardsResponse:
        return rank.shards()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body = rank.metrics.exposition(rank.worker, rank.verdict().ready)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    if api is not None:
        app.include_router(api.router)
        app.include_router(dashboard.router(rank.shards), include_in_schema=False)  # the group's live page

        def document() -> dict[str, Any]:
            if app.openapi_schema is None:
                doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                  description="The OpenAI-compatible API of one sharded group.")
                doc.setdefault("components", {}).setdefault("schemas", {}).update(api.schemas())
                app.openapi_schema = doc
            return app.openapi_schema

        app.openapi = document  # type: ignore[method-assign]
    return app
