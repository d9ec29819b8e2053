"""The processes a test started: `shardctl` as a child, and what /proc says of its descendants."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path


def _ctrl_c_as_in_a_terminal() -> None:
    # A test run started in the background (`make test &`) ignores SIGINT, and its children would
    # inherit that: Ctrl-C would then not reach shardctl, as it does from a user's terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def shardctl(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shard_operator.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal, **kwargs)


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


# How `ps` shows a rank once it has named itself (shard_worker.__main__.process_title); its
# environment is no longer readable from /proc then (setproctitle writes over it).
TITLE = re.compile(rb"shard-worker model=\S+ group=(?P<group>\d+) rank=(?P<rank>\d+)(?: port=(?P<port>\d+))?")


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_worker(pid: int) -> bool:
    """A rank: `python -m shard_worker`, or named by its title."""
    command = cmdline(pid)
    return b"shard_worker" in command or TITLE.match(command) is not None


def rank_port(pid: int) -> int:
    """The HTTP port of the serving rank `pid`, from its title."""
    return int(TITLE.match(cmdline(pid))["port"])


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_ranks(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the live ranks `launcher_pid` started that have named themselves (a rank
    still importing torch has not yet)."""
    titles = {p: TITLE.match(cmdline(p)) for p in children(launcher_pid)}
    return {int(title["rank"]): p for p, title in titles.items() if title and alive(p)}
