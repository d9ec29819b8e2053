"""Serving throughput and latency: N concurrent clients for a fixed time against TP=1 and TP=2.

Each layout is a real group of `python -m shard_worker` processes started by the local launcher
(the `shardctl run` path) on the same model, with maxBatchSize = the most clients: TP=1 as one
rank of two threads (the same cores as TP=2) and of one thread (OpenMP's two-thread regions suffer
most when other jobs share the cores), and TP=2 as two ranks of one thread. Every client sends
streaming completions back to back (prompts of 8-40 tokens, greedy, a fixed number of new tokens,
EOS ignored) until the time is up; a request started in time is waited for.

With `--dashboard ROUNDS`, TP=2 only: each client count runs ROUNDS times without and with a
browser-like poller fetching what `/dashboard` polls (`/v1/shards`, `/metrics`, `/health`, the
picture) every second, alternately, and the ratio of tokens/s with it to without is printed.

Reported per layout and client count: completed requests, generated tokens/s (over the time from
the first request to the last answer), latency and time to first token (p50 / p99, seconds), the
mean decode batch from the leader's own `shard_batch_size` histogram, and the 1-minute load
average when the run ended (our own ranks count up to 2).

    .venv/bin/python bench/serve.py                      # demo model, clients 1 and 4, 30 s each
    .venv/bin/python bench/serve.py --quick              # a smoke run of the script
    .venv/bin/python bench/serve.py --dashboard 3        # TP=2, 3 rounds without / with a /dashboard poller
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import plan_local

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from served import served

POLL_SECONDS = 1.0  # the page polls every 2 s; a viewer polling every second is the harder case


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def client(http: httpx.AsyncClient, rng: random.Random, deadline: float, max_tokens: int,
                 vocab: int, results: list[dict]) -> None:
    while time.monotonic() < deadline:
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 40))]
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        start, first, tokens = time.monotonic(), None, 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0]["token_ids"]
                if ids and first is None:
                    first = time.monotonic()
                tokens += len(ids)
        results.append({"start": start, "end": time.monotonic(), "ttft": (first or time.monotonic()) - start,
                        "tokens": tokens})


DASHBOARD_DATA = ("/v1/shards", "/metrics", "/health", "/dashboard/layout.svg")  # what /dashboard polls


async def fetch(http: httpx.AsyncClient, path: str) -> httpx.Response:
    """GET `path`, again once when the server closed an idle keep-alive connection just as it was
    reused (uvicorn closes them after 5 s; a browser retries such a GET the same way)."""
    try:
        return await http.get(path)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return await http.get(path)


async def poller(http: httpx.AsyncClient, deadline: float, period: float) -> int:
    """A browser with /dashboard open, polling its data every `period` s; returns the polls made."""
    polls = 0
    while time.monotonic() < deadline:
        started = time.monotonic()
        for response in await asyncio.gather(*(fetch(http, path) for path in DASHBOARD_DATA)):
            response.raise_for_status()
        polls += 1
        await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
    return polls


async def load(url: str, clients: int, seconds: float, max_tokens: int, vocab: int,
               poll_period: float | None = None) -> list[dict]:
    results: list[dict] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        watching = [poller(http, deadline, poll_period)] if poll_period else []
        await asyncio.gather(*(client(http, random.Random(i), deadline, max_tokens, vocab, results)
                               for i in range(clients)), *watching)
    return results


def batch_stats(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shard_batch_size")
    values = {s.name: s.value for s in family.samples}
    return values["shard_batch_size_count"], values["shard_batch_size_sum"]


def run_layout(model_dir: Path, tp: int, threads: int, clients_list: list[int], seconds: float, max_tokens: int,
               vocab: int, pollers: tuple[float | None, ...] = (None,)) -> list[dict]:
    """Every client count, once per entry of `pollers` in turn (None: no dashboard open)."""
    plan = plan_local(model_dir, tp, 1, max_model_len=256, max_batch_size=max(clients_list),
                      devices="localhost:4GiB*2", device_kind="cpu")
    rows = []
    with served(plan, model_dir, threads=threads, ready_seconds=300) as (url, _):
        asyncio.run(load(url, 1, 0, 8, vocab))  # warm up: one request
        for clients, poll_period in [(c, p) for c in clients_list for p in pollers]:
            count0, sum0 = batch_stats(url)
            results = asyncio.run(load(url, clients, seconds, max_tokens, vocab, poll_period))
            count1, sum1 = batch_stats(url)
            span = max(r["end"] for r in results) - min(r["start"] for r in results)
            latency = [r["end"] - r["start"] for r in results]
            ttft = [r["ttft"] for r in results]
            rows.append({"layout": f"TP={tp}, {threads} thread{'s' if threads > 1 else ''} per rank",
                         "clients": clients,
                         "dashboard": f"polled every {poll_period:g} s" if poll_period else "-",
                         "requests": len(results),
                         "tokens_per_s": sum(r["tokens"] for r in results) / span,
                         "latency_p50": percentile(latency, 0.5), "latency_p99": percentile(latency, 0.99),
                         "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
                         "mean_batch": (sum1 - sum0) / max(1, count1 - count0), "load": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| layout | clients | dashboard | requests | tokens/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) "
             "| mean batch | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['clients']} | {r['dashboard']} | {r['requests']} "
                     f"| {r['tokens_per_s']:.1f} | "
                     f"{r['latency_p50']:.2f} / {r['latency_p99']:.2f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
                     f"{r['mean_batch']:.2f} | {r['load']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the demo model in .cache/)")
    parser.add_argument("--clients", default="1,4", help="client counts, e.g. 1,4")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of load per client count")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--quick", action="store_true", help="a tiny model for 3 s: checks the script")
    parser.add_argument("--dashboard", type=int, default=0, metavar="ROUNDS",
                        help="only TP=2: each client count ROUNDS times without and with a /dashboard poller, "
                             "interleaved; prints the throughput ratio")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    if args.quick:
        model_dir = write_demo_model(Path(tempfile.mkdtemp()) / "tiny", DemoShape(layers=2, hidden=64, intermediate=128,
                                                                               heads=4, kv_heads=2, files=2))
        args.seconds = 3.0
    else:
        model_dir = args.model or REPO / ".cache" / "demo-model"
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, DemoShape(), overwrite=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if args.dashboard:
        pollers = (None, POLL_SECONDS) * args.dashboard
        rows = run_layout(model_dir, 2, 1, clients, args.seconds, args.max_tokens, vocab, pollers)
        print(table(rows))
        print(dashboard_cost(rows))
        return 0
    layouts = [(1, 2), (1, 1), (2, 1)]  # (TP, threads per rank)
    rows = [row for tp, threads in layouts
            for row in run_layout(model_dir, tp, threads, clients, args.seconds, args.max_tokens, vocab)]
    print(table(rows))
    return 0


def dashboard_cost(rows: list[dict]) -> str:
    """Per client count: tokens/s with the poller over tokens/s without (each summed over rounds)."""
    lines = []
    for clients in sorted({r["clients"] for r in rows}):
        with_, without = ([r["tokens_per_s"] for r in rows if r["clients"] == clients and (r["dashboard"] != "-") == on]
                          for on in (True, False))
        lines.append(f"{clients} client(s): tokens/s with a dashboard polling every {POLL_SECONDS:g} s / without = "
                     f"{sum(with_) / sum(without):.3f} ({len(with_)} rounds each, interleaved)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
