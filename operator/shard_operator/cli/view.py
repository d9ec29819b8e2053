"""`shardctl status`: a running group, rank by rank.

Two sources, one table: a local run's leader answers `GET /v1/shards` (`ShardsResponse`: every
rank's place in the plan, what it measured, where its time went), and a ShardedModel on a cluster
has its status (`status.plan`, `status.shards[]`, read through the Kubernetes client with the
kubeconfig kubectl uses) plus each group leader's `/v1/shards` through the API server's pod proxy
(the operator keeps fast-changing time shares out of the status). The reading is a thin edge;
`RankRow`, `GroupView`, `with_leaders` and `render` are pure.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, cast

from pydantic import ValidationError

from shard_contract.plan import describe_layers
from shard_contract.units import table_unit
from shard_contract.wire import ShardEntry, ShardsResponse

from ..api import GROUP, PLURAL, VERSION, WorkerSpec
from ..objects.names import group_of_pod
from ..reconcile.status import SEE_DEGRADED

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen: a --watch refresh on a terminal


class StatusError(RuntimeError):
    """The group could not be read; the message says where it was looked for."""


@dataclass(frozen=True)
class RankRow:
    group: int
    rank: int
    stage: int
    tp_rank: int
    where: str  # node/device, or the pod
    layers: tuple[int, int]
    state: str
    predicted: int  # bytes the plan predicts in all
    measured: int | None  # bytes held, measured after load
    capacity: int | None
    shares: tuple[float, float, float] | None = None  # compute, communication, idle
    load: tuple[int, int] | None = None  # bytes loaded, bytes to load (while loading)


@dataclass(frozen=True)
class GroupView:
    title: str
    rows: list[RankRow]
    predicted_step: float | None  # seconds per decode step, the plan's estimate
    measured_step: float | None  # seconds per decode step of the latest batch
    notes: list[str] = field(default_factory=list)
    raw: Any = None  # what was read, for --json
    kv_tokens: int | None = None  # the KV cache's capacity in tokens (per group)
    kv_used: int | None = None  # of which the running requests hold (a group's leader says)


# ---------------------------------------------------------------- a local run
def shares(entry: ShardEntry) -> tuple[float, float, float] | None:
    """Compute, communication and idle seconds as shares of their sum, once there are any."""
    report = entry.report
    if report is None:
        return None
    parts = [report.compute_seconds, report.comm_seconds, report.idle_seconds]
    total = sum(parts)
    return tuple(p / total for p in parts) if total > 0 else None  # type: ignore[return-value]


def measured_step(response: ShardsResponse) -> float | None:
    """Seconds per decode step of the leader's latest batch (None before one ran)."""
    leader = next((r for r in response.ranks if r.plan.rank == 0), None)
    last = leader.report.last_generate if leader is not None and leader.report is not None else {}
    steps = last.get("decode_steps") or 0
    return last["decode_seconds"] / steps if steps and "decode_seconds" in last else None


def view_of_shards(response: ShardsResponse, source: str) -> GroupView:
    rows = [RankRow(group=response.replica, rank=r.plan.rank, stage=r.plan.stage, tp_rank=r.plan.tp_rank,
                    where=f"{r.plan.node}/{r.plan.device}", layers=(r.plan.layers[0], r.plan.layers[1]),
                    state=r.state if r.alive else "dead",
                    predicted=r.plan.predicted_bytes.total,
                    measured=r.report.resident_bytes.total if r.report is not None else None,
                    capacity=r.plan.capacity_bytes, shares=shares(r),
                    load=(r.load_progress.loaded, r.load_progress.total) if r.load_progress else None)
            for r in response.ranks]
    notes = [] if response.ready else [f"not ready: {response.reason}"]
    return GroupView(title=f"{response.model}, group {response.replica} ({source})", rows=rows,
                     predicted_step=response.predicted_step_seconds or None, measured_step=measured_step(response),
                     notes=notes, raw=response.model_dump(mode="json"), kv_tokens=response.kv_cache_tokens or None,
                     kv_used=response.kv_cache_used_tokens)


def local_status(base_url: str, timeout: float = 5.0) -> GroupView:
    """The group a `shardctl run` serves at `base_url`, from its leader's `/v1/shards`."""
    try:
        with urllib.request.urlopen(base_url + "/v1/shards", timeout=timeout) as response:
            return view_of_shards(ShardsResponse.model_validate_json(response.read()), base_url)
    except (OSError, urllib.error.URLError) as err:
        reason = getattr(err, "reason", err)
        raise StatusError(f"no group answers at {base_url}/v1/shards ({getattr(reason, 'strerror', None) or reason});"
                          " is `shardctl run` serving on that port?") from None
    except (ValueError, ValidationError):
        raise StatusError(f"{base_url}/v1/shards: not a shard_worker's answer") from None


