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
   TTFT with the prefix cache on (after one request has filled it) and off (llama-server:
   `cache_prompt`; ours: the engine's prefix cache, where it has one).
4. More requests than the KV cache holds at once (4x the parallel sequences, each as long as a
   sequence may be): all answered? and the preemptions our /metrics counts.

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
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import LocalGroup, free_port, plan_local
from shard_operator.local.run import wait_ready

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "shard-operator"
SERVER = Path(os.environ.get("LLAMA_SERVER", CACHE / "server-build" / "bin" / "llama-server"))
MAX_LEN = 2048
LONG_PROMPT = 1900
SYSTEM_PROMPT = 1024


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


async def stream(http: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int,
                 cache: bool = True) -> dict:
    """One streaming request: its start, the (time, tokens) of each chunk, and its end."""
    path, body = server.body(prompt, max_tokens, cache)
    start, events = time.monotonic(), []
    async with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n = server.tokens(json.loads(line[6:]))
            if n:
                events.append((time.monotonic(), n))
    return {"start": start, "end": time.monotonic(), "events": events, "tokens": sum(n for _, n in events),
            "ttft": (events[0][0] if events else time.monotonic()) - start}


def gaps(result: dict) -> list[float]:
    times = [t for t, _ in result["events"]]
    return [b - a for a, b in itertools.pairwise(times)]


def prompt_of(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


async def load(server: Server, clients: int, seconds: float, max_tokens: int, vocab: int) -> list[dict]:
    results: list[dict] = []
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        rng = random.Random(i)
        sent = 0
        while time.monotonic() < deadline or (seconds > 0 and not sent):  # each client one request at least
            sent += 1
            results.append(await stream(http, server, prompt_of(rng, rng.randrange(8, 40), vocab), max_tokens))

    async with httpx.AsyncClient(base_url=server.url, timeout=900) as http:
        await asyncio.gather(*(client(i) for i in range(clients)))
    return results


def throughput_row(server: Server, clients: int, results: list[dict]) -> dict:
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    itl = [g for r in results for g in gaps(r)]
    ttft = [r["ttft"] for r in results]
    return {"server": server.name, "clients": clients, "requests": len(results),
            "tokens_per_s": sum(r["tokens"] for r in results) / span,
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99), "load": os.getloadavg()[0]}


async def long_joins(server: Server, vocab: int, with_long: bool) -> dict:
    """8 short streams; with `with_long`, a 1900-token prompt joins once each has its first token."""
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=server.url, timeout=900) as http:
        shorts = [asyncio.create_task(stream(http, server, prompt_of(rng, 16, vocab), 96)) for _ in range(8)]
        long = None
        if with_long:
            await asyncio.sleep(1.0)
            long = await stream(http, server, prompt_of(rng, LONG_PROMPT, vocab), 8)
        done = await asyncio.gather(*shorts)
    return {"worst_gap": max(max(gaps(r), default=0.0) for r in done),
            "long_ttft": long["ttft"] if long else None}


async def shared_prefix(server: Server, vocab: int, cache: bool) -> float:
    """Mean TTFT of 32 requests (8 at a time) that share a 1k-token system prompt."""
    rng = random.Random(11)
    system = prompt_of(rng, SYSTEM_PROMPT, vocab)
    async with httpx.AsyncClient(base_url=server.url, timeout=900) as http:
        await stream(http, server, system + [5, 6, 7], 2, cache)  # fills the cache (when there is one)
        ttfts = []
        for _ in range(4):
            batch = [stream(http, server, system + prompt_of(rng, 8, vocab)[1:], 4, cache) for _ in range(8)]
            ttfts += [r["ttft"] for r in await asyncio.gather(*batch)]
    return sum(ttfts) / len(ttfts)


async def overflow(server: Server, vocab: int, parallel: int, max_len: int) -> dict:
    rng = random.Random(13)
    n = 4 * parallel
    async with httpx.AsyncClient(base_url=server.url, timeout=1800) as http:
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


