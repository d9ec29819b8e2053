"""What the end-to-end scenarios do to the one-machine cluster: kubectl, reading status, sending
completions through a Service, and traffic that runs throughout a scenario and counts failures."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shard_devcluster.cluster import BackgroundCluster, DevCluster
from tests.support.k8s_binaries import binary

SM = "sharding.dev/v1alpha1/shardedmodels"


class Harness:
    """A running DevCluster (in its own thread), driven the way a user drives a cluster."""

    def __init__(self, background: BackgroundCluster):
        self.background = background
        self.cluster: DevCluster = background.cluster

    # ---------------------------------------------------------------- kubectl and the API
    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run([str(binary("kubectl")), "--kubeconfig", str(self.cluster.kubeconfig), *args],
                                input=stdin, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a coroutine function of the cluster's (emulator, kubelet) on its loop."""
        return self.background.call(fn, *args, timeout=60)

    def model(self, name: str) -> dict[str, Any]:
        return self.call(self.cluster.emu.k8s_get, SM, "default", name) or {}

    def pods(self, model: str, **labels: str) -> list[dict[str, Any]]:
        selector = ",".join([f"sharding.dev/model={model}", "sharding.dev/component=rank"] +
                            [f"sharding.dev/{k}={v}" for k, v in labels.items()])
        pods = self.call(self.cluster.emu.k8s_list, "v1/pods", "default", selector)
        return sorted(pods, key=lambda p: (p["metadata"]["labels"]["sharding.dev/group"],
                                           int(p["metadata"]["labels"]["sharding.dev/rank"]), p["metadata"]["name"]))

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 120.0, interval: float = 0.25) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:.0f} s: {what}\n{self.diagnosis()}")
            time.sleep(interval)

    def ready(self, name: str, replicas: int) -> dict[str, Any] | None:
        """The model's status once it is Ready with `replicas` ready groups for its current spec."""
        obj = self.model(name)
        status = obj.get("status") or {}
        current = status.get("observedGeneration") == (obj.get("metadata") or {}).get("generation")
        ok = current and status.get("phase") == "Ready" and status.get("readyReplicas") == replicas
        return status if ok else None

    def wait_ready(self, name: str, replicas: int = 1, timeout: float = 180.0) -> dict[str, Any]:
        return self.wait(f"{name} Ready with {replicas} groups", lambda: self.ready(name, replicas), timeout)

    def service_url(self, name: str) -> str:
        return self.wait(f"a ClusterIP for Service {name}", lambda: self.cluster.service_url(name), timeout=60)

    def diagnosis(self) -> str:
        """What to look at when a scenario stalls: statuses, the operator's and pods' log tails."""
        lines = []
        for obj in self.call(self.cluster.emu.k8s_list, SM):
            status = obj.get("status") or {}
            conditions = [(c.get('type'), c.get('reason'), c.get('message')) for c in status.get('conditions') or []]
            lines.append(f"{obj['metadata']['name']}: {status.get('phase')} {conditions}")
        log = self.cluster.operator_log.read_text(errors="replace") if self.cluster.operator_log.exists() else ""
        lines.append("operator log: " + "\n".join(s for s in log.splitlines() if "Handler '" not in s)[-3000:])
        assert self.cluster.kubelet is not None
        for (_, pod), sandbox in list(self.cluster.kubelet.sandboxes.items())[-8:]:
            lines.append(f"{pod}: {bytes(sandbox.logs.data[-800:]).decode(errors='replace')}")
        return "\n".join(lines)


# ---------------------------------------------------------------- requests
def completion_body(prompt: str, max_tokens: int = 8, model: str = "demo") -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def complete(url: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def tokens_of(response: httpx.Response) -> tuple:
    choice = response.json()["choices"][0]
    return tuple(choice.get("token_ids") or ()) or (choice["text"],)


@dataclass
class Result:
    start: float
    end: float
    status: int  # 0: no HTTP answer
    tokens: tuple = ()
    pod: str = ""
    error: str = ""
    retries: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


# As OpenAI's SDKs do: a connection error, 408, 409, 429 or 5xx is tried again, twice, after a
# pause. The Service does not replay a completion that reached a group (kube-proxy does not):
# when that group dies mid-request, the client decides.
CLIENT_RETRIES, CLIENT_BACKOFF = 2, (0.5, 1.0)


def retryable(status: int) -> bool:
    return status in (0, 408, 409, 429) or status >= 500


@dataclass
class Traffic:
    """Clients that send the same greedy completion through a Service until stopped, each retrying
    as OpenAI's SDKs do.

    Every answer must be the tokens `expected` (the model does not change while it moves), so a
    wrong answer counts as a failure just as an error does.
    """

    url: str
    body: dict[str, Any]
    expected: tuple
    clients: int = 2
    pause: float = 0.05
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Traffic:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, name=f"client-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)

    def _client(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                for retries in range(CLIENT_RETRIES + 1):
                    result = self._send(http, start)
                    result.retries = retries
                    if not retryable(result.status) or retries == CLIENT_RETRIES:
                        break
                    time.sleep(CLIENT_BACKOFF[retries])
                self.results.append(result)
                time.sleep(self.pause)

    def _send(self, http: httpx.Client, start: float) -> Result:
        try:
            r = http.post(self.url + "/v1/completions", json=self.body)
        except httpx.HTTPError as err:
            return Result(start, time.monotonic(), 0, error=f"{type(err).__name__}: {err}")
        tokens = tokens_of(r) if r.status_code == 200 else ()
        error = "" if r.status_code == 200 else r.text[:300]
        if r.status_code == 200 and tokens != self.expected:
            error = f"wrong tokens {tokens}"
        return Result(start, time.monotonic(), r.status_code, tokens, r.headers.get("x-upstream-pod", ""), error)

    def wait_for(self, n: int, timeout: float = 60.0) -> None:
        """Until `n` more answers have come back."""
        target = len(self.results) + n
        deadline = time.monotonic() + timeout
        while len(self.results) < target:
            assert time.monotonic() < deadline, f"traffic stalled: {self.summary()}"
            time.sleep(0.1)

    def during(self, start: float, end: float) -> list[Result]:
        """Requests that were in flight at some moment of [start, end]."""
        return [r for r in self.results if r.end >= start and r.start <= end]

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    def summary(self, results: list[Result] | None = None) -> dict[str, Any]:
        results = self.results if results is None else results
        ok = [r for r in results if r.ok]
        latencies = sorted(r.end - r.start for r in ok)
        return {"requests": len(results), "failed": len(results) - len(ok),
                "client_retries": sum(r.retries for r in results),
                "success_rate": round(len(ok) / len(results), 4) if results else None,
                "max_latency_s": round(latencies[-1], 2) if latencies else None,
                "errors": sorted({r.error[:120] for r in results if not r.ok})[:5]}


# ---------------------------------------------------------------- the benchmark record
class Report:
    """Timings the scenarios measure, written as JSON when SHARD_E2E_REPORT names a file."""

    def __init__(self, path: str | None):
        self.path, self.entries = path, {}

    def add(self, scenario: str, **values: Any) -> None:
        self.entries[scenario] = values
        print(f"\n[e2e] {scenario}: {json.dumps(values)}")

    def write(self) -> None:
        if self.path and self.entries:
            target = Path(self.path)
            old = json.loads(target.read_text()) if target.exists() else {}
            target.write_text(json.dumps({**old, **self.entries}, indent=2) + "\n")
