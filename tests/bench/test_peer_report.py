"""bench/serve_peer.py's pure parts (bench/peer_report.py) on made-up requests: every request is
counted (a failed one with its reason, never dropped), the long-prompt gap is measured over the
long request's life, and the goals are matched by client count and scenario, so a side that
failed or was not run shows why instead of breaking the report (the run of 2026-12-06 16:12 lost
its goals table to a `zip(strict=True)` of unequal rows)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_report import (  # bench/ is not a package
    OURS,
    PEER,
    goals,
    long_summary,
    overflow_summary,
    prefix_summary,
    table,
    throughput_row,
)


def req(times: list[float], start: float = 0.0, tokens: int | None = None, error: str | None = None) -> dict:
    """A request as peer_client.stream returns it: one token per chunk at `times`."""
    events = [(t, 1) for t in times]
    return {"start": start, "end": times[-1] if times else start + 1, "events": events, "error": error,
            "tokens": len(times) if tokens is None else tokens, "ttft": times[0] - start if times else None}


def test_failed_requests_are_counted_with_their_reasons_and_not_in_the_rates():
    ok = [req([1.0, 1.5, 2.0], start=0.0), req([2.0, 3.0], start=1.0)]
    bad = [req([], start=0.5, error="RemoteProtocolError: gone"), req([], start=3.0, error="RemoteProtocolError: gone"),
           req([1.2], start=1.0, error="HTTP 500: x")]
    row = throughput_row(4, ok + bad, load=1.5)
    assert (row["requests"], row["failed"]) == (5, 3)
    assert row["errors"] == ["2x RemoteProtocolError: gone", "1x HTTP 500: x"]
    # completed tokens (5) over the whole phase, failed requests' span included (0.0 to 3.0 + 1)
    assert row["tokens_per_s"] == pytest.approx(5 / 4.0)
    assert row["ttft_p50"] == pytest.approx(1.0) and row["itl_p99"] == pytest.approx(1.0)
    everything_failed = throughput_row(1, bad, load=1.0)
    assert "tokens_per_s" not in everything_failed and everything_failed["not_measured"] == "all 3 requests failed"


def test_the_long_prompt_gap_is_the_short_streams_longest_while_it_is_in_flight():
    # alone: the startup gap (0.1 -> 0.9, before every stream had its first token) does not count
    alone = long_summary([req([0.1, 0.9, 1.0, 1.1]), req([0.8, 0.9, 1.0, 1.1])], None)
    assert alone["worst_gap"] == pytest.approx(0.1) and alone["gaps"] == 5
    # joined: the long request lives from 1.0 to 3.0; the 1.2 s stall inside it counts, the later
    # 1.9 s gap (after it ended) does not; both streams still ran at its first token (2.5)
    shorts = [req([0.5, 1.1, 2.3, 2.4, 2.6, 3.1, 5.0]), req([0.6, 1.2, 1.3, 2.2, 2.7])]
    joined = long_summary(shorts, req([2.5, 3.0], start=1.0))
    assert joined["worst_gap"] == pytest.approx(1.2) and joined["long_ttft"] == pytest.approx(1.5)
    assert joined["through_join"] == 2
    early = long_summary([req([0.5, 1.1, 1.2]), req([0.6, 1.2, 2.7])], req([2.5, 3.0], start=1.0))
    assert early["through_join"] == 1  # one stream had ended before the long one's first token
    failed = long_summary(shorts, req([], start=1.0, error="HTTP 400: too long"))
    assert failed["not_measured"] == "the long request failed: HTTP 400: too long"
    one_failed = long_summary([req([], error="ReadError: x"), shorts[0]], None)
    assert one_failed["not_measured"] == "1 of 2 short streams failed"


def test_overflow_and_prefix_summaries_count_every_request():
    results = [req([1.0, 2.0, 3.0]), req([1.0, 2.0]), req([], error="error in the stream: full")]
    assert overflow_summary(results, 3) == {"requests": 3, "answered": 1, "short": 1, "failed": 1,
                                            "errors": ["1x error in the stream: full"]}
    prefix = prefix_summary([req([1.0], start=0.0), req([3.0], start=0.0), req([], error="x")])
    assert prefix["mean_ttft"] == pytest.approx(2.0) and prefix["failed"] == 1
    assert prefix_summary([req([], error="x")])["not_measured"] == "no request completed"


def run(throughput: list[dict], scenarios: dict | None = None, **extra) -> dict:
    return {"throughput": throughput, "scenarios": scenarios or {}, **extra}


def measured(clients: int, tokens_per_s: float, failed: int = 0) -> dict:
    return {"clients": clients, "requests": 10, "failed": failed, "errors": ["1x ReadError: x"] if failed else [],
            "tokens_per_s": tokens_per_s, "ttft_p50": 0.1, "ttft_p99": 0.2, "itl_p50": 0.01, "itl_p99": 0.02,
            "load": 1.0}


def test_goals_match_client_counts_and_show_a_missing_side_with_its_reason():
    ours = run([measured(1, 80.0), measured(4, 200.0), measured(16, 220.0), measured(64, 250.0, failed=1)])
    peer = run([{"clients": 1, "not_measured": "ran past the budget"}, measured(16, 110.0), measured(64, 500.0)])
    rows = {g["goal"]: g for g in goals({OURS: ours, PEER: peer})}
    one, four = rows["tokens/s ours / llama-server, 1 clients"], rows["tokens/s ours / llama-server, 4 clients"]
    assert one["value"] is None and one["met"] is None and one["note"] == "llama-server: failed (ran past the budget)"
    assert four["value"] is None and four["note"] == "llama-server: not run"
    assert rows["tokens/s ours / llama-server, 16 clients"]["value"] == pytest.approx(2.0)
    sixty_four = rows["tokens/s ours / llama-server, 64 clients"]
    assert sixty_four["met"] is False and sixty_four["note"] == "shard-operator: 1 of 10 requests failed"
    text = table({OURS: ours, PEER: peer})  # prints every row, whatever is missing
    assert "| llama-server | 1 | - | - | failed (ran past the budget) |" in text
    assert "| tokens/s ours / llama-server, 4 clients | not measured | >= 1 | - | llama-server: not run |" in text


def test_scenario_goals_say_what_was_not_measured_and_when_the_cache_never_overflowed():
    alone = {"shorts": 8, "failed": 0, "errors": [], "worst_gap": 0.02, "gaps": 700}
    joined = {"shorts": 8, "failed": 0, "errors": [], "worst_gap": 0.05, "gaps": 300, "long_ttft": 4.0,
              "through_join": 5}
    over = {"requests": 256, "answered": 256, "short": 0, "failed": 0, "errors": [], "kv_tokens": 2560,
            "demand_tokens": 5120, "preemptions": 0.0}
    scenarios = {"long_alone": alone, "long_joined": joined, "prefix_cached": {"not_measured": "ran past the budget"},
                 "prefix_uncached": {"requests": 32, "failed": 0, "errors": [], "mean_ttft": 7.0}, "overflow": over}
    ours = run([], scenarios, kv={"held_of_free": 0.9})
    rows = {g["goal"]: g for g in goals({OURS: ours})}
    gap = rows["shard-operator: short streams' longest gap, long prompt joining / alone"]
    assert gap["value"] == pytest.approx(2.5) and gap["met"] is False
    assert gap["note"] == "only 5 of 8 short streams ran until the long prompt's first token"
    prefix = rows["shard-operator: 1k shared prefix TTFT, uncached / cached"]
    assert prefix["value"] is None and prefix["note"] == "cached: failed (ran past the budget)"
    overflow = rows["shard-operator: more requests than the KV cache holds, answered / sent"]
    assert overflow["met"] is True
    assert "0 preemptions (the cache never overflowed: not the scenario)" in overflow["note"]
    assert rows["shard-operator: KV cache held / free memory of its plan"]["met"] is True
    assert not any("tokens/s" in g for g in rows)  # one server: no ratio of servers


def test_a_miss_that_two_decimals_would_round_onto_its_target_shows_more():
    kv = {"free_bytes": 14_797_052_153, "held_kv_bytes": 13_317_177_344, "block_bytes": 262_144,
          "held_of_free": 13_317_177_344 / 14_797_052_153}
    (row,) = [g for g in goals({OURS: run([], kv=kv)}) if g["goal"].endswith("free memory of its plan")]
    assert row["met"] is False and row["note"] == "short by less than one KV block (the plan takes whole blocks)"
    assert "| 0.899989 | >= 0.9 | NO |" in table({OURS: run([], kv=kv)})


def test_a_server_that_never_started_and_an_old_file_still_give_a_report():
    text = table({OURS: {"not_measured": "RuntimeError: not ready in 600 s"}, PEER: run([measured(1, 5.0)])})
    assert "| shard-operator | - | - | - | failed (RuntimeError: not ready in 600 s) |" in text
    assert ("| tokens/s ours / llama-server, 1 clients | not measured | >= 1 | - | shard-operator: failed "
            "(RuntimeError: not ready in 600 s) |") in text
    assert "| shard-operator: 1k shared prefix TTFT, uncached / cached | not measured | >= 3 | - | cached: fail" in text
    json.dumps(goals({OURS: run([measured(1, math.nan)]), PEER: run([measured(1, 1.0)])}))  # NaN: not measured
