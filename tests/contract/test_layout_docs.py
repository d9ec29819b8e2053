"""docs/architecture.md's module tables match the files: every worker module has its row in the
Serving table (as `package/module.py`), every operator module is named in its folder's row of the
Layout table, and no row names a module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "architecture.md").read_text()
WORKER = REPO / "worker" / "shard_worker"
OPERATOR = REPO / "operator" / "shard_operator"


def modules(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*.py") if p.name != "__init__.py")


def worker_rows() -> list[str]:
    serving = DOC[DOC.index("\n## Serving\n"):]
    serving = serving[:serving.index("\n## ", 1)]
    return [line for line in serving.splitlines() if re.match(r"\| `(\w+/)?\w+\.py`", line)]


def test_every_worker_module_has_a_row():
    named = {m for row in worker_rows() for m in re.findall(r"`((?:\w+/)?\w+\.py)`", row.split("|")[1])}
    missing = [str(m) for m in modules(WORKER) if str(m) not in named]
    assert not missing, f"docs/architecture.md has no row for {missing}"
    gone = sorted(m for m in named if not (WORKER / m).exists())
    assert not gone, f"docs/architecture.md has rows for modules that are gone: {gone}"


def test_every_operator_module_is_named_in_its_folder_s_row():
    rows = {line.split("|")[1].strip().strip("`"): line for line in DOC.splitlines()
            if line.startswith("| `operator/shard_operator/")}
    missing = []
    for m in modules(OPERATOR):
        folder = f"operator/shard_operator/{m.parent}/" if m.parent != Path(".") else "operator/shard_operator/"
        if f"`{m.stem}`" not in rows.get(folder, ""):
            missing.append(str(m))
    assert not missing, f"docs/architecture.md's Layout table does not name {missing}"


def test_the_checks_read_the_tables():
    assert len(worker_rows()) > 20
    assert "`serving/routes.py`" in "".join(worker_rows())
