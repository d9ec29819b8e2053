"""Reading a group leader's `GET /v1/shards` (the JSON documented in workerenv.py): a thin edge.

The reconcile calls `fetch` through an injectable function, so tests can point it at a server of
their own and production code reaches each leader by its pod IP.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def fetch(url: str, timeout: float) -> dict[str, Any] | None:
    """The leader's report, or None when it cannot be reached or answers nonsense."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/shards", timeout=timeout) as response:
            report = json.load(response)
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return report if isinstance(report, dict) else None


def resident_by_rank(report: dict[str, Any]) -> dict[int, int]:
    """rank -> measured resident bytes (total) of every rank the leader reports."""
    out = {}
    for entry in report.get("ranks") or []:
        try:
            out[int(entry["rank"])] = int((entry.get("resident_bytes") or {})["total"])
        except (KeyError, TypeError, ValueError):
            continue  # a rank that has not measured yet
    return out