# ---------------------------------------------------------------- a cluster
def view_of_model(obj: dict[str, Any]) -> GroupView:
    """A ShardedModel's status as a table: every group's ranks (status.shards[])."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    plan = status.get("plan") or {}
    rows = [RankRow(group=s.get("group", 0), rank=s.get("rank", 0), stage=s.get("stage", 0),
                    tp_rank=s.get("tpRank", 0), where=s.get("pod") or f"{s.get('node', '')}/{s.get('device', '')}",
                    layers=tuple(s.get("layers") or (0, 0)), state=s.get("state", ""),
                    predicted=s.get("predictedBytes", 0), measured=s.get("residentBytes"), capacity=None)
            for s in status.get("shards") or []]
    ready = f"{status.get('readyReplicas', 0)}/{(obj.get('spec') or {}).get('replicas', 0)} groups ready"
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    notes, said = [], {SEE_DEGRADED}  # a message is shown once, however many conditions carry it
    for c in sorted(conditions.values(), key=lambda c: c["type"] != "Degraded"):
        if c.get("message") and (c["type"] == "Degraded") == (c.get("status") == "True") and c["message"] not in said:
            said.add(c["message"])
            notes.append(f"{c['type']}: {c.get('reason', '')}: {c['message']}")
    return GroupView(title=f"ShardedModel {meta.get('namespace', '')}/{meta.get('name', '')}: "
                           f"{status.get('phase', 'Pending')}, {ready}, plan {plan.get('hash', '-')}",
                     rows=rows, predicted_step=plan.get("predictedStepSeconds"), measured_step=None, notes=notes,
                     raw=obj, kv_tokens=plan.get("kvCacheTokens") or None)


def leader_pods(obj: dict[str, Any]) -> list[tuple[int, str]]:
    """(group, pod) of each group's leader (rank 0) that has a pod, from status.shards[]."""
    return [(s.get("group", 0), s["pod"]) for s in (obj.get("status") or {}).get("shards") or []
            if s.get("rank") == 0 and s.get("pod")]


def with_leaders(view: GroupView, reports: dict[str, ShardsResponse], unread: list[str]) -> GroupView:
    """A ShardedModel's table with what its leaders report (`reports`, by the leader's pod): every
    rank of a leader's group (its pods share the group's name) gets its time shares, its device's
    capacity and the bytes measured now; the step line gets the slowest group's latest batch (the
    plan's predicted step is the slowest group's too). `unread`: why leaders were not read, one note.
    For --json, everything read: the ShardedModel, each leader's /v1/shards by its pod, the unread."""
    by_group = {group_of_pod(pod): report for pod, report in reports.items()}
    rows = []
    for row in view.rows:
        report = by_group.get(group_of_pod(row.where))
        entry = next((r for r in report.ranks if r.plan.rank == row.rank), None) if report else None
        rows.append(row if entry is None else replace(
            row, shares=shares(entry), capacity=entry.plan.capacity_bytes,
            measured=entry.report.resident_bytes.total if entry.report is not None else row.measured))
    steps = [step for step in map(measured_step, reports.values()) if step is not None]
    notes = [f"no time shares or measured step from {'; '.join(unread)}"] if unread else []
    raw = {"shardedModel": view.raw, "unread": unread,
           "leaders": {pod: report.model_dump(mode="json") for pod, report in reports.items()}}
    used = [r.kv_cache_used_tokens for r in reports.values()]
    return replace(view, rows=rows, measured_step=max(steps, default=None), notes=view.notes + notes, raw=raw,
                   kv_used=max(used) if used else None)


def _message(err: Any) -> str:
    """An ApiException's Status message (the API server's words), else its HTTP reason."""
    try:
        return json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(err.reason)


def read_leaders(core: Any, namespace: str, obj: dict[str, Any]) -> tuple[dict[str, ShardsResponse], list[str]]:
    """Each group leader's `/v1/shards` through the API server's pod proxy, as `kubectl get --raw
    /api/v1/namespaces/NS/pods/POD:PORT/proxy/v1/shards` reads it (the leader serves it on
    spec.worker.port, where the operator polls it), and why any could not be read."""
    import kubernetes
    import urllib3

    port = ((obj.get("spec") or {}).get("worker") or {}).get("port") or WorkerSpec().port
    reports: dict[str, ShardsResponse] = {}
    unread: list[str] = []
    for group, pod in leader_pods(obj):
        try:
            answer = core.connect_get_namespaced_pod_proxy_with_path(
                f"{pod}:{port}", namespace, "v1/shards", _preload_content=False, _request_timeout=5)
            reports[pod] = ShardsResponse.model_validate_json(answer.data)
        except kubernetes.client.ApiException as err:
            if err.status in (401, 403):  # RBAC: the same answer for every pod
                return reports, [f"the leaders: the cluster refuses the pod proxy (it needs get on pods/proxy "
                                 f"in {namespace}): {_message(err)}"]
            unread.append(f"group {group} ({pod}): HTTP {err.status}: {_message(err)}")
        except (OSError, urllib3.exceptions.HTTPError) as err:
            unread.append(f"group {group} ({pod}): {err}")
        except (ValueError, ValidationError):
            unread.append(f"group {group} ({pod}): not a shard_worker's answer")
    return reports, unread


