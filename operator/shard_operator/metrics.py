"""The operator's own Prometheus metrics: what it does (reconciles, failures, API requests, time
per reconcile) and what it sees (ShardedModels by phase, wanted and serving groups per model, restarts
per group, and a Degraded condition's reason, which the chart's alerts read).

Everything is read from the Controller when Prometheus scrapes: the reconcile keeps its plain
counters and its last status per model, and nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, get_args
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .api import Phase

if TYPE_CHECKING:
    from .reconcile.handlers import Controller

# No `<name>_created` series beside the reconcile histogram: a timestamp no query reads
# (prometheus_client reads this process-wide setting at every scrape).
disable_created_metrics()


class ControllerCollector(Collector):
    def __init__(self, controller: Controller):
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        c = self.controller
        yield CounterMetricFamily("shard_operator_reconciles", "Reconciles run, failed ones included.",
                                  value=c.reconciles)
        yield CounterMetricFamily("shard_operator_reconcile_failures",
                                  "Reconciles that raised; the model's loop retries within 5 s.", value=c.failures)
        requests = CounterMetricFamily("shard_operator_api_requests",
                                       "Requests the reconciles made to the Kubernetes API (kopf's watches aside).",
                                       labels=["verb"])
        for verb, n in sorted(c.kube.calls.items()):
            requests.add_metric([verb], n)
        yield requests
        yield from c.reconcile_seconds.collect()

        statuses = c.statuses()
        phases = GaugeMetricFamily("shard_operator_models", "ShardedModels by phase.", labels=["phase"])
        for phase in get_args(Phase):
            phases.add_metric([phase], sum(1 for s in statuses.values() if s.get("phase") == phase))
        yield phases
        wanted = GaugeMetricFamily("shard_operator_replicas", "Groups (replicas) a ShardedModel asks for.",
                                   labels=["namespace", "model"])
        serving = GaugeMetricFamily("shard_operator_ready_replicas", "Groups of a ShardedModel that are serving.",
                                    labels=["namespace", "model"])
        restarts = GaugeMetricFamily("shard_operator_group_restarts",
                                     "Times the operator recreated a group after a rank failed.",
                                     labels=["namespace", "model", "group"])
        degraded = GaugeMetricFamily("shard_operator_degraded",
                                     "1 while a ShardedModel's Degraded condition is True, else 0; "
                                     "with the condition's reason.",
                                     labels=["namespace", "model", "reason"])
        for (namespace, model), status in sorted(statuses.items()):
            wanted.add_metric([namespace, model], status.get("replicas") or 0)
            serving.add_metric([namespace, model], status.get("readyReplicas") or 0)
            by_replica: dict[int, int] = {}  # an old and a new revision may both be listed
            for group in status.get("groups") or []:
                by_replica[group["replica"]] = max(by_replica.get(group["replica"], 0), group.get("restarts", 0))
            for replica, n in sorted(by_replica.items()):
                restarts.add_metric([namespace, model, str(replica)], n)
            for condition in status.get("conditions") or []:
                if condition["type"] == "Degraded":
                    degraded.add_metric([namespace, model, condition.get("reason", "")],
                                        1 if condition["status"] == "True" else 0)
        yield from (wanted, serving, restarts, degraded)


def serve(controller: Controller, port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Expose the controller's metrics on http://<addr>:<port>/metrics (a daemon thread); returns
    the server, to `shutdown()`."""
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller))
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server
