"""Serving against a peer: our group and llama.cpp's `llama-server`, on the same model and cores.

Both serve the demo model (byte-level BPE vocabulary; ours from safetensors, llama-server from a
GGUF of the same weights, bench/llamacpp_peer.py `convert-vocab`), one after the other, each with
the same threads and as many parallel sequences as the most clients (ours: maxBatchSize; theirs:
`--parallel` slots with continuous batching, each slot a share of `--ctx-size`). Streaming
clients send prompts of token ids, greedy, EOS ignored.

1. Throughput and latency at 1, 4, 16 and 64 concurrent clients for a fixed time: generated
   tokens/s, TTFT p50/p99, ITL (the gaps between a stream's successive chunks) p50/p99.
2. A long prompt (1900 tokens) joining 8 running short streams: the short streams' longest
   inter-token gap while it joins, against the same streams without it; the long one's TTFT.
3. 32 requests sharing a 1k-token system prompt (each with its own short tail), 8 at a time:
   TTFT with the prefix cached (after one request has filled it), against the same requests each
   with a 1k-token system prompt of its own (nothing to reuse, whatever the server's flags).
4. More requests than the KV cache holds at once (4x the parallel sequences, each as long as a
   sequence may be): all answered? and the preemptions our /metrics counts.
5. Ours only: the KV cache the leader holds (its report's allocated bytes) against the memory its
   plan leaves free (usable less weights, activations, overhead and staging); our group is planned
   with spec.serving.kvCacheMemoryFraction 0.9.

At the end it prints issue 28's goals as ratios of this one run, each with its target: tokens/s
ours / llama-server at every client count (>= 1), the short streams' longest gap with the long
prompt joining / without it (<= 2, each server), a shared prefix's TTFT uncached / cached (>= 3,
each server), and KV cache held / free memory (>= 0.9, ours). A goal whose inputs were not
measured (a server skipped, a phase past the budget) says so.

The whole run is bounded: `--budget SECONDS` (default 1500) is split between the servers, each
phase is given what is left of its server's share (a phase that cannot start or finish in it is
recorded as not run), and `--quick` shortens every phase (2 s per client count, shorter scenarios:
a smoke run of a few minutes).

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
import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import free_port, plan_local

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from served import served

CACHE = Path.home() / ".cache" / "shard-operator"
SERVER = Path(os.environ.get("LLAMA_SERVER", CACHE / "server-build" / "bin" / "llama-server"))
MAX_LEN = 2048
LONG_PROMPT = 1900
SYSTEM_PROMPT = 1024
KV_FRACTION = 0.9  # ours: spec.serving.kvCacheMemoryFraction
# issue 28's goals: (name, what, target, at least?)
GOALS = {"tokens_per_s": 1.0, "long_gap": 2.0, "prefix_ttft": 3.0, "kv_of_free": 0.9}


class Budget:
    """What is left of a share of the run's time."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def bounded(budget: Budget, coro, least: float = 5.0) -> dict | float | list | None:
    """Run `coro` within what is left of `budget`; None when too little is left or it ran past it."""
    if budget.left() < least:
        coro.close()
        return None
    try:
        return asyncio.run(asyncio.wait_for(coro, budget.left()))
    except TimeoutError:
        return None
    except httpx.HTTPError as err:  # a server that drops a stream: this phase is not measured, the run goes on
        print(f"phase failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return None


# Connections idle longer than this are not reused: llama-server (cpp-httplib) closes a kept-alive
# connection after 5 s idle, and a request sent on it as it closes fails with RemoteProtocolError
# (a busy machine makes such gaps common). Both servers get the same client.
KEEPALIVE_EXPIRY = 1.0


def client_of(server: Server, timeout: float = 900) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=timeout,
                             limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Server:
    """How to talk to one server: its URL, its completion route and body, and where its tokens are."""

    name: str
    url: str
    llama: bool

    def body(self, prompt: list[int], max_tokens: int, cache: bool = True) -> tuple[str, dict]:
        if self.llama:
            return "/completion", {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                                   "stream": True, "return_tokens": True, "cache_prompt": cache}
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                   "stream": True}

    def tokens(self, chunk: dict) -> int:
        if self.llama:
            return len(chunk.get("tokens") or [])
        return len(chunk["choices"][0].get("token_ids") or [])

    def total(self, chunk: dict) -> int | None:
        """The tokens the whole stream generated, where its last chunk says (llama-server's final
        chunk has `tokens_predicted`: the last token of a stream that hits n_predict is not sent
        as a chunk of its own)."""
        return chunk.get("tokens_predicted") if self.llama and chunk.get("stop") else None


