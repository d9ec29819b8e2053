"""Fixtures of the serving tests: a tiny demo checkpoint (written by `shardctl demo-model`'s own
code: several safetensors files, a trained BPE tokenizer with a chat template), ShardedModel
YAMLs for it, and helpers to find and stop the rank processes a test started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from shard_operator.demo_model import DemoShape, write_demo_model
from tests.support.processes import environ

TINY = DemoShape(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=600, max_positions=512, files=3)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("serving") / "tiny", TINY)


def sharded_model_yaml(path: Path, model_dir: Path, *, name: str = "tiny", tensor: int | str = 2,
                       pipeline: int | str = 1, max_len: int = 256, batch: int = 4) -> Path:
    path.write_text(f"""apiVersion: sharding.dev/v1alpha1
kind: ShardedModel
metadata:
  name: {name}
spec:
  model:
    path: {model_dir}
    dtype: float32
    maxModelLen: {max_len}
    maxBatchSize: {batch}
  parallelism:
    tensor: {tensor}
    pipeline: {pipeline}
""")
    return path


# ---------------------------------------------------------------- processes
def rank_port(pid: int) -> int:
    return int(environ(pid)["SHARD_PORT"])


def wait_for(what: str, check, timeout: float, period: float = 0.1):
    """Poll `check()` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(period)


def get(url: str, **kwargs) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=kwargs.pop("timeout", 5.0), **kwargs)
    except httpx.HTTPError:
        return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
