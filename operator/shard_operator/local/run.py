"""`shardctl run`: one group of a ShardedModel served on this machine, each rank a local process.

The ranks are `python -m shard_worker` started by `LocalGroup`, configured exactly as pods are.
This module waits until rank 0's `/ready` says every rank has loaded and passed its memory
check, prints where it serves and what each rank measured, and then watches: a rank that exits,
or a group whose `/health` fails (a hung rank), is reported by rank and cause, and the group is
restarted a bounded number of times, unless the rank said a restart would fail the same way (its
exit status EXIT_CONFIG: a bad checkpoint, a plan this machine cannot run, a memory budget it
exceeds). Ctrl-C or SIGTERM stops every process it started.

Torch-free: it speaks to the ranks over HTTP with urllib, as the operator does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shard_contract.env import ENV_NAMES, HOST_ENV, read_api_key
from shard_contract.plan import Plan, describe_layers
from shard_contract.units import count, human, table_unit
from shard_contract.wire import ShardEntry

from .launcher import LaunchError, LocalGroup, RankProcess, sigterm_unwinds

POLL_SECONDS = 0.25
HEALTH_PERIOD_SECONDS = 1.0
HEALTH_FAILURES = 2  # consecutive failed /health checks before the group is declared lost
EXIT_RANKS_FAILED = 3


class GroupLost(RuntimeError):
    """A rank died or the group's health failed; the message says which rank and why. `permanent`:
    a restart would fail the same way."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET (or a POST of `body`). Connection errors raise OSError."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.load(err)
        except ValueError:
            return err.code, {}


class LoadProgress:
    """Each rank's load (bytes of its tensors read so far, of all), from `/v1/shards` as it loads:
    on a terminal a bar per rank redrawn in place, otherwise a plain line per rank at each quarter."""

    BAR = 24

    def __init__(self, out: Callable[[str], None], tty: bool):
        self.out, self.tty = out, tty
        self.drawn = 0  # lines drawn last time (terminal)
        self.said: dict[int, int] = {}  # rank -> quarters reported (plain lines)

    @staticmethod
    def _of(rank: dict[str, Any]) -> tuple[int, int] | None:
        progress = rank.get("load_progress")
        return (progress["loaded"], progress["total"]) if progress else None

    def update(self, shards: dict[str, Any]) -> None:
        ranks = shards.get("ranks", [])
        if self.tty:
            lines = []
            for r in ranks:
                loaded, total = self._of(r) or (0, 0)
                filled = round(self.BAR * loaded / total) if total else 0
                lines.append(f"  rank {r['plan']['rank']}  {'█' * filled}{'░' * (self.BAR - filled)}  "
                             + (f"{loaded / total:>4.0%}  {human(loaded)} of {human(total)}" if total else r["state"])
                             + "\x1b[K")
            up = f"\x1b[{self.drawn}F" if self.drawn else ""
            self.out(up + "\n".join(lines))
            self.drawn = len(lines)
            return
        for r in ranks:
            if (progress := self._of(r)) is None:
                continue
            loaded, total = progress
            quarter = 4 * loaded // total if total else 4
            if quarter > self.said.get(r["plan"]["rank"], 0):
                self.said[r["plan"]["rank"]] = quarter
                self.out(f"  rank {r['plan']['rank']}: loaded {loaded / total if total else 1:.0%} "
                         f"({human(loaded)} of {human(total)})")


def wait_ready(group: LocalGroup, base_url: str, timeout: float,
               progress: LoadProgress | None = None) -> dict[str, Any]:
    """Until `/ready` answers 200; returns `/v1/shards`. A rank that exits raises `GroupLost`.
    Meanwhile each rank's load progress goes to `progress`."""
    deadline = time.monotonic() + timeout
    reason = "rank 0 is not answering yet"
    while True:
        failure = group.failure() or next((LaunchError(f"rank {r.rank} exited with status 0 before the group "
                                                       "was ready") for r in group.ranks
                                           if r.process.poll() == 0), None)
        if failure is not None:
            raise GroupLost(str(failure), permanent=failure.permanent)
        try:
            status, body = http_json(base_url + "/ready", timeout=2.0)
            shards = http_json(base_url + "/v1/shards")[1] if status == 200 or progress else {}
            if progress is not None:
                progress.update(shards)
            if status == 200:
                return shards
            reason = body.get("reason") or reason
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise GroupLost(f"the group was not ready after {timeout:.0f}s: {reason}; rank 0's log ends:\n"
                            f"{group.ranks[0].tail()}")
        time.sleep(POLL_SECONDS)


