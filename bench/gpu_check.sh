#!/usr/bin/env bash
# The device check: what a lent GPU machine runs, once, from the repository root (at most 8 minutes):
#
#     OUT=/a/folder/that/comes/back bash bench/gpu_check.sh
#
# It needs torch with CUDA, transformers, safetensors, numpy, tokenizers, pyyaml, jinja2, pytest,
# hypothesis and httpx, plus pydantic, fastapi and uvicorn with their dependencies: importable
# already, or as wheels in the folder $WHEELS (bench/gpu_wheels.sh fetches them), which are
# unpacked for this Python and put on PYTHONPATH. No network and no pip: the repository's packages
# go on PYTHONPATH, and the C decode kernel (CPU only) is not built. Steps, each timed and bounded
# (the bounds, the waits for the checkpoints inside them, add up to 455 s, and nvidia-smi's 10);
# a failed one is reported and the next still runs:
#   0. with $WHEELS: unpack the wheels that fit this Python;
#   1. environment: nvidia-smi, torch and CUDA, every import the other steps need; then both
#      bench checkpoints are written in the background, one after the other (CPU jobs), while
#      step 2 runs (a bench waits for its own within its bound);
#   2. the decode graphs' CUDA tests (`-m cuda` of tests/worker/test_decode_graphs.py): a replayed
#      decode graph gives the eager step's tokens, token for token in float32; a replay does not
#      synchronise; the compiled step, reading the paged pool in place by FlexAttention's Triton
#      template, the tokens of the eager step that gathers each row's context; the step's host
#      copy lands in pinned memory;
#   3. bench/gpu_decode.py on the 853M bench model (bfloat16), then on an 8B-shaped random Llama
#      (bfloat16 and int8, each CUDA int8 product): batch 1, 8 and 32 decode against the
#      measured read limit and the planner's predicted step, and HF transformers' static cache
#      compiled by torch.compile (batch 1) as the peer, after ours in bfloat16 and compiled int8;
#   4. bench/paged_attention.py: one 8B-shaped layer's decode attention over the paged KV cache at
#      batch 32 and 512-8k context in bfloat16, each row's context gathered vs read in place by
#      FlexAttention (times, bytes, and the largest difference);
#   5. bench/gpu_ranks.py: TP=2 and PP=2 as two processes sharing the one GPU over gloo, equal to TP=1;
#   6. the worker on CUDA (`-m cuda` of tests/worker/test_on_device.py: float32 = HF, bfloat16,
#      memory vs plan, int8, offload, `shardctl run`), last: the longest and the oldest code.
# Tests print each result as it comes (-v) and run under a per-test bound where pytest-timeout is
# installed; a step past its bound gets SIGINT 4 s before its end (pytest then writes its failures,
# summary and junit XML), then KILL, and fails (124). A bench child cut off keeps the batches it printed.
# In $OUT: check.log (everything), env.log, tests-graphs.log/.xml, tests-device.log/.xml,
# prepare-*.log, bench-*.log, gpu_bench-*.json (rewritten after each measurement), paged.log,
# paged.json, ranks.log, ranks.json, summary.txt (rewritten after each step): a run cut off keeps
# what it measured. Exit status 0: every step passed.
#
# Known risks no CPU run can remove (read with the first device run's logs):
#   - compile time: FlexAttention's Triton template, the int8 product and HF's static cache are
#     compiled cold in each step's first process (inductor's on-disk cache serves the later ones);
#     were that slower than the bounds allow, the measurements after it read "not run: out of time";
#   - the tiles of FlexAttention's Triton template are set to the KV cache's 16-position blocks
#     (model/paged.py, kernel_options): the choice inductor's lowering requires, not yet seen
#     compiled or timed on a GPU;
#   - the device's image was seen with torch 2.11 (this repository is tested with 2.13): an API
#     the worker uses that 2.11 lacks fails the step that calls it, with its traceback in the log;
#   - a captured decode step (CUDA graphs) calls kernels compiled on their own (FlexAttention, the
#     int8 product): each capture follows an uncaptured run of the same shapes, which compiles
#     them, since a compile inside a capture fails (pytorch/pytorch#131782, #167639); a recompile
#     that only the capture triggered would fail it. Those kernels are compiled with
#     fullgraph=True, for which dynamo's recompile limit is a hard error (2.13; a CUDA rank raises
#     it to 64): a process sees 3-4 variants of the attention kernel here (one row or more, decode
#     step or chunk);
#   - the worker tests come last and are the likeliest to be cut short (each test starts rank
#     processes that compile and capture); each result is printed as it ends;
#   - the benches' plans hold the KV cache their batches need, not 0.9 of the card (the GPU
#     default): the step reads no unused block, but a pool that size is not exercised here.
#
# GPU_CHECK_DRY=1 runs the same steps on the CPU with tiny models, few tokens and batches and HF's
# uncompiled cache; its test steps only collect the device's selection (-m cuda, which a CPU skips):
# a check of this script on a machine without a GPU (tests/packaging/test_gpu_check.py).
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
GRAPH_TESTS=(tests/worker/test_decode_graphs.py)
DEVICE_TESTS=(tests/worker/test_on_device.py)
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
    DEVICE=cpu MODELS=(tiny tiny-8b)
    BENCH=(--tokens 4 --batches 1,2 --int8-modes compiled --hf eager)
    PAGED=(--contexts 64,256 --rows 2 --rounds 1 --reference)  # flex_attention uncompiled: no minutes of compiling
    RUN_TESTS=(--collect-only -q)  # the device's selection, collected: a CPU would skip every one
    # a busy CPU: generous, not a budget
    LIMITS=(environment=60 graphs=150 bench-tiny=150 bench-tiny-8b=150 paged=150 ranks=150 device=150)