async def stream(http: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int,
                 cache: bool = True, first: asyncio.Event | None = None) -> dict:
    """One streaming request: its start, the (time, tokens) of each chunk, and its end; `first` is
    set at its first tokens."""
    path, body = server.body(prompt, max_tokens, cache)
    start, events, total = time.monotonic(), [], None
    async with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n, total = server.tokens(chunk), server.total(chunk) or total
            if n:
                events.append((time.monotonic(), n))
                if first is not None:
                    first.set()
    return {"start": start, "end": time.monotonic(), "events": events,
            "tokens": total if total is not None else sum(n for _, n in events),
            "ttft": (events[0][0] if events else time.monotonic()) - start}


def gaps(result: dict) -> list[float]:
    times = [t for t, _ in result["events"]]
    return [b - a for a, b in itertools.pairwise(times)]


def prompt_of(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


async def load(server: Server, clients: int, seconds: float, max_tokens: int, vocab: int) -> list[dict]:
    results: list[dict] = []
    deadline = time.monotonic() + seconds

    async def one(i: int) -> None:
        rng = random.Random(i)
        sent = 0
        while time.monotonic() < deadline or not sent:  # each client one request at least
            sent += 1
            results.append(await stream(http, server, prompt_of(rng, rng.randrange(8, 40), vocab), max_tokens))

    async with client_of(server) as http:
        await asyncio.gather(*(one(i) for i in range(clients)))
    return results


def throughput_row(server: Server, clients: int, results: list[dict]) -> dict:
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    itl = [g for r in results for g in gaps(r)]
    ttft = [r["ttft"] for r in results]
    return {"server": server.name, "clients": clients, "requests": len(results),
            "tokens_per_s": sum(r["tokens"] for r in results) / span,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99), "load": os.getloadavg()[0]}


async def long_joins(server: Server, vocab: int, with_long: bool, short_tokens: int = 96) -> dict:
    """8 short streams; with `with_long`, a 1900-token prompt joins once each has its first token."""
    rng = random.Random(7)
    async with client_of(server) as http:
        started = [asyncio.Event() for _ in range(8)]
        shorts = [asyncio.create_task(stream(http, server, prompt_of(rng, 16, vocab), short_tokens, first=e))
                  for e in started]
        try:
            long = None
            if with_long:
                await asyncio.gather(*(e.wait() for e in started))
                long = await stream(http, server, prompt_of(rng, LONG_PROMPT, vocab), 8)
            done = await asyncio.gather(*shorts)
        finally:  # past the budget, or a stream failed: none of them outlives the phase
            for task in shorts:
                task.cancel()
            await asyncio.gather(*shorts, return_exceptions=True)
    return {"worst_gap": max(max(gaps(r), default=0.0) for r in done),
            "long_ttft": long["ttft"] if long else None}


async def shared_prefix(server: Server, vocab: int, cached: bool, rounds: int = 4) -> float:
    """Mean TTFT of 8 x `rounds` requests (8 at a time) whose prompts are a 1k-token system prompt
    and a short tail. Cached: one system prompt for all, after one request has filled the cache;
    uncached: a system prompt of the same length of its own for each request, so no server finds
    a prefix to reuse (the same requests' work, whatever a server's flags)."""
    rng = random.Random(11)
    system = prompt_of(rng, SYSTEM_PROMPT, vocab)
    async with client_of(server) as http:
        await stream(http, server, system + [5, 6, 7], 2)  # fills the cache (when there is one)
        ttfts = []
        for _ in range(rounds):
            heads = [system if cached else prompt_of(rng, SYSTEM_PROMPT, vocab) for _ in range(8)]
            batch = [stream(http, server, head + prompt_of(rng, 8, vocab)[1:], 4) for head in heads]
            ttfts += [r["ttft"] for r in await asyncio.gather(*batch)]
    return sum(ttfts) / len(ttfts)


