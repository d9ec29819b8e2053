"""The worker's one way to say something: a line on stderr, named by rank. A pod's log and a
`shardctl run` rank's log file are this stream."""

from __future__ import annotations

import sys


def log(rank: int, message: str) -> None:
    print(f"[shard_worker rank {rank}] {message}", file=sys.stderr, flush=True)


def first_line(err: BaseException) -> str:
    """An error in one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
