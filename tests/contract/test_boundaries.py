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
              "'shard_devcluster.apiserver', 'shard_devcluster.controlplane', 'shard_devcluster.store', "
              "'shard_devcluster.writes', 'shard_devcluster.reads'))))\n"
              "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


# The operator's packages by domain, each with what it may import of the others (the contract is
# always allowed): a lower layer never reaches up, so planning runs without Kubernetes and the local
# runner without the reconcile. cli and __main__ compose everything.
OPERATOR_LAYERS = {
    "api": set(),
    "planning": {"api"},
    "objects": {"api", "planning"},
    "local": {"api", "planning"},
    "kube": {"api"},
    "policy": {"api"},
    "settings": {"planning"},
    "reconcile": {"api", "planning", "objects", "kube", "policy", "settings"},
    "metrics": {"api", "reconcile"},
}


# The worker's packages by domain, likewise: a rank (rank/, __main__) assembles the HTTP side
# (serving/) and the engine; the engine runs the model; telemetry (counters, heartbeats, metrics)
# and `log` sit below everything, so any layer can count and report without reaching up.
WORKER_LAYERS = {
    "log": set(),
    "telemetry": {"log"},
    "comm": {"log", "telemetry"},
    "model": {"log", "telemetry", "comm"},
    "engine": {"log", "telemetry", "comm", "model"},
    "serving": {"log", "telemetry", "model", "engine"},
    "rank": {"log", "telemetry", "comm", "model", "engine", "serving"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_within(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (at any depth, function-level too; an
    imported name that is a submodule counts as that module)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                target = ".".join(filter(None, [base, node.module or ""]))
                found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle_inside_a_package(package):
    root = REPO / PACKAGES[package] / package
    assert circles(imports_within(root)) == []


def test_the_circle_finder_sees_a_circle_and_only_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def layer_offenders(package: str, layers: dict[str, set[str]], composers: set[str]) -> list[str]:
    """Imports from one folder of `package` into another that its layer may not reach."""
    root = REPO / PACKAGES[package] / package
    edges = imports_within(root)
    domain = {m: m.split(".")[1] for m in edges if m.count(".") >= 1}
    assert set(layers) | composers >= set(domain.values()), sorted(set(domain.values()))
    return sorted(f"{m} imports {d}" for m, ds in edges.items() for d in ds
                  if m in domain and d in domain and domain[m] != domain[d]
                  and domain[m] in layers and domain[d] not in layers[domain[m]])


def test_the_operator_packages_import_only_the_layers_below_them():
    assert layer_offenders("shard_operator", OPERATOR_LAYERS, {"cli", "__main__"}) == []


def test_the_worker_packages_import_only_the_layers_below_them():
    assert layer_offenders("shard_worker", WORKER_LAYERS, {"__main__", "launch"}) == []
