"""Reading a group leader's `GET /v1/shards` (`shard_contract.wire.ShardsResponse`): a thin edge.

The reconcile calls `fetch` through an injectable function, so tests can point it at a server of
their own and production code reaches each leader by its pod IP.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from pydantic import ValidationError

from shard_contract.wire import ShardsResponse


def fetch(url: str, timeout: float) -> ShardsResponse | None:
    """The leader's report, or None when it cannot be reached or answers nonsense."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/shards", timeout=timeout) as response:
            return ShardsResponse.model_validate_json(response.read())
    except (OSError, ValueError, ValidationError, urllib.error.URLError):
        return None
