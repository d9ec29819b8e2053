"""`GET /dashboard`: the group's live page, served by its leader (read-only, open like `/v1/shards`).

The page is one self-contained file (`dashboard.html`: inline script and style, nothing fetched
from elsewhere, since clusters are often offline). Every 2 s it reads what the leader already
serves: `/v1/shards`, `/metrics`, `/health`, and `/dashboard/layout.svg`, the placement picture
(`shard_contract.picture`) of those same `/v1/shards` entries. Rates, shares and percentiles are
computed in the browser from the counters and histograms it polls, so the server keeps no history
and the page costs it four small GETs per viewer every 2 s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from shard_contract.picture import group_svg
from shard_contract.wire import ShardsResponse

PAGE = files(__package__).joinpath("dashboard.html").read_text()


def router(shards: Callable[[], Awaitable[ShardsResponse]]) -> APIRouter:
    """The page and its picture of the group that `shards()` describes."""
    routes = APIRouter()

    @routes.get("/dashboard")
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})

    @routes.get("/dashboard/layout.svg")
    async def layout() -> Response:
        group = await shards()
        svg = group_svg(group.ranks, title=f"{group.model} · group {group.replica}", reason=group.reason)
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-store"})

    return routes
