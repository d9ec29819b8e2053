"""A test tool's own virtual environment, made once per machine under ~/.cache/shard-operator.

Tools whose pins fight the project's (checkov, lm-eval) get a venv each, keyed by name and version,
installed with pip from the registry by `make test-tools` or by the first test that needs one.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("SHARD_TEST_BIN_CACHE", Path.home() / ".cache" / "shard-operator" / "bin")).parent


def ensure(name: str, requirements: list[str], *, timeout: float) -> Path:
    """The python of venv `name` under the cache, made with `requirements` if this machine has none."""
    venv = CACHE / name
    python, stamp = venv / "bin" / "python", venv / ".installed"
    if stamp.exists():
        return python
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent installs wait for one installer
        if not stamp.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            *requirements], check=True, timeout=timeout)
            stamp.touch()
    return python
