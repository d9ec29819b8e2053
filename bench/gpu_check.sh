#!/usr/bin/env bash
# The device check: what a lent GPU machine runs, once, from the repository root (about 3 minutes,
# at most 6):
#
#     OUT=/a/folder/that/comes/back bash bench/gpu_check.sh
#
# It needs torch with CUDA, transformers, safetensors, numpy, tokenizers, pyyaml, jinja2, pytest,
# hypothesis and httpx, plus pydantic, fastapi and uvicorn with their dependencies: importable
# already, or as wheels in the folder $WHEELS (bench/gpu_wheels.sh fetches them), which are
# unpacked for this Python and put on PYTHONPATH. No network and no pip: the repository's packages
# go on PYTHONPATH, and the C decode kernel (CPU only) is not built. Steps, each timed and bounded;
# a failed one is reported and the next still runs:
#   0. with $WHEELS: unpack the wheels that fit this Python;
#   1. environment: nvidia-smi, torch and CUDA, every import the other steps need;
#   2. tests/worker/test_on_device.py on CUDA (float32 = HF, bfloat16, memory vs plan, int8,
#      offload, `shardctl run`) and tests/worker/test_gpu_runtime.py; meanwhile the bench's 853M
#      checkpoint is written in the background (a CPU job);
#   3. bench/gpu_decode.py: decode tokens/s of one worker rank vs HF generate vs the read-bandwidth
#      limit, bfloat16 first, then int8 and float32.
# In $OUT: check.log (everything), env.log, tests.log, tests.xml, bench-prepare.log, bench.log,
# gpu_bench.json (rewritten after each measurement), summary.txt. Exit status 0: every step passed.
#
# GPU_CHECK_DRY=1 runs the same steps on the CPU (the cpu tests, the bench's small model): a check
# of this script on a machine without a GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORK=${TMPDIR:-/tmp}/shard-gpu-check
mkdir -p "$WORK"
exec > >(tee -a "$OUT/check.log") 2>&1

# The working tree's packages come first. `shardctl` reads its version from the distribution's
# metadata: where shard-operator is not installed, a minimal one stands in.
META=""
if ! "$PY" -c "import importlib.metadata as m; m.version('shard-operator')" 2>/dev/null; then
    mkdir -p "$WORK/site/shard_operator-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: shard-operator\nVersion: 0.1.0\n' \
        > "$WORK/site/shard_operator-0.1.0.dist-info/METADATA"
    META=":$WORK/site"
fi
SITE=""
[ -n "${WHEELS:-}" ] && SITE=":$WORK/wheels"
export PYTHONPATH="$ROOT/contract:$ROOT/operator:$ROOT/worker:$ROOT$META${PYTHONPATH:+:$PYTHONPATH}$SITE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
    DEVICE=cpu BENCH=(--quick --tokens 16) MODEL="$WORK/model-quick"
else
    DEVICE=cuda BENCH=(--tokens 128) MODEL="$WORK/model"
fi
LAUNCH=()  # each bounded command in a session of its own, so that all it started can be stopped
if command -v setsid > /dev/null; then LAUNCH=(setsid --wait); fi

STATUS=()
FAILED=0
now() { date -u +%H:%M:%S; }

step() {  # step NAME FUNCTION: run it, time it, remember how it went
    local name=$1 start=$SECONDS rc=0
    echo
    echo "=== $(now) $name"
    "$2" || rc=$?
    if [ "$rc" -eq 0 ]; then STATUS+=("ok      $name ($((SECONDS - start)) s)")
    else STATUS+=("FAILED  $name (exit $rc, $((SECONDS - start)) s)"); FAILED=1; fi
    echo "=== $(now) ${STATUS[-1]}"
}

