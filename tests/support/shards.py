"""`/v1/shards` entries for tests: a rank's place in a plan, and what it measured."""

from __future__ import annotations

from typing import Any

from shard_contract.plan import PredictedBytes, RankPlan
from shard_contract.wire import RankReport, ResidentBytes, ShardEntry

PREDICTED = PredictedBytes(weights=1, kv_cache=1, activations=1, overhead=1)


def rank_plan(rank: int, *, stage: int = 0, tp_rank: int | None = None, layers: tuple[int, int] = (0, 4),
              capacity: int = 2**30, usable: int = 2**29, predicted: PredictedBytes = PREDICTED) -> RankPlan:
    """Rank `rank` of group 0 on node n, its device cpu:`rank`."""
    return RankPlan(replica=0, rank=rank, stage=stage, tp_rank=rank if tp_rank is None else tp_rank, node="n",
                    device=f"cpu:{rank}", device_index=rank, kind="cpu", layers=layers, embeds=stage == 0,
                    has_lm_head=True, capacity_bytes=capacity, usable_bytes=usable, predicted_bytes=predicted)


def measured(total: int, **report: Any) -> RankReport:
    """A loaded rank's report: `total` resident bytes; the seconds and counters as given."""
    times = {"load_seconds": 0.0, "comm_seconds": 0.0, "compute_seconds": 0.0, "idle_seconds": 0.0}
    return RankReport(resident_bytes=ResidentBytes(weights=1, kv_cache=1, rss_anon=1, total=total),
                      **{**times, **report})


def entry(plan: RankPlan, total: int | None = None, state: str = "ready", **report: Any) -> ShardEntry:
    """The entry of a rank that has measured `total` bytes (None: not loaded yet)."""
    return ShardEntry(plan=plan, report=None if total is None else measured(total, **report), state=state)
