"""The packages' allowed imports (docs/architecture.md): the worker imports only the contract, the
contract imports neither plane, and the product never imports the dev cluster."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"shard_contract": "contract", "shard_operator": "operator", "shard_worker": "worker",
            "shard_devcluster": "devcluster"}
OURS = set(PACKAGES)

# package -> what it may import of the others
ALLOWED = {
    "shard_contract": set(),
    "shard_worker": {"shard_contract"},
    "shard_operator": {"shard_contract"},
    "shard_devcluster": {"shard_contract", "shard_operator"},
}
# third-party modules a package must never import
FORBIDDEN = {
    "shard_contract": {"torch", "kopf", "kubernetes", "fastapi", "kmock"},
    "shard_operator": {"torch", "kmock"},
    "shard_worker": {"kopf", "kubernetes", "kmock"},
}


def imported_roots(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at any depth (function-level imports too)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def files(package: str) -> list[Path]:
    return sorted((REPO / PACKAGES[package] / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_package_imports_only_the_packages_it_may(package):
    assert files(package), f"no modules found for {package}"
    offenders = {}
    for path in files(package):
        roots = imported_roots(path)
        bad = (roots & OURS) - ALLOWED[package] - {package} | (roots & FORBIDDEN.get(package, set()))
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert not offenders, offenders


def test_the_checker_sees_a_forbidden_import(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from shard_operator.plan import Plan\n    import torch.nn\n")
    assert imported_roots(sample) == {"shard_operator", "torch"}


def test_the_fast_tier_does_not_load_the_dev_cluster():
    """`make test-fast` stays fast and light: collecting its tests (which imports every module they
    import) loads none of the emulated API server; the in-memory store patches with
    `shard_devcluster.patches` alone. (kmock itself is loaded by pytest, as a plugin.)"""
    script = ("import sys, pytest\n"
              "code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/contract', "
              "'tests/operator/unit'])\n"
              "print(sorted(m for m in sys.modules if m.startswith(('shard_devcluster.emulator', "
              "'shard_devcluster.apiserver', 'shard_devcluster.controlplane'))))\n"
              "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
