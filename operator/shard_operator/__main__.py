"""`python -m shard_operator` (or `shard-operator`): run the ShardedModel operator.

Connects like every Kubernetes tool (in-cluster service account, else KUBECONFIG or
~/.kube/config) and reads its settings from SHARD_OPERATOR_* environment variables (settings.py).
"""

from __future__ import annotations

import logging
import sys

import kopf

from . import metrics
from .kube import Kube, load_client
from .reconcile.handlers import Controller, build_registry, kopf_settings
from .settings import Settings


def main() -> int:
    try:
        settings = Settings.from_env()
    except ValueError as err:
        print(f"shard-operator: {err}", file=sys.stderr)
        return 1
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    controller = Controller(settings, Kube(load_client(), settings.api_timeout_seconds))
    if settings.metrics_port:
        metrics.serve(controller, settings.metrics_port, settings.bind_address)
    kopf.run(registry=build_registry(controller), settings=kopf_settings(settings),
             standalone=settings.standalone, clusterwide=not settings.namespaces,
             namespaces=list(settings.namespaces),
             liveness_endpoint=(f"http://{settings.bind_address}:{settings.health_port}/healthz"
                                if settings.health_port else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
