"""dynamo's recompile limit for a rank's `fullgraph=True` functions (int8mm's products, paged
attention). Past the limit (8 by default) such a function raises instead of falling back to eager
(torch 2.13's convert_frame: FailOnRecompileLimitHit), which would end the rank's step loop; a
serving rank meets more variants than that: int8 decode compiles one per (rows, weight shape), the
projection shapes times the batch buckets up to 8, and dynamic shapes still specialise a size of 1
(a one-row batch, a decode step's one query column) and size coincidences (rows = KV heads)."""

from __future__ import annotations

LIMIT = 64


def allow() -> None:
    """Raise the process's recompile limit to at least LIMIT (never lower it)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, LIMIT)
