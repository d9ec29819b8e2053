"""One rank's Prometheus metrics (the families of `metrics.py`), filled from what it measures.

The rank's own counters (`Accounting`) are the source of truth; at each scrape the counters are
advanced by what they grew since the previous one, and the gauges set. Request figures are
recorded by the leader as requests finish.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from prometheus_client import generate_latest

from shard_contract.plan import RankPlan

from .accounting import COMM_OPS, Accounting
from .metrics import WorkerMetrics


class Measured(Protocol):
    """What a scrape reads of a loaded rank (`rank.runtime.Worker`), named here so that telemetry
    stays below the packages that assemble a rank."""

    acct: Accounting
    load_seconds: float

    def report(self) -> dict[str, Any]: ...

OUTCOMES = ("completed", "rejected", "failed", "cancelled")  # cancelled: the client went away
# Families only the leader records (it alone sees requests); the other ranks expose them empty.
LEADER_FAMILIES = ("shard_tokens_generated", "shard_generation_tokens",
                   "shard_requests", "shard_request_latency_seconds",
                   "shard_time_to_first_token_seconds", "shard_time_per_output_token_seconds",
                   "shard_requests_running", "shard_requests_waiting", "shard_batch_size",
                   "shard_kv_cache_used_tokens", "shard_kv_cache_capacity_tokens", "shard_kv_cache_capacity_rows",
                   "shard_prompt_tokens", "shard_request_queue_time_seconds", "shard_inter_token_latency_seconds",
                   "shard_kv_cache_usage_ratio", "shard_preemptions", "shard_prefix_cache_queries",
                   "shard_prefix_cache_hits", "shard_kv_cache_blocks")
LABELLED = {"shard_requests": ("outcome", OUTCOMES), "shard_kv_cache_blocks": ("state", ("used", "free"))}
PREDICTED_KINDS = ("weights", "kv_cache", "activations", "overhead", "staging", "total")
RESIDENT_KINDS = ("weights", "kv_cache", "staging", "rss_anon", "cuda_allocated", "total", "peak", "activations")


class RankMetrics:
    def __init__(self, model: str, group: int, rank_plan: RankPlan, leader: bool, max_batch: int, max_len: int):
        self.m = WorkerMetrics.create(model=model, group=group, rank=rank_plan.rank, stage=rank_plan.stage,
                                      tp_rank=rank_plan.tp_rank)
        self.leader = leader
        self._seen: dict[tuple[str, str], float] = {}  # counter child -> value at the last scrape
        self._lock = threading.Lock()
        predicted = rank_plan.predicted_bytes
        for kind in PREDICTED_KINDS:
            self.m.get("shard_predicted_bytes", kind=kind).set(getattr(predicted, kind))
        self.m.get("shard_group_ready").set(0)
        self.m.get("shard_heartbeat_rejected")  # exposed at zero
        if leader:  # every family exposed from the start, zero until something happens
            for name in LEADER_FAMILIES:
                label, values = LABELLED.get(name, ("", ("",)))
                for value in values:
                    self.m.get(name, **({label: value} if label else {}))
            self.m.get("shard_kv_cache_capacity_rows").set(max_batch)
            # the paged pool's positions (the plan's tokens), whatever rows there are
            self.m.get("shard_kv_cache_capacity_tokens").set(rank_plan.kv_cache_tokens or max_batch * max_len)

    # ------------------------------------------------------------ the leader's requests
    def waiting(self, n: int) -> None:
        self.m.get("shard_requests_waiting").set(n)

    def running(self, n: int, kv_tokens: int) -> None:
        self.m.get("shard_requests_running").set(n)
        self.m.get("shard_kv_cache_used_tokens").set(kv_tokens)

    def started(self, queued_seconds: float, prompt_tokens: int) -> None:
        """A request left the queue and started (its prompt is computed from now on)."""
        self.m.get("shard_request_queue_time_seconds").observe(queued_seconds)
        self.m.get("shard_prompt_tokens").inc(prompt_tokens)

    def token_gap(self, seconds: float) -> None:
        """A running request took its next token(s) `seconds` after its previous ones."""
        self.m.get("shard_inter_token_latency_seconds").observe(seconds)

    def kv_blocks(self, used: int, free: int) -> None:
        self.m.get("shard_kv_cache_blocks", state="used").set(used)
        self.m.get("shard_kv_cache_blocks", state="free").set(free)
        self.m.get("shard_kv_cache_usage_ratio").set(used / max(1, used + free))

    def scheduled(self, preemptions: int, prefix_queries: int, prefix_hits: int) -> None:
        """What one scheduling step did: requests preempted, prompt blocks looked up and found."""
        self.m.get("shard_preemptions").inc(preemptions)
        self.m.get("shard_prefix_cache_queries").inc(prefix_queries)
        self.m.get("shard_prefix_cache_hits").inc(prefix_hits)

    def batch(self, size: int) -> None:
        self.m.get("shard_batch_size").observe(size)

    def tokens(self, generated: int) -> None:
        """A step generated `generated` tokens."""
        self.m.get("shard_generation_tokens").inc(generated)

    def outcome(self, outcome: str) -> None:
        self.m.get("shard_requests", outcome=outcome).inc()

    def finished(self, latency: float, ttft: float, tokens: int) -> None:
        self.m.get("shard_request_latency_seconds").observe(latency)
        self.m.get("shard_time_to_first_token_seconds").observe(ttft)
        if tokens > 1:  # the time of the decode steps that gave the others
            self.m.get("shard_time_per_output_token_seconds").observe((latency - ttft) / (tokens - 1))
        self.m.get("shard_tokens_generated").inc(tokens)
        self.outcome("completed")

    # ------------------------------------------------------------ every rank
    def heartbeat_rejected(self) -> None:
        self.m.get("shard_heartbeat_rejected").inc()

    # ------------------------------------------------------------ scrape
    def _advance(self, name: str, value: float, **labels: str) -> None:
        key = (name, ",".join(labels.values()))
        grown = value - self._seen.get(key, 0.0)
        if grown > 0:
            self.m.get(name, **labels).inc(grown)
            self._seen[key] = value
        else:
            self.m.get(name, **labels)  # exposed at zero

    def exposition(self, worker: Measured | None, ready: bool) -> bytes:
        """The text format of every family, brought up to date with `worker`'s measurements."""
        with self._lock:
            self.m.get("shard_group_ready").set(1 if ready else 0)
            if worker is not None:
                resident = worker.report()["resident_bytes"]
                for kind in RESIDENT_KINDS:
                    self.m.get("shard_resident_bytes", kind=kind).set(resident[kind])
                self.m.get("shard_load_seconds").set(worker.load_seconds)
                c = worker.acct.counters
                for op in COMM_OPS:
                    self._advance("shard_comm_bytes", c.comm_bytes[op], op=op)
                    self._advance("shard_comm_seconds", c.comm_seconds[op], op=op)
                self._advance("shard_compute_seconds", c.compute_seconds)
                self._advance("shard_idle_seconds", c.idle_seconds)
                self._advance("shard_streamed_bytes", c.streamed_bytes)
                self._advance("shard_stream_seconds", c.stream_seconds)
                self._advance("shard_prefetch_stall_seconds", c.stall_seconds)
                self._advance("shard_prefetch_device_stall_seconds", c.device_stall_seconds)
            return generate_latest(self.m.registry)
