"""Every environment variable of a worker rank is named in `shard_contract.env`: the operator, the
local launcher, the dev cluster and the worker take the names from there, never spell them again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shard_contract import env

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"^(SHARD_(?!OPERATOR_)[A-Z_]+|RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|TP_SIZE|PP_SIZE)$")
FOLDERS = ("worker/shard_worker", "operator/shard_operator", "devcluster/shard_devcluster", "contract/shard_contract")


def spelled(path: Path) -> set[str]:
    """The worker variables a module writes as a whole string literal (docstrings aside)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and NAME.match(node.value)}


def test_the_worker_environment_is_named_only_in_env_py():
    home = REPO / "contract/shard_contract/env.py"
    named = spelled(home)
    assert {"SHARD_HOST", "SHARD_SHM_DIR", "SHARD_KERNEL", "SHARD_FUSED_LAYERS", "RANK"} <= named
    elsewhere = {str(p.relative_to(REPO)): sorted(found) for folder in FOLDERS
                 for p in sorted((REPO / folder).rglob("*.py")) if p != home and (found := spelled(p))}
    assert not elsewhere, f"name these in shard_contract/env.py and import them: {elsewhere}"


def test_the_worker_commands_run_the_worker_modules():
    assert env.WORKER_COMMAND[-1] == env.WORKER_MODULE == "shard_worker"
    assert env.LAUNCH_COMMAND[2] == env.LAUNCH_MODULE == "shard_worker.launch"
    assert (REPO / "worker" / "shard_worker" / "__main__.py").is_file()
    assert (REPO / "worker" / "shard_worker" / "launch.py").is_file()