else
    DEVICE=cuda MODELS=(bench 8b) BENCH=(--tokens 128 --batches 1,8,32 --int8-modes compiled,int8pack --hf static)
    PAGED=(--contexts 512,2048,8192 --rows 32 --rounds 5 --dtype bfloat16)
    RUN_TESTS=(-v -rfEs --tb=short)
    # 455 s in all, each bound with its waits inside (summary.txt shows what each step took)
    LIMITS=(environment=30 graphs=95 bench-bench=50 bench-8b=130 paged=30 ranks=45 device=75)
    # the 853M model in bfloat16 alone (issue 25 asks its tokens/s); int8 and HF's peer on the 8B
    MODEL_ARGS=(bench="--precisions bfloat16 --hf none")
    TEST_TIMEOUT=60  # one test, at most (pytest-timeout, where installed)
fi
limit() { local kv; for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
model_args() { local kv; for kv in ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
# Each bounded command in a session of its own, so that all it started can be stopped, with
# SIGINT's default restored: a background job of a script ignores SIGINT, and a Python started
# so never turns it into KeyboardInterrupt (pytest's cue to write its report).
cat > "$WORK/sigint.py" <<'EOF'
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
EOF
LAUNCH=("$PY" "$WORK/sigint.py")
if command -v setsid > /dev/null; then LAUNCH=(setsid --wait "${LAUNCH[@]}"); fi

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
    summary > "$OUT/summary.txt"
}

summary() {
    echo "shard-operator device check ($DEVICE), $(now) UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    printf '%s\n' "${STATUS[@]}"
}

bounded() {  # bounded SECONDS LOG COMMAND...: in a session of its own, output to LOG (printed after),
    # done within SECONDS: 4 s before, the session gets SIGINT (pytest then writes its report, a
    # Python bench its traceback), then whatever is left of it (rank processes too) is killed
    local limit=$1 log=$2 rc=0 waited=0 grace=4 stopped=0
    shift 2
    [ "$limit" -gt $((grace + 1)) ] || limit=$((grace + 1))
    : > "$log"  # then appended to, by the command and by the note below alike (no write over another)
    "${LAUNCH[@]}" "$@" >> "$log" 2>&1 < /dev/null &
    local pid=$!
    local group=$pid
    [ "${LAUNCH[0]}" = setsid ] && group=-$pid  # its session's process group
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((limit - grace)) ]; do sleep 1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
        stopped=1
        echo "(stopped after $((limit - grace)) s)" >> "$log"
        kill -INT -- "$group" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
        kill -KILL -- "$group" 2>/dev/null || true
    fi
    wait "$pid" || rc=$?
    kill -KILL -- "$group" 2>/dev/null || true
    cat "$log"
    [ "$stopped" = 0 ] || rc=124  # past its bound: failed, whatever its exit status (as timeout(1) says)
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
    { timeout 10 nvidia-smi || echo "nvidia-smi: not available (or past 10 s)"; } > "$OUT/env.log" 2>&1
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
for name in ("shard_contract.plan", "shard_operator.cli", "shard_worker.rank.runtime", "shard_worker.rank.lifecycle"):
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
    bounded "$(limit environment)" "$OUT/env-python.log" "$PY" "$WORK/environment.py" "$DEVICE" || rc=$?
    cat "$OUT/env-python.log" >> "$OUT/env.log"
    return "$rc"
}

