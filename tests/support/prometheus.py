"""A real Prometheus server (Debian's `prometheus`) on loopback, with its storage in a temporary
directory, scraping the targets a test gives it every second; queried over its HTTP API."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from shard_operator.local.launcher import free_port

SCRAPE_SECONDS = 1


class Prometheus:
    def __init__(self, jobs: list[dict[str, Any]], rule_files: list[Path] = ()):
        """`jobs`: scrape_configs entries (job_name, static_configs, ...)."""
        self.jobs, self.rule_files = jobs, list(rule_files)

    def __enter__(self) -> Prometheus:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: `make system-tools` installs it (apt-get install prometheus)"
        self.dir = tempfile.TemporaryDirectory(prefix="prometheus-")
        config = Path(self.dir.name) / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
            "rule_files": [str(p) for p in self.rule_files], "scrape_configs": self.jobs}))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(Path(self.dir.name) / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir.name}/data",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self.wait(lambda: httpx.get(self.url + "/-/ready", timeout=2).status_code == 200, 60, "ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        self.dir.cleanup()

    def wait(self, check, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"prometheus exited: {self.tail()}"
            try:
                value = check()
            except httpx.HTTPError:
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"prometheus: not {what} within {timeout:.0f} s\n{self.tail()}"
            time.sleep(0.25)

    def tail(self) -> str:
        return (Path(self.dir.name) / "prometheus.log").read_text()[-3000:]

    def api(self, path: str, **params: Any) -> Any:
        body = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=30).json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` evaluates to now: [{"metric": {labels}, "value": [t, "v"]}]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return data["result"]

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}