bounded() {  # bounded SECONDS LOG COMMAND...: in a session of its own, output to LOG (printed after);
    # past SECONDS the whole session is killed, and whatever it left running (rank processes) too
    local limit=$1 log=$2 rc=0 waited=0
    shift 2
    ${LAUNCH[@]+"${LAUNCH[@]}"} "$@" > "$log" 2>&1 < /dev/null &
    local pid=$!
    local group=$pid
    [ ${#LAUNCH[@]} -gt 0 ] && group=-$pid  # its session's process group
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
        echo "(killed after ${limit} s)" >> "$log"
        kill -TERM -- "$group" 2>/dev/null || true
        sleep 3
    fi
    wait "$pid" || rc=$?
    kill -KILL -- "$group" 2>/dev/null || true
    cat "$log"
    return "$rc"
}

wheels() {  # the wheels of $WHEELS that fit this Python, unpacked into $WORK/wheels (what pip --target does)
    rm -rf "$WORK/wheels"
    "$PY" - "$WHEELS" "$WORK/wheels" <<'EOF'
import sys, zipfile
from pathlib import Path
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
source, target = Path(sys.argv[1]), Path(sys.argv[2])
ours = {tag: rank for rank, tag in enumerate(sys_tags())}  # the most specific first
best = {}
for wheel in sorted(source.glob("*.whl")):
    name, _, _, tags = parse_wheel_filename(wheel.name)
    fit = min((ours[t] for t in tags if t in ours), default=None)
    if fit is not None and (name not in best or fit < best[name][0]):
        best[name] = (fit, wheel)
for name, (_, wheel) in sorted(best.items()):
    zipfile.ZipFile(wheel).extractall(target)
    print("unpacked", wheel.name)
skipped = sorted({parse_wheel_filename(w.name)[0] for w in source.glob("*.whl")} - best.keys())
if skipped:
    sys.exit(f"no wheel of {', '.join(skipped)} fits this Python")
EOF
}

environment() {
    { nvidia-smi || echo "nvidia-smi: not available"; } > "$OUT/env.log" 2>&1
    cat > "$WORK/environment.py" <<'EOF'
import importlib, importlib.metadata, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}); cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB; "
          f"{torch.cuda.device_count()} device(s); NCCL {torch.cuda.nccl.version()}")
print("float32 matmul precision:", torch.get_float32_matmul_precision())
missing = []
for name in ("transformers", "safetensors", "numpy", "tokenizers", "yaml", "jinja2", "pytest", "hypothesis", "httpx",
             "pydantic", "fastapi", "starlette", "uvicorn", "prometheus_client", "accelerate", "setproctitle"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except ImportError as err:
        print(f"  {name}: missing ({err})")
        if name not in ("prometheus_client", "accelerate", "setproctitle"):  # not needed by these steps
            missing.append(name)
for name in ("shard_contract.plan", "shard_operator.cli", "shard_worker.runtime", "shard_worker.rank"):
    try:
        importlib.import_module(name)
        print(f"  {name}: {sys.modules[name].__file__}")
    except Exception as err:
        print(f"  {name}: FAILS: {type(err).__name__}: {err}")
        missing.append(name)
print("shard-operator", importlib.metadata.version("shard-operator"))
if missing:
    sys.exit(f"MISSING: {', '.join(missing)}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("CUDA is not available to torch here: every CUDA test would be skipped")
EOF
    local rc=0
    bounded 45 "$OUT/env-python.log" "$PY" "$WORK/environment.py" "$DEVICE" || rc=$?
    cat "$OUT/env-python.log" >> "$OUT/env.log"
    return "$rc"
}

device_tests() {
    # The cuda parameters only (SHARD_TEST_DEVICES): the cpu ones run on every machine without a GPU.
    local rc=0
    SHARD_TEST_DEVICES=$DEVICE bounded 150 "$OUT/tests.log" "$PY" -m pytest -q -p no:cacheprovider -rfEsP \
        --junitxml="$OUT/tests.xml" tests/worker/test_on_device.py tests/worker/test_gpu_runtime.py || rc=$?
    if grep -q "torch sees no CUDA device" "$OUT/tests.log"; then
        echo "device tests: skipped, torch sees no CUDA device"
        return 1
    fi
    return "$rc"
}

bench() {
    local waited=0 rc=0
    while kill -0 "$PREPARE" 2>/dev/null && [ "$waited" -lt 30 ]; do sleep 1; waited=$((waited + 1)); done
    kill "$PREPARE" 2>/dev/null && echo "the checkpoint was not written within 30 s of the tests' end: stopped"
    wait "$PREPARE" || rc=$?
    [ "$rc" -eq 0 ] || echo "writing the checkpoint in the background failed (bench-prepare.log); the bench tries again"
    bounded 130 "$OUT/bench.log" "$PY" bench/gpu_decode.py --device "$DEVICE" "${BENCH[@]}" --model-dir "$MODEL" \
        --out "$OUT/gpu_bench.json"
}

[ -n "${WHEELS:-}" ] && step "wheels from $WHEELS" wheels
step environment environment
echo "=== $(now) writing the bench's checkpoint in the background (bench-prepare.log)"
"$PY" bench/gpu_decode.py --prepare "${BENCH[@]}" --model-dir "$MODEL" > "$OUT/bench-prepare.log" 2>&1 &
PREPARE=$!
step "device tests" device_tests
step "decode bench" bench

{
    echo "shard-operator device check, $(now) UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    printf '%s\n' "${STATUS[@]}"
} | tee "$OUT/summary.txt"
exit "$FAILED"