def watch(group: LocalGroup, base_url: str, should_stop: Callable[[], bool] = lambda: False) -> str:
    """Block while the group serves; return why it stopped serving (a rank exited, or its health
    failed), or "" when `should_stop()`."""
    failures, last_check = 0, 0.0
    while not should_stop():
        failure = group.failure() or next((f"rank {r.rank} exited with status 0 while serving" for r in group.ranks
                                           if r.process.poll() == 0), None)
        if failure is not None:
            return str(failure)
        if time.monotonic() - last_check >= HEALTH_PERIOD_SECONDS:
            last_check = time.monotonic()
            try:
                status, body = http_json(base_url + "/health", timeout=HEALTH_PERIOD_SECONDS * 3)
                reason = body.get("reason", "")
            except OSError as err:
                status, reason = 0, f"rank 0 does not answer: {err}"
            failures = failures + 1 if status != 200 else 0
            if failures >= HEALTH_FAILURES:
                return f"the group is unhealthy: {reason}"
        time.sleep(POLL_SECONDS)
    return ""


def render_shards(shards: dict[str, Any]) -> str:
    """Per rank: what the plan predicted and what the rank measured after load, in the plan
    table's unit, and the layers it streams."""
    ranks = [ShardEntry.model_validate(r) for r in shards.get("ranks", [])]
    unit, size = table_unit(max((r.plan.capacity_bytes for r in ranks), default=0))
    header = ("rank", "stage", "tp", "layers", f"predicted {unit}", f"measured {unit}", f"total held {unit}",
              "load s", "streams")
    rows = [header]
    for r in ranks:
        rp, predicted = r.plan, r.plan.predicted_bytes
        resident = r.report.resident_bytes if r.report is not None else None
        measured = resident.weights + resident.kv_cache + resident.staging if resident else 0
        rows.append((str(rp.rank), str(rp.stage), str(rp.tp_rank), describe_layers(rp.layers),
                     f"{(predicted.weights + predicted.kv_cache + predicted.staging) / size:.2f}",
                     f"{measured / size:.2f}", f"{(resident.total if resident else 0) / size:.2f}",
                     f"{r.report.load_seconds if r.report is not None else 0:.2f}",
                     f"{count(len(rp.offload.layers), 'layer')} from {rp.offload.tier}" if rp.offload else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["weights + KV cache per rank (with offload's staging slots), predicted by the plan and measured resident "
             "after load (total held: everything the rank holds above a bare `import torch`):"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    return "\n".join(lines)


def render_metrics(host: str, ranks: list[RankProcess]) -> str:
    """Where each rank serves its Prometheus metrics."""
    return "\n".join(["each rank's metrics (Prometheus text):",
                      *(f"  rank {r.rank}  http://{host}:{r.port}/metrics" for r in ranks)])


def complete(base_url: str, prompt: str, max_tokens: int, api_key: bytes | None = None,
             timeout: float = 300) -> dict[str, Any]:
    headers = {"Authorization": "Bearer " + api_key.decode("latin-1")} if api_key else None
    status, body = http_json(base_url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0}, timeout=timeout, headers=headers)
    if status != 200:
        raise GroupLost(f"the completion failed with HTTP {status}: {body.get('error', body)}")
    return body


def run_local(plan: Plan, model_dir: str | os.PathLike[str], *, port: int, host: str = "127.0.0.1",
              model_name: str | None = None, prompt: str | None = None, max_tokens: int = 24, restarts: int = 2,
              threads_per_rank: int | None = None, ready_timeout: float = 600, rendezvous_port: int | None = None,
              log_dir: str | os.PathLike[str] | None = None, api_key_file: str | None = None,
              out: Callable[[str], None] = print, err: Callable[[str], None] = print, tty: bool = False) -> int:
    """Serve `plan` (its group 0) until Ctrl-C / SIGTERM; with `prompt`, answer it once and stop.

    `model_name` is the name the API serves (the ShardedModel's; default: the plan's). The ranks'
    logs go to `log_dir` (default: a temporary directory, removed when the run ends cleanly and
    kept, with a line saying where, when a group failed). With `api_key_file`, the OpenAI routes
    require its key (`Authorization: Bearer`). Each rank's load progress goes to `out` as it
    loads: bars redrawn in place when `tty`.
    Returns the exit status: 0, or 3 when the group failed more often than `restarts` allows.
    SIGTERM raises SystemExit(143) and Ctrl-C KeyboardInterrupt, after every rank is stopped.
    """
    api_key = read_api_key(api_key_file) if api_key_file is not None else None  # checked before any rank starts
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="shardctl-run-"))
    failures: list[str] = []
    clean = False
    try:
        with sigterm_unwinds():
            code = _serve(plan, model_dir, logs, failures, port=port, host=host, model_name=model_name or plan.model,
                          prompt=prompt, max_tokens=max_tokens, restarts=restarts, threads_per_rank=threads_per_rank,
                          ready_timeout=ready_timeout, rendezvous_port=rendezvous_port,
                          api_key=(api_key_file, api_key), out=out, err=err, tty=tty)
        clean = not failures
        return code
    except (KeyboardInterrupt, SystemExit):  # stopped by its user
        clean = not failures
        raise
    finally:
        if not clean:
            err(f"shardctl: the ranks' logs are kept in {logs}")
        elif log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)


