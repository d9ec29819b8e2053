"""Reading a leader's GET /v1/shards."""

from __future__ import annotations

import socket

from shard_operator.leaders import fetch, resident_by_rank


def test_resident_bytes_by_rank_skip_ranks_that_have_not_measured():
    report = {"ranks": [{"rank": 0, "resident_bytes": {"total": 10}}, {"rank": 1, "resident_bytes": None},
                        {"rank": 2}, {"rank": "3", "resident_bytes": {"total": "30"}}]}
    assert resident_by_rank(report) == {0: 10, 3: 30}
    assert resident_by_rank({}) == {}


def test_an_unreachable_leader_is_no_report():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert fetch(f"http://127.0.0.1:{port}", timeout=0.5) is None
