"""Serving throughput and latency: N concurrent clients for a fixed time against TP=1 and TP=2.

Each layout is a real group of `python -m shard_worker` processes started by the local launcher
(the `shardctl run` path) on the same model, with maxBatchSize = the most clients: TP=1 as one
rank of two threads (the same cores as TP=2) and of one thread (OpenMP's two-thread regions suffer
most when other jobs share the cores), and TP=2 as two ranks of one thread. Every client sends
streaming completions back to back (prompts of 8-40 tokens, greedy, a fixed number of new tokens,
EOS ignored) until the time is up; a request started in time is waited for.

Reported per layout and client count: completed requests, generated tokens/s (over the time from
the first request to the last answer), latency and time to first token (p50 / p99, seconds), the
mean decode batch from the leader's own `shard_batch_size` histogram, and the 1-minute load
average when the run ended (our own ranks count up to 2).

    .venv/bin/python bench/serve.py                      # demo model, clients 1 and 4, 30 s each
    .venv/bin/python bench/serve.py --quick              # a smoke run of the script
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

from shard_operator.demo_model import DemoShape, write_demo_model
from shard_operator.local import LocalGroup, free_port, plan_local
from shard_operator.run import wait_ready

REPO = Path(__file__).resolve().parents[1]


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


async def load(url: str, clients: int, seconds: float, max_tokens: int, vocab: int) -> list[dict]:
    results: list[dict] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(client(http, random.Random(i), deadline, max_tokens, vocab, results)
                               for i in range(clients)))
    return results


def batch_stats(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shard_batch_size")
    values = {s.name: s.value for s in family.samples}
    return values["shard_batch_size_count"], values["shard_batch_size_sum"]


def run_layout(model_dir: Path, tp: int, threads: int, clients_list: list[int], seconds: float, max_tokens: int,
               vocab: int) -> list[dict]:
    plan = plan_local(model_dir, tp, 1, max_model_len=256, max_batch_size=max(clients_list),
                      devices="localhost:4GiB*2", device_kind="cpu")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalGroup(plan, model_dir, tmp, leader_port=port,
                                                          threads_per_rank=threads,
                                                          extra_env={"SHARD_HOST": "127.0.0.1"}) as group:
        wait_ready(group, url, 300)
        asyncio.run(load(url, 1, 0, 8, vocab))  # warm up: one request
        for clients in clients_list:
            count0, sum0 = batch_stats(url)
            results = asyncio.run(load(url, clients, seconds, max_tokens, vocab))
            count1, sum1 = batch_stats(url)
            span = max(r["end"] for r in results) - min(r["start"] for r in results)
            latency = [r["end"] - r["start"] for r in results]
            ttft = [r["ttft"] for r in results]
            rows.append({"layout": f"TP={tp}, {threads} thread{'s' if threads > 1 else ''} per rank", "clients": clients, "requests": len(results),
                         "tokens_per_s": sum(r["tokens"] for r in results) / span,
                         "latency_p50": percentile(latency, 0.5), "latency_p99": percentile(latency, 0.99),
                         "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
                         "mean_batch": (sum1 - sum0) / max(1, count1 - count0), "load": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| layout | clients | requests | tokens/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) | mean batch | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
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
    layouts = [(1, 2), (1, 1), (2, 1)]  # (TP, threads per rank)
    rows = [row for tp, threads in layouts
            for row in run_layout(model_dir, tp, threads, clients, args.seconds, args.max_tokens, vocab)]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
