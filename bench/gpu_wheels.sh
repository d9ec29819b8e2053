#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a GPU machine that has torch, transformers, safetensors,
# numpy, tokenizers, pyyaml, jinja2, pytest, hypothesis, httpx and prometheus-client but not the
# worker's server and contract libraries: downloaded here, to be carried there (3-9 MiB).
#
#     bash bench/gpu_wheels.sh [DIR]      (default .cache/gpu-wheels; then WHEELS=DIR for gpu_check.sh)
#
# The versions are this project's venv's. pydantic-core is the one compiled wheel: it is fetched for
# CPython 3.10-3.13 on x86-64 Linux, and gpu_check.sh unpacks the one that fits. setproctitle (rank
# names in `ps`) is left out: the worker runs without it. pytest-asyncio is not needed by those tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR=${1:-.cache/gpu-wheels}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DIR"
"$PIP" download -q --no-deps --only-binary=:all: -d "$DIR" \
    pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
    uvicorn==0.55.0 click==8.5.1
for version in 3.10 3.11 3.12 3.13; do
    "$PIP" download -q --no-deps --only-binary=:all: --python-version "$version" \
        --platform manylinux_2_17_x86_64 -d "$DIR" pydantic-core==2.50.5
done
ls "$DIR"
du -sh "$DIR"
