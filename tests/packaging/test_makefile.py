"""The first `make` says what it is doing before each long step (a fresh install is minutes of
silence otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_install_step_of_the_first_make_is_announced(tmp_path):
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "--no-print-directory", "-n", "-B", f"VENV={venv}", f"{venv}/.installed-stamp"],
                         cwd=REPO, capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
                         ).stdout  # as run by hand, also under `make test`
    # `make -n` prints the recipe as the shell would run it; a step is announced in its own line
    # or, when it runs only if needed, inside it before the command.
    lines = out.replace("\\\n", " ").splitlines()
    steps = [i for i, line in enumerate(lines) if re.search(r"-m (pip install|venv) ", line)]
    assert len(steps) == 3
    for i in steps:
        said = lines[i] if "echo" in lines[i] else lines[i - 1]
        assert 'echo "make: ' in said and ("installing" in said or "creating" in said), lines[i]
    assert 'echo "make: ' in lines[-1] and "is ready" in lines[-1]


def test_make_test_lints_first_and_runs_every_test_without_stopping():
    """ruff and mypy before pytest (a finding fails `make test`); pytest without -x, so one failure
    does not hide the rest of the run."""
    out = subprocess.run(["make", "--no-print-directory", "-n", "test"], cwd=REPO, capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items()
                                          if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}).stdout
    lines = out.splitlines()
    ruff = next(i for i, line in enumerate(lines) if re.search(r"/ruff check \.$", line))
    mypy = next(i for i, line in enumerate(lines) if re.search(r"/mypy$", line))
    pytest = next(i for i, line in enumerate(lines) if " -m pytest" in line)
    assert ruff < pytest and mypy < pytest
    assert not re.search(r"(^| )(-x|--exitfirst|--maxfail)( |=|$)", lines[pytest]), lines[pytest]
