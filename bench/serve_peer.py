"""Serving against a peer: our group and llama.cpp's `llama-server`, on the same model and cores.

Both serve the demo model (byte-level BPE vocabulary; ours from safetensors, llama-server from a
GGUF of the same weights, bench/llamacpp_peer.py `convert-vocab`), one after the other, each with
the same threads and as many parallel sequences as the most clients, at least 9 (8 short streams
and a long prompt: scenario 2) (ours: maxBatchSize; theirs: `--parallel` slots with continuous
batching, each slot a share of `--ctx-size`), keys and values in the model's dtype on both
(llama-server's `-ctk`/`-ctv`). Streaming clients send prompts of token ids, greedy,
EOS ignored; both servers get the same client (bench/peer_client.py: a fresh connection per
request), and every request is counted, a failed one with its reason.

1. Throughput and latency at 1, 4, 16 and 64 concurrent clients for a fixed time: generated
   tokens/s, TTFT p50/p99, ITL (the gaps between a stream's successive chunks) p50/p99. Prompts
   are drawn per phase, client count and client: no phase repeats another's.
2. A long prompt (1900 tokens) joining 8 running short streams (320 tokens each, so that they
   still run when it has its first token): the short streams' longest inter-token gap over the
   long request's life, against their longest gap (steady part) without it; the long one's TTFT
   and how many short streams ran through its join.
3. 32 requests sharing a 1k-token system prompt (each with its own short tail), 8 at a time:
   TTFT with the prefix cached (after one request has filled it), against the same requests each
   with a 1k-token system prompt of its own (nothing to reuse, whatever the server's flags).
4. More requests than the KV cache holds (4x the parallel sequences at once, each a 48-token
   prompt and 24 new tokens), on a server of its own whose KV cache holds about half of what the
   parallel sequences need (a multiple of 256 tokens: llama.cpp rounds its context so): ours
   planned with spec.serving.kvCacheMemory of that many tokens, preempting by recompute (the
   preemptions our /metrics counts); llama-server with `--ctx-size` that many tokens in one KV
   buffer all slots share (`--kv-unified`: per-slot contexts are at least 256 tokens each, so 64
   slots could never hold less than 16k). All answered? failed? (and its log's KV-full lines).
5. Ours only: the KV cache the leader holds (its report's allocated bytes) against the memory its
   plan leaves free; our group is planned with spec.serving.kvCacheMemoryFraction 0.9.

At the end it prints issue 28's goals as ratios of this one run, matched by client count and
scenario (bench/peer_report.py): a side that failed or was not run says so with its reason. The
JSON (`--out`, default /tmp/serve_peer-<time>.json) is written again as each phase ends, so a
run cut short keeps what it measured; `--combine` prints the report of such files.

The whole run is bounded: `--budget SECONDS` (default 1800) is split between the servers, each
phase is given what is left of its server's share (a phase that cannot start or finish in it is
recorded as not measured), and `--quick` is a smoke run (clients 1 and 4 unless given, 2 s each,
shorter scenarios: a few minutes).

llama-server is built from llama-cpp-python's source, as bench/decode.py's peers are (once, kept
in ~/.cache/shard-operator):

    pip download --no-deps --no-binary :all: llama-cpp-python -d ~/.cache/shard-operator/src  # then untar
    cmake -S ~/.cache/shard-operator/src/llama_cpp_python-*/vendor/llama.cpp \\
          -B ~/.cache/shard-operator/server-build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build ~/.cache/shard-operator/server-build --target llama-server

The GGUF conversion runs the vendored gguf-py (`LLAMA_CPP_SRC`, default: the newest of those
sources) with this interpreter. Usage:

    nice .venv/bin/python bench/serve_peer.py [--clients 1,4,16,64] [--seconds 20] [--skip-peer]
                                              [--scenarios long,prefix,overflow] [--out FILE.json]
                                              [--skip-ours] [--combine OURS.json PEER.json]
                                              [--quick] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx

from shard_contract.plan import Plan
from shard_contract.sharding import kv_pool_tokens, kv_whole_blocks
from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import free_port, plan_local

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from peer_client import Server, client_of, counter, kv_of_free, load, long_joins, overflow, shared_prefix, stream
from peer_report import (
    OURS,
    PEER,
    SERVERS,
    long_summary,
    overflow_summary,
    prefix_summary,
    table,
    throughput_row,
)
from served import served

CACHE = Path.home() / ".cache" / "shard-operator"
SERVER = Path(os.environ.get("LLAMA_SERVER", CACHE / "server-build" / "bin" / "llama-server"))
MAX_LEN = 2048
SYSTEM_PROMPT = 1024
SCENARIO_ROWS = 9  # scenario 2: 8 short streams and the long prompt run at once
KV_FRACTION = 0.9  # ours: spec.serving.kvCacheMemoryFraction
LLAMA_CTX_ROUND = 256  # llama.cpp rounds a context up to this
LLAMA_FULL = ("failed to find free space in the KV cache", "Context size has been exceeded", "purging slot")


class Budget:
    """What is left of a share of the run's time."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def phase(budget: Budget, coro, least: float = 5.0) -> tuple[object, str | None]:
    """Run `coro` within what is left of `budget`: (its value, None), or (None, why it was not measured)."""
    if budget.left() < least:
        coro.close()
        return None, f"{max(budget.left(), 0):.0f} s of the budget left"
    try:
        return asyncio.run(asyncio.wait_for(coro, budget.left())), None
    except TimeoutError:
        return None, "ran past the budget"
    except Exception as err:  # noqa: BLE001 - the run goes on; the reason is recorded
        traceback.print_exc()
        return None, f"{type(err).__name__}: {err}"