async def overflow(server: Server, vocab: int, parallel: int, max_len: int, factor: int = 4) -> dict:
    rng = random.Random(13)
    n = factor * parallel
    async with client_of(server, 1800) as http:
        results = await asyncio.gather(*(stream(http, server, prompt_of(rng, max_len // 2, vocab), max_len // 4)
                                         for _ in range(n)), return_exceptions=True)
    answered = sum(1 for r in results if isinstance(r, dict) and r["tokens"] == max_len // 4)
    return {"requests": n, "answered": answered}


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return float("nan")


def kv_of_free(url: str) -> dict:
    """The leader's KV cache against the memory its plan leaves free (scenario 5)."""
    shards = httpx.get(url + "/v1/shards", timeout=30).json()
    entry = shards["ranks"][0]
    plan, report = entry["plan"], entry.get("report") or {}
    p = plan["predicted_bytes"]
    free = plan["usable_bytes"] - (p["weights"] + p["activations"] + p["overhead"] + p.get("staging", 0))
    held = (report.get("allocated_bytes") or {}).get("kv_cache", 0)
    return {"free_bytes": free, "planned_kv_bytes": p["kv_cache"], "held_kv_bytes": held,
            "planned_tokens": plan["kv_cache_tokens"], "held_tokens": shards["kv_cache_tokens"],
            "planned_of_free": p["kv_cache"] / free, "held_of_free": held / free}


@contextmanager
def ours(model_dir: Path, parallel: int, threads: int, max_len: int, ready_seconds: float = 600) -> Iterator[Server]:
    plan = plan_local(model_dir, 1, 1, max_model_len=max_len, max_batch_size=parallel,
                      devices="localhost:16GiB", device_kind="cpu", kv_cache_memory_fraction=KV_FRACTION)
    with served(plan, model_dir, threads=threads, ready_seconds=max(ready_seconds, 30)) as (url, _):
        yield Server("shard-operator", url, llama=False)


def gguf_of(model_dir: Path, kind: str) -> Path:
    src = os.environ.get("LLAMA_CPP_SRC") or str(sorted(p for p in (CACHE / "src").glob("llama_cpp_python-*")
                                                        if p.is_dir())[-1])
    env = {**os.environ, "PYTHONPATH": str(Path(src) / "vendor" / "llama.cpp" / "gguf-py")}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "llamacpp_peer.py"), "convert-vocab", str(model_dir),
                          kind], capture_output=True, text=True, env=env, check=True)
    return Path(json.loads(out.stdout)["path"])


@contextmanager
def llama_server(gguf: Path, parallel: int, threads: int, max_len: int,
                 ready_seconds: float = 300) -> Iterator[Server]:
    """llama-server with `parallel` slots of `max_len` tokens each (`-c` is the slots' total), its
    log in a file (a pipe nobody reads would fill), ready once it has answered a real streamed
    completion (its /health says 200 when the model is loaded; the first completion is what the
    run needs)."""
    port = free_port()
    cmd = [str(SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * max_len), "-cb", "--no-webui"]
    log = Path(os.environ.get("LLAMA_SERVER_LOG", "/tmp/serve_peer-llama-server.log"))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    server = Server("llama-server", url, llama=True)

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
            except httpx.HTTPError as err:
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
        await stream(http, server, [1, 5, 6, 7], 2)


def run_server(make, args, vocab: int, parallel: int, budget: Budget) -> dict:
    """Every phase on one server, each within what is left of `budget` (a phase past it: None)."""
    out: dict = {"throughput": [], "scenarios": {}, "budget_seconds": budget.left()}
    with make(parallel, budget.left()) as server:
        bounded(budget, load(server, 1, 0, 4, vocab))  # one request first: both warm up
        for clients in args.clients:
            results = bounded(budget, load(server, clients, args.seconds, args.max_tokens, vocab), args.seconds + 5)
            if results:
                out["throughput"].append(throughput_row(server, clients, results))
                print(json.dumps(out["throughput"][-1]), file=sys.stderr, flush=True)
        s = out["scenarios"]
        if "long" in args.scenarios:
            s["long_alone"] = bounded(budget, long_joins(server, vocab, False, args.short_tokens))
            s["long_joined"] = bounded(budget, long_joins(server, vocab, True, args.short_tokens))
        if "prefix" in args.scenarios:
            s["prefix_ttft_cached"] = bounded(budget, shared_prefix(server, vocab, True, args.prefix_rounds))
            s["prefix_ttft_uncached"] = bounded(budget, shared_prefix(server, vocab, False, args.prefix_rounds))
        if "overflow" in args.scenarios:
            before = counter(server.url, "shard_preemptions") if not server.llama else float("nan")
            s["overflow"] = bounded(budget, overflow(server, vocab, parallel, args.overflow_len, args.overflow_factor))
            if s["overflow"] is not None:
                s["overflow"]["preemptions"] = (counter(server.url, "shard_preemptions") - before) \
                    if not server.llama else None
        if not server.llama:
            out["kv"] = kv_of_free(server.url)
        print(json.dumps({server.name: s}), file=sys.stderr, flush=True)
    out["seconds"] = out.pop("budget_seconds") - budget.left()
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(results: dict) -> list[tuple[str, float | None, str, bool | None]]:
    """Issue 28's goals as ratios of this run: (what, value, target, met); None where not measured."""
    rows = []
    ours_, peer = results.get("shard-operator"), results.get("llama-server")
    if ours_ and peer:
        theirs = {r["clients"]: r["tokens_per_s"] for r in peer["throughput"]}
        for r in ours_["throughput"]:
            value = ratio(r["tokens_per_s"], theirs.get(r["clients"]))
            rows.append((f"tokens/s ours / llama-server, {r['clients']} clients", value, ">= 1",
                         None if value is None else value >= GOALS["tokens_per_s"]))
    for name, out in results.items():
        s = out["scenarios"]
        alone, joined = s.get("long_alone"), s.get("long_joined")
        value = ratio(joined and joined["worst_gap"], alone and alone["worst_gap"])
        rows.append((f"{name}: short streams' longest gap, 2k prompt joining / alone", value, "<= 2",
                     None if value is None else value <= GOALS["long_gap"]))
        value = ratio(s.get("prefix_ttft_uncached"), s.get("prefix_ttft_cached"))
        rows.append((f"{name}: 1k shared prefix TTFT, uncached / cached", value, ">= 3",
                     None if value is None else value >= GOALS["prefix_ttft"]))
    if ours_ and ours_.get("kv"):
        value = ours_["kv"]["held_of_free"]
        rows.append(("shard-operator: KV cache held / free memory of its plan", value, ">= 0.9",
                     value >= GOALS["kv_of_free"]))
    return rows


