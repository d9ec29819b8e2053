"""The rendezvous store of a running local group, as a stranger on this machine's network sees it:
it listens on loopback only (nor does anything else of the ranks), and a heartbeat record written
into it by anyone without the group's key is ignored and counted while the group stays healthy."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import struct
import threading
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from shard_operator.local.launcher import LocalGroup, free_port, plan_local

from .conftest import get, wait_for, wait_group_ready

pytestmark = pytest.mark.slow

SIOCGIFADDR = 0x8915


def non_loopback_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback: its hostname's and its interfaces'."""
    found = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                found.add(socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                                       struct.pack("256s", name.encode()[:15]))[20:24]))
            except OSError:  # no IPv4 address
                continue
    return sorted(a for a in found if not a.startswith("127."))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            # /proc prints each 32-bit word in the host's byte order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.append((socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, raw), int(port, 16)))
    return found


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    port = free_port()
    the_plan = plan_local(tiny_model, 2, 1, max_model_len=256, max_batch_size=2, devices="local:1GiB*2",
                          device_kind="cpu")
    with LocalGroup(the_plan, tiny_model, tmp_path_factory.mktemp("group"), leader_port=port,
                    rendezvous_port=free_port(), extra_env={"SHARD_HOST": "127.0.0.1"}) as running:
        url = f"http://127.0.0.1:{port}"
        wait_group_ready(running, url)
        running.url = url
        yield running


def store_port(group: LocalGroup) -> int:
    return group.rendezvous_port


def test_the_store_and_every_rank_listen_on_loopback_only(group):
    port = store_port(group)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the ranks' way in
    for rank in group.ranks:
        where = listening(rank.process.pid)
        assert where and all(address in ("127.0.0.1", "::1") for address, _ in where), (rank.rank, where)
    assert ("127.0.0.1", port) in listening(group.ranks[0].process.pid)
    outside = non_loopback_addresses()
    if not outside:
        pytest.skip("this machine has no address but loopback: nothing to reach the store from outside")
    for address in outside:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5)


def test_the_group_key_is_a_private_file_never_on_a_command_line_or_in_the_environment(group):
    key_file = group.secret_file
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    key = key_file.read_bytes()
    assert len(key) == 32
    for rank in group.ranks:
        command = Path(f"/proc/{rank.process.pid}/cmdline").read_bytes()
        assert key.hex().encode() not in command and key not in command
        # the environment it was started with (its process title overwrites /proc/PID/environ)
        env = group.rank_env(rank.rank, group.rendezvous_port, group.workdir / "plan.json")
        assert env["SHARD_GROUP_SECRET_FILE"] == str(key_file)
        values = "\0".join(env.values()).encode(errors="surrogateescape")
        assert key.hex().encode() not in values and key not in values


def rejected(group: LocalGroup, ranks: tuple[int, ...] | None = None) -> dict[int, float]:
    """rank -> shard_heartbeat_rejected_total on its /metrics (of `ranks`, default all)."""
    counts = {}
    for rank in group.ranks:
        if ranks is not None and rank.rank not in ranks:
            continue
        text = httpx.get(f"http://127.0.0.1:{rank.port}/metrics", timeout=5).text
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "shard_heartbeat_rejected"]
        counts[rank.rank] = next(s.value for s in family.samples if s.name.endswith("_total"))
    return counts


def test_forged_heartbeats_are_ignored_and_counted_and_the_group_stays_healthy(group):
    """A stranger who reaches the store writes records under rank 1's key: that it failed (with a
    wrong seal, then none), and its own old record again (to keep a dead rank looking alive). Rank
    1 overwrites its record every second, so a forger thread writes each one again and again until
    rank 0 has read (and counted) it; then rank 1's own records get through for two beats before
    the next, so rank 0 never goes the 5 s without a true beat after which rank 1 would be dead."""
    key = "shard/rank/1"
    store = dist.TCPStore("127.0.0.1", store_port(group), is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    claim = json.dumps({"rank": 1, "seq": 10**9, "state": "failed", "problems": [], "error": "forged",
                        "report": None}).encode()

    def true_beats(count: int) -> None:
        for _ in range(count):
            last = store.get(key)
            wait_for("rank 1 beats again", lambda: store.get(key) not in (last, *forgeries), timeout=60)

    forgeries = ()
    old = store.get(key)
    true_beats(1)
    forgeries = (b"0" * 64 + b" " + claim, claim, old)
    for n, forged in enumerate(forgeries):
        counted = rejected(group, (0,))[0]
        done = threading.Event()

        def forge(value: bytes = forged) -> None:
            writer = dist.TCPStore("127.0.0.1", store_port(group), is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=5))
            while not done.wait(0.02):
                writer.set(key, value)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        try:
            wait_for(f"rank 0 reads forgery {n}", lambda: rejected(group, (0,))[0] > counted, timeout=60)
        finally:
            done.set()
            forger.join(10)
        true_beats(2)
    health = get(group.url + "/health")
    assert health.status_code == 200 and health.json()["reason"] == "", health.json()
    answer = httpx.post(group.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200, answer.text
    shards = get(group.url + "/v1/shards").json()
    assert [r["state"] for r in shards["ranks"]] == ["ready", "ready"] and shards["ready"]
    log = group.ranks[0].log.read_text()
    assert "ignored a heartbeat record: a record under rank 1's key does not carry the group key's seal" in log
    assert "ignored a heartbeat record: rank 1's record number" in log
