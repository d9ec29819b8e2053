"""Reading a leader's GET /v1/shards."""

from __future__ import annotations

import socket

from shard_contract.wire import Measured, ShardsResponse
from shard_operator.reconcile.leaders import fetch
from tests.support.shards import entry, rank_plan


def test_measured_by_rank_skips_ranks_that_have_not_measured():
    report = ShardsResponse(model="m", replica=0, ready=False, ranks=[
        entry(rank_plan(0, layers=(0, 1)), 10, streamed_bytes=5, stall_seconds=0.5),
        entry(rank_plan(1, layers=(0, 1)), None, state="loading")])
    expected = {0: Measured(resident=10, streamed_bytes=5, stall_seconds=0.5)}
    assert report.measured_by_rank() == expected
    assert ShardsResponse.model_validate_json(report.model_dump_json()).measured_by_rank() == expected


def test_an_unreachable_leader_is_no_report():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert fetch(f"http://127.0.0.1:{port}", timeout=0.5) is None
