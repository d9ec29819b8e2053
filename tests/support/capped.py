"""Run hostile input in a child process under a memory cap (`ulimit -v`), so that a parser that
regresses to unbounded memory fails fast with MemoryError instead of swapping the machine."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Sequence

MiB = 2**20


def run_capped(code: str, args: Sequence[str] = (), limit_bytes: int = 1024 * MiB,
               bound_seconds: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -c code *args` with its address space capped at `limit_bytes`. `bound_seconds` is a
    generous bound for a hang, not a timing: it fails the test instead of blocking the suite."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-c", code, *args], preexec_fn=cap, capture_output=True, text=True,
                          timeout=bound_seconds, check=False)
