"""The operator's settings: read once from the environment, passed everywhere explicitly.

Every interval is a setting so tests can run the real operator with millisecond timings, and a
production operator polls gently.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from .planning import PlannerOptions

PREFIX = "SHARD_OPERATOR_"


@dataclass(frozen=True)
class Settings:
    # Namespaces to watch; empty: the whole cluster.
    namespaces: tuple[str, ...] = ()
    # Worker image when spec.worker.image is unset: the name `make images` builds and the chart's
    # default (worker.image), at the chart's appVersion.
    worker_image: str = "shard-operator-worker:0.1.0"
    # Seconds between two reconciles of a model when nothing happens (a safety net: events wake
    # the reconcile sooner).
    resync_seconds: float = 30.0
    # Seconds to wait after an event before reconciling, so a burst of pod events is one reconcile.
    debounce_seconds: float = 0.2
    # Seconds between two polls of each leader's GET /v1/shards (measured memory); 0 disables.
    status_poll_seconds: float = 30.0
    # Timeout of one leader poll.
    poll_timeout_seconds: float = 2.0
    # How a leader is reached: a URL template with {pod_ip}, {port}, {pod}, {namespace}.
    leader_url: str = "http://{pod_ip}:{port}"
    # Inventory changes (node added, removed, NotReady, cordoned) take effect only after the
    # inventory has stayed the same this long: flapping nodes cause no churn.
    settle_seconds: float = 30.0
    # A node-driven re-plan replaces running groups only when it shortens the decode step by at
    # least this fraction.
    improvement_threshold: float = 0.10
    # Times a group is recreated after a rank fails before the operator gives up on it.
    restart_budget: int = 3
    # Where the operator finds model files itself (read-only mounts): hostPath volumes under this
    # prefix (e.g. "/host" when the node's filesystem is mounted there; "" reads them in place),
    # PVCs at <pvc_root>/<claimName>. Unset: a profiling Pod reads them.
    host_path_prefix: str | None = None
    pvc_root: str | None = None
    # Seconds one Kubernetes API request may take (the operator's own requests; kopf has its own):
    # a connection the server dropped without a word fails the reconcile, which is retried.
    api_timeout_seconds: float = 30.0
    # Profiling pods that have not finished after this long are deleted and retried.
    profile_timeout_seconds: float = 600.0
    # kopf: standalone (no peering); a single operator replica.
    standalone: bool = True
    # Port of the liveness endpoint (GET /healthz); 0 disables it.
    health_port: int = 8080
    # Port of the operator's own Prometheus metrics (GET /metrics, metrics.py); 0 disables it.
    metrics_port: int = 0
    # Address the liveness and metrics endpoints listen on: every address of the pod by default; the
    # dev cluster's kubelet sets the pod's own, as its pods share one network stack.
    bind_address: str = "0.0.0.0"
    # Python logging level of the operator (DEBUG, INFO, WARNING, ERROR).
    log_level: str = "INFO"
    # Give each model a NetworkPolicy that opens its ranks' ports (rendezvous, then NCCL's and
    # gloo's ephemeral ones) to the ranks of the same model only. The Helm chart turns it on with
    # networkPolicy.enabled, and grants the permission it needs only then.
    network_policies: bool = False
    # What a ShardedModel may ask for (policy.py; docs/operations.md, "Trust model"): worker images
    # (shell-style globs), hostPath directories (path prefixes, whole components) and the names of
    # Secrets `spec.worker.apiKeySecret` may mount (globs). A spec outside them is refused with the
    # NotAllowed condition. Unset: anything (the chart sets narrow defaults).
    allowed_images: tuple[str, ...] = ("*",)
    allowed_host_paths: tuple[str, ...] = ("/",)
    allowed_api_key_secrets: tuple[str, ...] = ("*",)
    # The planner's constants (planner.PlannerOptions), set as JSON whose keys each change a
    # default: the runtime overhead per rank in bytes ({"runtime_overhead": {"gpu": 3221225472}}),
    # the seconds of a collective or hop by transport ({"transport": {"collective_in_pod": {"gpu":
    # 2e-5}}}, see transport.py), the tolerance within which fewer devices win. Parsed here, so a
    # bad value stops the operator at start, naming the key.
    planner_options: PlannerOptions = field(default_factory=PlannerOptions)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """SHARD_OPERATOR_<FIELD> for every field, e.g. SHARD_OPERATOR_NAMESPACES=a,b."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = environ.get(PREFIX + f.name.upper())
            if raw is None:
                continue
            default = f.default_factory() if callable(f.default_factory) else f.default
            values[f.name] = _convert(f.name, raw, default)
        level = str(values.get("log_level", cls.log_level)).upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"{PREFIX}LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING or ERROR")
        values["log_level"] = level
        return cls(**values)  # type: ignore[arg-type]  # each value converted to its field's type


def _convert(name: str, raw: str, default: object) -> object:
    if isinstance(default, PlannerOptions):
        try:
            return PlannerOptions.from_json(raw)
        except ValueError as err:
            raise ValueError(f"{PREFIX}{name.upper()}: {err}") from None
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if isinstance(default, tuple):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name.upper()}={raw!r}: expected a {type(default).__name__}") from None
    return raw