class Record:
    """The run's results, written to `path` again whenever a phase ends (replaced whole)."""

    def __init__(self, path: Path, run: dict):
        self.path, self.results = path, {"run": run}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1))
        os.replace(tmp, self.path)


@contextmanager
def ours(plan: Plan, model_dir: Path, threads: int, ready_seconds: float) -> Iterator[Server]:
    with served(plan, model_dir, threads=threads, ready_seconds=max(ready_seconds, 30)) as (url, _):
        yield Server(OURS, url, llama=False)


def our_plans(model_dir: Path, parallel: int, kv_tokens: int) -> tuple[Plan, Plan]:
    """Our main group (the KV cache 0.9 of the free memory) and the overflow scenario's group:
    the same, with a KV cache of `kv_tokens` (spec.serving.kvCacheMemory of their bytes)."""
    main = plan_local(model_dir, 1, 1, max_model_len=MAX_LEN, max_batch_size=parallel,
                      devices="localhost:16GiB", device_kind="cpu", kv_cache_memory_fraction=KV_FRACTION)
    rank = main.ranks[0]
    per_token = rank.predicted_bytes.kv_cache // kv_pool_tokens(rank.kv_cache_tokens)
    small = plan_local(model_dir, 1, 1, max_model_len=min(MAX_LEN, kv_tokens), max_batch_size=parallel,
                       devices="localhost:16GiB", device_kind="cpu",
                       kv_cache_memory=f"{kv_pool_tokens(kv_tokens) * per_token}B")
    if small.kv_cache_tokens != kv_tokens:
        raise RuntimeError(f"the overflow group holds {small.kv_cache_tokens} tokens, not {kv_tokens}")
    return main, small


def overflow_sizes(parallel: int, length: int) -> tuple[int, int, int]:
    """(prompt tokens, new tokens, KV tokens) of scenario 4: requests of `length` / 2 + `length` / 4
    tokens, and a cache of about half of what `parallel` of them take (whole blocks), rounded to
    llama.cpp's granularity."""
    prompt, new = length // 2, length // 4
    half = parallel * kv_whole_blocks(prompt + new) // 2
    return prompt, new, max(LLAMA_CTX_ROUND, round(half / LLAMA_CTX_ROUND) * LLAMA_CTX_ROUND)


def gguf_of(model_dir: Path, kind: str) -> Path:
    src = os.environ.get("LLAMA_CPP_SRC") or str(sorted(p for p in (CACHE / "src").glob("llama_cpp_python-*")
                                                        if p.is_dir())[-1])
    env = {**os.environ, "PYTHONPATH": str(Path(src) / "vendor" / "llama.cpp" / "gguf-py")}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "llamacpp_peer.py"), "convert-vocab", str(model_dir),
                          kind], capture_output=True, text=True, env=env, check=True)
    return Path(json.loads(out.stdout)["path"])