@contextmanager
def ours(model_dir: Path, parallel: int, threads: int, max_len: int) -> Iterator[Server]:
    plan = plan_local(model_dir, 1, 1, max_model_len=max_len, max_batch_size=parallel,
                      devices="localhost:16GiB", device_kind="cpu")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp, LocalGroup(plan, model_dir, tmp, leader_port=port,
                                                          threads_per_rank=threads,
                                                          extra_env={"SHARD_HOST": "127.0.0.1"}) as group:
        wait_ready(group, url, 600)
        yield Server("shard-operator", url, llama=False)


def gguf_of(model_dir: Path, kind: str) -> Path:
    src = os.environ.get("LLAMA_CPP_SRC") or str(sorted(p for p in (CACHE / "src").glob("llama_cpp_python-*")
                                                        if p.is_dir())[-1])
    env = {**os.environ, "PYTHONPATH": str(Path(src) / "vendor" / "llama.cpp" / "gguf-py")}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "llamacpp_peer.py"), "convert-vocab", str(model_dir),
                          kind], capture_output=True, text=True, env=env, check=True)
    return Path(json.loads(out.stdout)["path"])


@contextmanager
def llama_server(gguf: Path, parallel: int, threads: int, max_len: int) -> Iterator[Server]:
    port = free_port()
    cmd = [str(SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * max_len), "-cb", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield Server("llama-server", url, llama=True)
    finally:
        proc.terminate()
        proc.wait(30)


def run_server(make, args, vocab: int, parallel: int) -> dict:
    out: dict = {"throughput": [], "scenarios": {}}
    with make(parallel) as server:
        asyncio.run(load(server, 1, 0, 4, vocab))  # one request first: both warm up
        for clients in args.clients:
            out["throughput"].append(throughput_row(server, clients, asyncio.run(
                load(server, clients, args.seconds, args.max_tokens, vocab))))
            print(json.dumps(out["throughput"][-1]), file=sys.stderr, flush=True)
        s = out["scenarios"]
        if "long" in args.scenarios:
            s["long_alone"] = asyncio.run(long_joins(server, vocab, False))
            s["long_joined"] = asyncio.run(long_joins(server, vocab, True))
        if "prefix" in args.scenarios:
            s["prefix_ttft_cached"] = asyncio.run(shared_prefix(server, vocab, True))
            s["prefix_ttft_uncached"] = asyncio.run(shared_prefix(server, vocab, False))
        if "overflow" in args.scenarios:
            before = counter(server.url, "shard_preemptions") if not server.llama else float("nan")
            s["overflow"] = asyncio.run(overflow(server, vocab, parallel, args.overflow_len))
            s["overflow"]["preemptions"] = (counter(server.url, "shard_preemptions") - before) if not server.llama \
                else None
        print(json.dumps({server.name: s}), file=sys.stderr, flush=True)
    return out


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
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-ours", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="only print the table of earlier runs' --out files (one server each)")
    args = parser.parse_args()
    if args.combine:
        print(table({k: v for path in args.combine for k, v in json.loads(path.read_text()).items()}))
        return 0
    args.clients = [int(c) for c in args.clients.split(",")]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    model_dir = args.model or REPO / ".cache" / "demo-model"
    if not (model_dir / "config.json").is_file():
        write_demo_model(model_dir, DemoShape(), overwrite=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    parallel = max(args.clients)
    results = {} if args.skip_ours else {
        "shard-operator": run_server(lambda p: ours(model_dir, p, args.threads, MAX_LEN), args, vocab, parallel)}
    if not args.skip_peer:
        if not SERVER.is_file():
            print(f"no {SERVER}: see this script's docstring", file=sys.stderr)
        else:
            gguf = gguf_of(model_dir, args.dtype)
            results["llama-server"] = run_server(lambda p: llama_server(gguf, p, args.threads, MAX_LEN), args,
                                                 vocab, parallel)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
