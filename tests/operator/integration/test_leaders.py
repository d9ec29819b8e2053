"""Reading a leader's GET /v1/shards."""

from __future__ import annotations

import socket

from shard_contract.plan import PredictedBytes
from shard_contract.wire import ResidentBytes, ShardEntry, ShardsResponse
from shard_operator.leaders import fetch


def test_resident_bytes_by_rank_skip_ranks_that_have_not_measured():
    predicted = PredictedBytes(weights=1, kv_cache=0, activations=0, overhead=0)
    measured = ResidentBytes(weights=1, kv_cache=0, rss_anon=1, total=10)
    report = ShardsResponse(model="m", replica=0, ready=False, ranks=[
        ShardEntry(rank=0, stage=0, tp_rank=0, layers=(0, 1), capacity_bytes=2**30, usable_bytes=2**29,
                   predicted_bytes=predicted, resident_bytes=measured),
        ShardEntry(rank=1, stage=0, tp_rank=1, layers=(0, 1), capacity_bytes=2**30, usable_bytes=2**29, predicted_bytes=predicted)])
    assert report.resident_by_rank() == {0: 10}
    assert ShardsResponse.model_validate_json(report.model_dump_json()).resident_by_rank() == {0: 10}


def test_an_unreachable_leader_is_no_report():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert fetch(f"http://127.0.0.1:{port}", timeout=0.5) is None
