"""Reading a leader's GET /v1/shards."""

from __future__ import annotations

import socket

from shard_contract.plan import PredictedBytes
from shard_contract.wire import Measured, ResidentBytes, ShardEntry, ShardsResponse
from shard_operator.leaders import fetch


def test_measured_by_rank_skips_ranks_that_have_not_measured():
    predicted = PredictedBytes(weights=1, kv_cache=0, activations=0, overhead=0)
    measured = ResidentBytes(weights=1, kv_cache=0, rss_anon=1, total=10)
    report = ShardsResponse(model="m", replica=0, ready=False, ranks=[
        ShardEntry(rank=0, stage=0, tp_rank=0, layers=(0, 1), capacity_bytes=2**30, usable_bytes=2**29,
                   predicted_bytes=predicted, resident_bytes=measured, streamed_bytes=5, stall_seconds=0.5),
        ShardEntry(rank=1, stage=0, tp_rank=1, layers=(0, 1), capacity_bytes=2**30, usable_bytes=2**29,
                   predicted_bytes=predicted)])
    expected = {0: Measured(resident=10, streamed_bytes=5, stall_seconds=0.5)}
    assert report.measured_by_rank() == expected
    assert ShardsResponse.model_validate_json(report.model_dump_json()).measured_by_rank() == expected


def test_an_unreachable_leader_is_no_report():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert fetch(f"http://127.0.0.1:{port}", timeout=0.5) is None
