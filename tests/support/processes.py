"""The processes a test started: `shardctl` as a child, and what /proc says of its descendants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def shardctl(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shard_operator.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def is_worker(pid: int) -> bool:
    try:
        return b"shard_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_ranks(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the live `python -m shard_worker` children of `launcher_pid`."""
    return {int(environ(p)["RANK"]): p for p in children(launcher_pid) if is_worker(p) and alive(p)}