def table(results: dict) -> str:
    lines = ["| server | clients | requests | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | load |",
             "|---|---|---|---|---|---|---|"]
    for name, out in results.items():
        for r in out["throughput"]:
            lines.append(f"| {name} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                         f"{r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | {1e3 * r['itl_p50']:.1f} / "
                         f"{1e3 * r['itl_p99']:.1f} | {r['load']:.1f} |")
    if len(results) == 2:
        a, b = (results[n]["throughput"] for n in ("shard-operator", "llama-server"))
        for x, y in zip(a, b, strict=True):
            lines.append(f"\n{x['clients']} clients: tokens/s ours / llama-server = "
                         f"{x['tokens_per_s'] / y['tokens_per_s']:.2f}")
    for name, out in results.items():
        lines.append(f"\n{name} scenarios: {json.dumps(out['scenarios'])}")
        if out.get("kv"):
            lines.append(f"{name} KV cache: {json.dumps(out['kv'])}")
    lines += ["", "Issue 28's goals, ratios of this run:", "", "| goal | ratio | target | met |", "|---|---|---|---|"]
    for what, value, target, met in goals(results):
        shown = "not measured" if value is None else f"{value:.2f}"
        lines.append(f"| {what} | {shown} | {target} | {'-' if met is None else 'yes' if met else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the demo model in .cache/)")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="F32", choices=["F32", "BF16"],
                        help="the GGUF's: the same as the model's (the demo model: float32)")
    parser.add_argument("--scenarios", default="long,prefix,overflow")
    parser.add_argument("--overflow-len", type=int, default=96, help="scenario 4: prompt + new tokens of each request")
    parser.add_argument("--overflow-factor", type=int, default=4, help="scenario 4: requests per parallel sequence")
    parser.add_argument("--short-tokens", type=int, default=96, help="scenario 2: tokens of each short stream")
    parser.add_argument("--prefix-rounds", type=int, default=4, help="scenario 3: rounds of 8 requests")
    parser.add_argument("--budget", type=float, default=1500.0,
                        help="seconds for the whole run, split between the servers (each phase within what is left)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 s per client count, 16 tokens, shorter scenarios, a 600 s budget")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="only print the table of earlier runs' --out files (one server each)")
    args = parser.parse_args()
    if args.combine:
        print(table({k: v for path in args.combine for k, v in json.loads(path.read_text()).items()}))
        return 0
    if args.quick:
        args.seconds, args.max_tokens, args.short_tokens, args.prefix_rounds = 2.0, 16, 32, 1
        args.overflow_len, args.overflow_factor = 48, 2
        args.budget = min(args.budget, 600.0)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    model_dir = args.model or REPO / ".cache" / "demo-model"
    if not (model_dir / "config.json").is_file():
        write_demo_model(model_dir, DemoShape(), overwrite=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    parallel = max(args.clients)
    start, servers = time.monotonic(), 2 - args.skip_ours - args.skip_peer
    results = {} if args.skip_ours else {
        "shard-operator": run_server(lambda p, ready: ours(model_dir, p, args.threads, MAX_LEN, ready), args, vocab,
                                     parallel, Budget(args.budget / max(servers, 1)))}
    if not args.skip_peer:
        if not SERVER.is_file():
            print(f"no {SERVER}: see this script's docstring", file=sys.stderr)
        else:
            gguf = gguf_of(model_dir, args.dtype)
            left = args.budget - (time.monotonic() - start)
            results["llama-server"] = run_server(lambda p, ready: llama_server(gguf, p, args.threads, MAX_LEN, ready),
                                                 args, vocab, parallel, Budget(left))
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