def _serve(plan: Plan, model_dir: str | os.PathLike[str], logs: Path, failures: list[str], *, port: int, host: str,
           model_name: str, prompt: str | None, max_tokens: int, restarts: int, threads_per_rank: int | None,
           ready_timeout: float, rendezvous_port: int | None, api_key: tuple[str | None, bytes | None],
           out: Callable[[str], None], err: Callable[[str], None], tty: bool) -> int:
    """`run_local`'s groups, one after another; each failure's reason is added to `failures`.
    `api_key` is the key's file and the key, or (None, None)."""
    base_url = f"http://{host}:{port}"
    env = {HOST_ENV: host, ENV_NAMES["model_name"]: model_name}
    key_file, key = api_key
    if key_file is not None:
        env[ENV_NAMES["api_key_file"]] = str(Path(key_file).resolve())
    while True:
        workdir = logs / f"attempt-{len(failures)}"
        started = time.monotonic()
        out(f"\nstarting {count(plan.world_size, 'rank')} (python -m shard_worker; logs in {workdir})")
        with LocalGroup(plan, model_dir, workdir, leader_port=port, threads_per_rank=threads_per_rank,
                        extra_env=env, rendezvous_port=rendezvous_port) as group:
            try:
                shards = wait_ready(group, base_url, ready_timeout, LoadProgress(out, tty))
                out(f"ready in {time.monotonic() - started:.1f} s: serving {base_url}/v1 "
                    f"(model {model_name!r}; OpenAI-compatible: /v1/completions, /v1/chat/completions"
                    f"{'; API key required' if key else ''})")
                out(render_shards(shards))
                out(render_metrics(host, group.ranks))
                if prompt is not None:
                    answer = complete(base_url, prompt, max_tokens, key)
                    choice = answer["choices"][0]
                    out(f"\nprompt: {prompt!r}")
                    out(f"answer: {choice['text']!r}")
                    out(f"({answer['usage']['completion_tokens']} tokens, finish_reason {choice['finish_reason']})")
                    return 0
                out("Ctrl-C stops every rank.")
                reason, permanent = watch(group, base_url), False
            except GroupLost as lost:
                reason, permanent = str(lost), lost.permanent
        failures.append(reason)
        err(f"shardctl: {reason}")
        if permanent:
            err("shardctl: not restarting the group: a restart would fail the same way")
            return EXIT_RANKS_FAILED
        if len(failures) > restarts:
            err(f"shardctl: the group failed {count(len(failures), 'time')}; no restarts left")
            return EXIT_RANKS_FAILED
        err(f"shardctl: every rank stopped; restarting the group ({len(failures)} of {restarts})")
