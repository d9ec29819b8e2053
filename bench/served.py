"""A local group served for a benchmark: its leader's URL once every rank answers ready.

The benches' common start (a free port, a scratch directory, the group on the loopback address,
the wait for /ready), so each script only plans the group and drives its load.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shard_contract.plan import Plan
from shard_operator.local.launcher import LocalGroup, free_port
from shard_operator.local.run import wait_ready


@contextmanager
def served(plan: Plan, model_dir: Path, *, threads: int, ready_seconds: float,
           env: dict[str, str] | None = None) -> Iterator[tuple[str, LocalGroup]]:
    """(the leader's base URL, the group), ready; the group stops when the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra_env = {"SHARD_HOST": "127.0.0.1", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp, LocalGroup(plan, model_dir, tmp, leader_port=port,
                                                          threads_per_rank=threads, extra_env=extra_env) as group:
        wait_ready(group, url, ready_seconds)
        yield url, group
