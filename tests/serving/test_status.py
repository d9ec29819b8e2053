"""`shardctl status` of a real local group (`shardctl run`), and the load progress `run` prints
between "starting N ranks" and "ready"."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from shard_contract.wire import ShardsResponse
from shard_operator.api import load_sharded_models
from shard_operator.local.launcher import free_port
from shard_operator.local.run import LoadProgress
from shard_operator.planning import plan
from shard_operator.planning.inventory import local_kind, parse_devices
from shard_operator.planning.profile import profile_model
from tests.support.processes import shardctl

from .conftest import get, sharded_model_yaml, stop, wait_for

DEVICES = "localhost:1GiB*2"


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    """`shardctl run` of the tiny model over two pipeline stages: (its process, its port, the plan)."""
    yaml_file = sharded_model_yaml(tmp_path_factory.mktemp("status") / "m.yaml", tiny_model, name="watched",
                                   tensor=1, pipeline=2)
    port = free_port()
    proc = shardctl("run", "-f", str(yaml_file), "--port", str(port), "--devices", DEVICES)
    expected = plan(profile_model(tiny_model), load_sharded_models(yaml_file)[0].spec,
                    parse_devices(DEVICES, kind=local_kind()))
    try:
        wait_for("/ready", lambda: proc.poll() is not None or ((r := get(f"http://127.0.0.1:{port}/ready")) is not None
                 and r.status_code == 200), timeout=180)
        assert proc.poll() is None, proc.communicate()[1]
        yield proc, port, expected
    finally:
        stop(proc)


def status(port: int, *args: str) -> str:
    proc = shardctl("status", "--port", str(port), *args)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def table(out: str) -> list[dict[str, str]]:
    lines = out.splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    return [dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=False))
            for line in lines[2:] if line.strip()[:1].isdigit()]


pytestmark = pytest.mark.slow


def test_status_shows_each_rank_and_the_predicted_step_beside_the_measured_one(group):
    _, port, expected = group
    before = table(status(port))
    assert [(r["rank"], r["stage"], r["layers"], r["state"]) for r in before] == \
        [("0", "0", "0-1 (2 layers)", "ready"), ("1", "1", "2-3 (2 layers)", "ready")]
    unit_size = 2**30 if expected.ranks[0].capacity_bytes >= 2**30 else 2**20
    for row, rank in zip(before, expected.ranks, strict=True):
        assert float(row[next(k for k in row if k.startswith("predicted"))]) == \
            round(rank.predicted_bytes.total / unit_size, 2)
        assert row[next(k for k in row if k.startswith("measured"))] != "-"
    for _ in range(2):
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 6,
                                                                             "ignore_eos": True}, timeout=60)
        assert answer.status_code == 200, answer.text

    def measured() -> str | None:  # each rank's figures arrive with its next heartbeat
        out = status(port)
        return out if "measured - (no batch yet)" not in out and all(r["compute"] != "-" for r in table(out)) \
            else None
    out = wait_for("a measured step and every rank's shares", measured, timeout=30, period=0.5)
    step = re.search(r"decode step: predicted ([\d.]+) ms \(the plan's critical path\), measured ([\d.]+) ms", out)
    assert step and float(step[1]) == round(expected.groups[0].critical_path_seconds * 1e3, 2) and float(step[2]) > 0
    for row in table(out):
        shares = [int(row[k].rstrip("%")) for k in ("compute", "comm", "idle")]
        assert 98 <= sum(shares) <= 102
    assert int(table(out)[0]["compute"].rstrip("%")) > 0

    raw = ShardsResponse.model_validate(json.loads(status(port, "--json")))
    assert raw.model == "watched" and raw.predicted_step_seconds == expected.groups[0].critical_path_seconds
    assert [r.load_progress.loaded == r.load_progress.total > 0 for r in raw.ranks] == [True, True]


def test_status_watch_refreshes_until_stopped(group):
    _, port, _ = group
    watcher = shardctl("status", "--port", str(port), "--watch", "0.3")
    lines: list[str] = []

    def read() -> None:  # each block is flushed as it is printed
        assert watcher.stdout is not None
        for line in watcher.stdout:
            lines.append(line)

    def blocks() -> list[str]:  # not a terminal: one block after another, no screen control
        return re.findall(r"^--- \d\d:\d\d:\d\d\nwatched, group 0", "".join(lines), re.M)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for("two refreshes", lambda: len(blocks()) >= 2, timeout=120, period=0.1)
    finally:
        watcher.terminate()
        watcher.wait(30)
        reader.join(30)
    assert watcher.returncode is not None and len(blocks()) >= 2, "".join(lines)


def test_run_prints_each_ranks_load_progress_before_ready(tiny_model, tmp_path):
    yaml_file = sharded_model_yaml(tmp_path / "m.yaml", tiny_model, name="loading", tensor=2, pipeline=1)
    proc = shardctl("run", "-f", str(yaml_file), "--port", "0", "--devices", DEVICES, "--prompt", "x",
                    "--max-tokens", "2")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    between = out.split("starting 2 ranks")[1].split("ready in")[0]
    for rank in (0, 1):
        assert re.search(rf"^  rank {rank}: loaded 100% \([\d.]+ \w+ of [\d.]+ \w+\)$", between, re.M), between


def test_load_progress_is_a_bar_per_rank_on_a_terminal_and_quarters_otherwise():
    def shards(*progress):
        return {"ranks": [{"plan": {"rank": i}, "state": "loading" if p else "starting",
                           **({"load_progress": {"loaded": p[0], "total": p[1]}} if p else {})}
                          for i, p in enumerate(progress)]}
    lines: list[str] = []
    plain = LoadProgress(lines.append, tty=False)
    for step in (shards(None, None), shards((10, 100), None), shards((30, 100), (50, 100)),
                 shards((100, 100), (100, 100))):
        plain.update(step)
    assert lines == ["  rank 0: loaded 30% (30 B of 100 B)", "  rank 1: loaded 50% (50 B of 100 B)",
                     "  rank 0: loaded 100% (100 B of 100 B)", "  rank 1: loaded 100% (100 B of 100 B)"]
    drawn: list[str] = []
    bars = LoadProgress(drawn.append, tty=True)
    bars.update(shards((0, 100), None))
    bars.update(shards((50, 100), (100, 100)))
    assert not drawn[0].startswith("\x1b[") and drawn[1].startswith("\x1b[2F")  # redrawn in place
    assert drawn[1].splitlines()[0] == "\x1b[2F  rank 0  " + "█" * 12 + "░" * 12 + "   50%  50 B of 100 B\x1b[K"