@contextmanager
def llama_server(gguf: Path, parallel: int, threads: int, ctx: int, ready_seconds: float, kv_type: str,
                 unified: bool = False, log: Path = Path("/tmp/serve_peer-llama-server.log")) -> Iterator[Server]:
    """llama-server with `parallel` slots sharing `ctx` tokens (each `ctx / parallel`, or, with
    `unified`, one buffer all slots share) of keys and values in `kv_type` (ours are in the
    model's dtype; llama-server's default, f16, would halve what its attention reads), its log in
    a file (a pipe nobody reads would fill),
    ready once it has answered a real streamed completion (its /health says 200 when the model
    is loaded; the first completion is what the run needs)."""
    port = free_port()
    cmd = [str(SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-c", str(ctx), "-ctk", kv_type, "-ctv", kv_type, "-cb",
           "--no-webui",
           *(["--kv-unified"] if unified else [])]
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    server = Server(PEER, url, llama=True)

    def tail() -> str:
        return log.read_text(errors="replace")[-2000:]

    try:
        deadline, why = time.monotonic() + max(ready_seconds, 30), "not started"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: {tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready in {ready_seconds:.0f} s ({why}): {tail()}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    asyncio.run(ready(server))
                    break
                why = "/health not 200"
            except (httpx.HTTPError, RuntimeError) as err:
                why = f"{type(err).__name__}: {err}"
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is not None and proc.returncode != 0:
            print(f"llama-server exited {proc.returncode} while measured; its log: {log}\n{tail()}",
                  file=sys.stderr, flush=True)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # it waits for its slots' tasks: they are ours, and over
            proc.kill()
            proc.wait(30)


async def ready(server: Server) -> None:
    async with client_of(server, 120) as http:
        result = await stream(http, server, [1, 5, 6, 7], 2)
    if result["error"]:
        raise RuntimeError(result["error"])


def log_counts(path: Path, markers: tuple[str, ...]) -> dict[str, int]:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return {m: text.count(m) for m in markers}


Start = Callable[[float], AbstractContextManager[Server]]


def run_main(start: Start, args, vocab: int, budget: Budget, record: Record, out: dict) -> None:
    """Phases 1-3 (and 5, ours) on one server, each within what is left of `budget`."""
    s = out["scenarios"]

    def measured(key: str, value: dict) -> None:
        s[key] = value
        record.save()
        print(json.dumps({out["name"]: {key: value}}), file=sys.stderr, flush=True)

    with start(budget.left()) as server:
        phase(budget, load(server, 1, 0, 4, vocab, seed="warm-up"))  # one request first: both warm up
        for clients in args.clients:
            results, why = phase(budget, load(server, clients, args.seconds, args.max_tokens, vocab),
                                 args.seconds + 5)
            out["throughput"].append({"clients": clients, "not_measured": why} if results is None else
                                     throughput_row(clients, results, os.getloadavg()[0]))
            record.save()
            print(json.dumps({out["name"]: out["throughput"][-1]}), file=sys.stderr, flush=True)
        if "long" in args.scenarios:
            for key, with_long in (("long_alone", False), ("long_joined", True)):
                value, why = phase(budget, long_joins(server, vocab, with_long, args.short_tokens, args.long_len))
                measured(key, {"not_measured": why} if value is None else long_summary(*value))
        if "prefix" in args.scenarios:
            for key, cached in (("prefix_cached", True), ("prefix_uncached", False)):
                value, why = phase(budget, shared_prefix(server, vocab, cached, args.prefix_rounds, SYSTEM_PROMPT))
                measured(key, {"not_measured": why} if value is None else prefix_summary(value))
        if not server.llama:
            try:
                out["kv"] = kv_of_free(server.url)
            except (httpx.HTTPError, KeyError, ZeroDivisionError) as err:
                out["kv"] = {"not_measured": f"{type(err).__name__}: {err}"}
            record.save()


def run_overflow(start: Start, args, vocab: int, parallel: int, budget: Budget, record: Record, out: dict,
                 llama_log: Path | None) -> None:
    """Phase 4 on a server of its own whose KV cache holds about half of what its rows need."""
    prompt, new, kv_tokens = overflow_sizes(parallel, args.overflow_len)
    facts = {"kv_tokens": kv_tokens, "demand_tokens": parallel * kv_whole_blocks(prompt + new)}
    with start(budget.left()) as server:
        before = None if server.llama else counter(server.url, "shard_preemptions")
        results, why = phase(budget, overflow(server, vocab, args.overflow_factor * parallel, prompt, new))
        value = {"not_measured": why} if results is None else {**overflow_summary(results, new), **facts}
        if results is not None and before is not None:
            value["preemptions"] = counter(server.url, "shard_preemptions") - before
        if results is not None and llama_log is not None:
            value["log"] = log_counts(llama_log, LLAMA_FULL)
    out["scenarios"]["overflow"] = value
    record.save()
    print(json.dumps({out["name"]: {"overflow": value}}), file=sys.stderr, flush=True)


def reason(err: Exception) -> str:
    traceback.print_exc()
    return f"{type(err).__name__}: {err}"[:300]


def run_server(name: str, main: Start, small: Start, args, vocab: int, parallel: int, budget: Budget,
               record: Record, llama_log: Path | None = None) -> None:
    """Every phase on one server; a server that fails to start or fails mid-run is recorded with
    its reason (what it measured before stays), and the run goes on."""
    out = record.results[name] = {"name": name, "throughput": [], "scenarios": {}}
    start = time.monotonic()
    try:
        run_main(main, args, vocab, budget, record, out)
    except Exception as err:  # noqa: BLE001 - recorded; the run goes on
        out["not_measured"] = reason(err)
    if "overflow" in args.scenarios:
        try:
            run_overflow(small, args, vocab, parallel, budget, record, out, llama_log)
        except Exception as err:  # noqa: BLE001 - recorded; the run goes on
            out["scenarios"]["overflow"] = {"not_measured": reason(err)}
    out["seconds"] = time.monotonic() - start
    record.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the demo model in .cache/)")
    parser.add_argument("--clients", help="client counts (default 1,4,16,64; --quick: 1,4)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="F32", choices=["F32", "BF16"],
                        help="the GGUF's: the same as the model's (the demo model: float32)")
    parser.add_argument("--scenarios", default="long,prefix,overflow")
    parser.add_argument("--overflow-len", type=int, default=96,
                        help="scenario 4: a request's prompt is half of it, its new tokens a quarter")
    parser.add_argument("--overflow-factor", type=int, default=4, help="scenario 4: requests per parallel sequence")
    parser.add_argument("--short-tokens", type=int, default=320, help="scenario 2: tokens of each short stream")
    parser.add_argument("--long-len", type=int, default=1900, help="scenario 2: the long prompt's tokens")
    parser.add_argument("--prefix-rounds", type=int, default=4, help="scenario 3: rounds of 8 requests")
    parser.add_argument("--budget", type=float, default=1800.0,
                        help="seconds for the whole run, split between the servers (each phase within what is left)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: clients 1,4, 2 s each, 16 tokens, shorter scenarios, a 900 s budget")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--out", type=Path, help="the JSON, written as each phase ends "
                                                 "(default /tmp/serve_peer-<UTC time>.json)")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="only print the report of earlier runs' --out files")
    args = parser.parse_args()
    if args.combine:
        print(table({k: v for path in args.combine for k, v in json.loads(path.read_text()).items() if k in SERVERS}))
        return 0
    if args.quick:
        args.clients = args.clients or "1,4"
        args.seconds, args.max_tokens, args.short_tokens, args.long_len, args.prefix_rounds = 2.0, 16, 96, 512, 1
        args.budget = min(args.budget, 900.0)
    args.clients = [int(c) for c in (args.clients or "1,4,16,64").split(",")]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    model_dir = args.model or REPO / ".cache" / "demo-model"
    if not (model_dir / "config.json").is_file():
        write_demo_model(model_dir, DemoShape(), overwrite=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    parallel = max(*args.clients, SCENARIO_ROWS)
    _, _, kv_tokens = overflow_sizes(parallel, args.overflow_len)
    out_path = args.out or Path(time.strftime("/tmp/serve_peer-%Y%m%dT%H%M%SZ.json", time.gmtime()))
    record = Record(out_path, {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "parallel": parallel, "cpus": os.cpu_count()})
    print(f"serve_peer: results in {out_path} (written as each phase ends)", file=sys.stderr, flush=True)
    start, servers = time.monotonic(), 2 - args.skip_ours - args.skip_peer
    if not args.skip_ours:
        try:
            main_plan, small_plan = our_plans(model_dir, parallel, kv_tokens)
        except Exception as err:  # noqa: BLE001 - recorded; the peer still runs
            record.results[OURS] = {"not_measured": reason(err)}
        else:
            run_server(OURS, lambda ready: ours(main_plan, model_dir, args.threads, ready),
                       lambda ready: ours(small_plan, model_dir, args.threads, ready),
                       args, vocab, parallel, Budget(args.budget / max(servers, 1)), record)
    if not args.skip_peer:
        try:
            if not SERVER.is_file():
                raise FileNotFoundError(f"no {SERVER}: see this script's docstring")
            gguf = gguf_of(model_dir, args.dtype)
        except Exception as err:  # noqa: BLE001 - recorded
            record.results[PEER] = {"not_measured": reason(err)}
        else:
            small_log = Path("/tmp/serve_peer-llama-server-overflow.log")
            kv_type = {"F32": "f32", "BF16": "bf16"}[args.dtype]
            run_server(PEER, lambda ready: llama_server(gguf, parallel, args.threads, parallel * MAX_LEN, ready,
                                                        kv_type),
                       lambda ready: llama_server(gguf, parallel, args.threads, kv_tokens, ready, kv_type,
                                                  unified=True, log=small_log),
                       args, vocab, parallel, Budget(args.budget - (time.monotonic() - start)), record,
                       llama_log=small_log)
    record.results["run"]["seconds"] = time.monotonic() - start
    record.save()
    print(table({k: v for k, v in record.results.items() if k in SERVERS}))
    print(f"\nserve_peer: results in {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