run_tests() {  # run_tests NAME LIMIT FILE...: the files' CUDA tests (-m cuda, SHARD_TEST_DEVICES=cuda)
    local name=$1 bound=$2 rc=0 present=() f extra=()
    shift 2
    for f in "$@"; do [ -f "$f" ] && present+=("$f") || echo "(no $f in this tree)"; done
    if [ -n "${TEST_TIMEOUT:-}" ] && "$PY" -c "import pytest_timeout" 2>/dev/null; then
        extra=(--timeout "$TEST_TIMEOUT")
    fi
    SHARD_TEST_DEVICES=cuda bounded "$bound" "$OUT/tests-$name.log" "$PY" -m pytest -p no:cacheprovider -m cuda \
        "${RUN_TESTS[@]}" ${extra[@]+"${extra[@]}"} --junitxml="$OUT/tests-$name.xml" "${present[@]}" || rc=$?
    if grep -qE "torch sees no CUDA device|needs a CUDA device" "$OUT/tests-$name.log"; then
        echo "$name tests: skipped, torch sees no CUDA device"
        return 1
    fi
    return "$rc"
}

graph_tests() { run_tests graphs "$(limit graphs)" "${GRAPH_TESTS[@]}"; }
device_tests() { run_tests device "$(limit device)" "${DEVICE_TESTS[@]}"; }

bench_model() {  # bench_model MODEL: bench/gpu_decode.py on it, once its checkpoint is written (the wait counts)
    local model=$1 waited=0 rc=0 pid bound
    bound=$(limit "bench-$model")
    # its writer, once the writers before it are done (until then, no pid file: the loop runs)
    while [ "$waited" -lt $((bound / 2)) ]; do
        pid=$(cat "$WORK/prepare-$model.pid" 2>/dev/null || echo "")
        if [ -n "$pid" ]; then kill -0 "$pid" 2>/dev/null || break
        else kill -0 "$PREPARING" 2>/dev/null || break; fi
        sleep 1; waited=$((waited + 1))
    done
    if [ "$waited" -ge $((bound / 2)) ]; then  # not written in time: this bench writes it itself, alone
        pid=$(cat "$WORK/prepare-$model.pid" 2>/dev/null || echo "")
        if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true  # the loop goes on to the next model's
        else kill "$PREPARING" 2>/dev/null || true; fi  # its writer has not started: none will
        echo "the $model checkpoint was not written within $waited s of its turn: its writer stopped"
    fi
    bound=$((bound - waited))
    bounded "$bound" "$OUT/bench-$model.log" "$PY" bench/gpu_decode.py --device "$DEVICE" \
        --model "$model" "${BENCH[@]}" $(model_args "$model") --model-dir "$WORK/model-$model" \
        --out "$OUT/gpu_bench-$model.json" \
        --deadline "$((bound - 8))" || rc=$?
    return "$rc"
}

bench_first() { bench_model "${MODELS[0]}"; }
bench_second() { bench_model "${MODELS[1]}"; }

paged() {  # decode attention over the paged KV cache: each row's context gathered vs read in place
    bounded "$(limit paged)" "$OUT/paged.log" "$PY" bench/paged_attention.py --device "$DEVICE" "${PAGED[@]}" \
        --json "$OUT/paged.json"
}

ranks() {
    bounded "$(limit ranks)" "$OUT/ranks.log" "$PY" bench/gpu_ranks.py --device "$DEVICE" \
        --model-dir "$WORK/model-ranks" --out "$OUT/ranks.json" --timeout "$(( $(limit ranks) - 8 ))"
}

[ -n "${WHEELS:-}" ] && step "wheels from $WHEELS" wheels
step environment environment
rm -f "$WORK"/prepare-*.pid
for model in "${MODELS[@]}"; do  # one after the other, beside the tests (CPU jobs)
    echo "=== $(now) writing the $model checkpoint in the background (prepare-$model.log)"
done
( for model in "${MODELS[@]}"; do
      "$PY" bench/gpu_decode.py --prepare --model "$model" --model-dir "$WORK/model-$model" \
          > "$OUT/prepare-$model.log" 2>&1 &
      echo $! > "$WORK/prepare-$model.pid"
      wait $!
  done ) &
PREPARING=$!
step "decode graph tests" graph_tests
step "decode bench, ${MODELS[0]} model" bench_first
step "decode bench, ${MODELS[1]} model" bench_second
step "paged attention, gathered vs in place" paged
step "two ranks on one device (TP=2, PP=2 over gloo)" ranks
step "worker tests on the device" device_tests

summary | tee "$OUT/summary.txt"
exit "$FAILED"