def cluster_status(name: str, namespace: str | None) -> GroupView:
    """The ShardedModel `namespace/name` on the cluster of the kubeconfig (as kubectl finds it;
    no namespace: the current context's, else default)."""
    import kubernetes  # the operator extra: only this form of the command needs it

    try:
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(client_configuration=config)
        if namespace is None:
            _, current = kubernetes.config.list_kube_config_contexts()
            namespace = (current.get("context") or {}).get("namespace") or "default"
        with kubernetes.client.ApiClient(config) as client:
            obj = cast(dict[str, Any], kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=10))
            reports, unread = read_leaders(kubernetes.client.CoreV1Api(client), namespace, obj)
    except kubernetes.config.ConfigException as err:
        raise StatusError(f"no cluster to read: {err}") from None
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            raise StatusError(f"ShardedModel {namespace}/{name} not found") from None
        raise StatusError(f"reading ShardedModel {namespace}/{name}: HTTP {err.status} {err.reason}") from None
    except OSError as err:
        raise StatusError(f"the cluster does not answer: {err}") from None
    return with_leaders(view_of_model(obj), reports, unread)


# ---------------------------------------------------------------- the table
def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total) if total else width
    return "█" * filled + "░" * (width - filled)


def render(view: GroupView) -> str:
    largest = max([r.capacity or 0 for r in view.rows] + [r.predicted for r in view.rows], default=0)
    unit, size = table_unit(largest)
    header = ("group", "rank", "stage", "tp", "where", "layers", "state", f"predicted {unit}",
              f"measured {unit}", f"capacity {unit}", "compute", "comm", "idle")
    rows: list[tuple[str, ...]] = [header]
    for r in view.rows:
        share = [f"{s:.0%}" for s in r.shares] if r.shares else ["-"] * 3
        state = r.state if r.load is None or r.state != "loading" else \
            f"loading {_bar(*r.load, width=10)} {r.load[0] / max(r.load[1], 1):.0%}"
        rows.append((str(r.group), str(r.rank), str(r.stage), str(r.tp_rank), r.where, describe_layers(r.layers),
                     state, f"{r.predicted / size:.2f}", "-" if r.measured is None else f"{r.measured / size:.2f}",
                     "-" if r.capacity is None else f"{r.capacity / size:.2f}", *share))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {0, 1, 2, 3, 7, 8, 9, 10, 11, 12}
    lines = [view.title]
    lines += ["  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in
                        enumerate(zip(row, widths, strict=False))).rstrip() for row in rows]
    predicted = f"{view.predicted_step * 1e3:.2f} ms" if view.predicted_step else "-"
    measured = f"{view.measured_step * 1e3:.2f} ms" if view.measured_step else "- (no batch yet)"
    lines.append(f"decode step: predicted {predicted} (the plan's critical path), measured {measured} "
                 "(the latest batch)")
    if view.kv_tokens:
        used = f", {view.kv_used} in use ({view.kv_used / view.kv_tokens:.0%})" if view.kv_used is not None else ""
        lines.append(f"KV cache: {view.kv_tokens} tokens per group{used}")  # the busiest group's use
    lines += view.notes
    return "\n".join(lines)


def watch_status(read: Callable[[], GroupView], *, watch: float | None, as_json: bool, tty: bool,
                 out: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> int:
    """Print the group once, or every `watch` seconds (on a terminal in place) until Ctrl-C. A
    read that fails ends a single look; while watching, it is shown and the watch goes on (a
    restarting group answers again)."""
    while True:
        try:
            view = read()
            text = json.dumps(view.raw, indent=2) if as_json else render(view)
        except StatusError as err:
            if watch is None:
                raise
            text = f"shardctl: {err}"
        if watch is None:
            out(text)
            return 0
        stamp = datetime.now().strftime("%H:%M:%S")
        out(f"{CLEAR}{stamp}  every {watch:g} s, Ctrl-C stops\n{text}" if tty else f"--- {stamp}\n{text}")
        sleep(watch)
