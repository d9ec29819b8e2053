"""The leader's decode step time with and without HTTP work beside it (issue 25, item 6).

One TP=1 group of the demo model (`shardctl run`'s path: `python -m shard_worker` under the local
launcher), maxBatchSize 32. Each round sends the same 32 requests at once (token-id prompts of
one length, greedy, EOS ignored, a fixed number of new tokens) in two ways, in turn (ABBA, so
that a drift of the machine's load cancels):

- quiet: whole answers (stream false): the HTTP side works only when a request arrives and ends;
- streaming: 32 streaming clients with text and a stop string that never matches: every decode
  step the leader detokenizes 32 sequences, checks their stop strings, writes 32 JSON chunks and
  sends them as server-sent events, on its event loop beside the engine thread.

The step time is the leader's own: decode seconds / decode steps of the generate (its report's
`last_generate`, read from /v1/shards after each batch). Printed: the median over rounds of each,
their ratio, and tokens/s as the clients saw them, and the machine's load average.

Each of `--modes` is one group, served in turn: `apart` (the leader's HTTP server in a process of
its own, the default) and `together` (SHARD_HTTP_PROCESS=0: its event loop on a thread of the
engine's process, sharing its GIL), so one run compares both.

    .venv/bin/python bench/http_step.py                  # demo model, 5 rounds of 32 x 64 tokens
    .venv/bin/python bench/http_step.py --tiny --rounds 10   # a 2-layer model: steps of a few ms
    .venv/bin/python bench/http_step.py --quick          # a smoke run of the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shard_contract.env import HTTP_PROCESS_ENV
from shard_operator.local.demo_model import DemoShape, write_demo_model
from shard_operator.local.launcher import LocalGroup, free_port, plan_local
from shard_operator.local.run import wait_ready

REPO = Path(__file__).resolve().parents[1]
CLIENTS = 32
NEVER = "\u2603\u2603\u2603"  # a stop string no demo-model text holds


async def one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stop": [NEVER]}
    if not stream:
        response = await http.post("/v1/completions", json=body)
        response.raise_for_status()
        return len(response.json()["choices"][0]["token_ids"])
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
    return tokens


async def last_generate(http: httpx.AsyncClient) -> dict:
    """The leader's figures of its latest generate, as its heartbeat last published them."""
    leader = (await http.get("/v1/shards")).json()["ranks"][0]
    return (leader.get("report") or {}).get("last_generate", {})


async def batch(url: str, prompts: list[list[int]], max_tokens: int, stream: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=CLIENTS + 4)) as http:
        before = await last_generate(http)
        start = time.monotonic()
        tokens = await asyncio.gather(*(one(http, p, max_tokens, stream) for p in prompts))
        seconds = time.monotonic() - start
        deadline = time.monotonic() + 60  # the report comes with the next heartbeat
        while (last := await last_generate(http)) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    steps = last.get("decode_steps", 0)
    return {"stream": stream, "tokens": sum(tokens), "seconds": seconds, "tokens_per_s": sum(tokens) / seconds,
            "step_ms": 1000 * last.get("decode_seconds", float("nan")) / max(1, steps), "steps": steps}


MODES = {"apart": "1", "together": "0"}  # SHARD_HTTP_PROCESS


def run(model_dir: Path, rounds: int, max_tokens: int, vocab: int, threads: int, mode: str) -> list[dict]:
    plan = plan_local(model_dir, 1, 1, max_model_len=256, max_batch_size=CLIENTS, devices="localhost:4GiB*1",
                      device_kind="cpu")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prompts = [[1] + [(7 * i + 11 * j) % (vocab - 3) + 3 for j in range(15)] for i in range(CLIENTS)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalGroup(plan, model_dir, tmp, leader_port=port,
                                                          threads_per_rank=threads,
                                                          extra_env={"SHARD_HOST": "127.0.0.1",
                                                                     HTTP_PROCESS_ENV: MODES[mode]}) as group:
        wait_ready(group, url, 300)
        asyncio.run(batch(url, prompts[:2], 4, False))  # warm up
        for r in range(rounds):
            for stream in ((False, True) if r % 2 == 0 else (True, False)):  # ABBA: drift cancels
                rows.append(asyncio.run(batch(url, prompts, max_tokens, stream)) | {"load": os.getloadavg()[0],
                                                                                     "mode": mode})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    parts = [(mode, [r for r in rows if r["mode"] == mode]) for mode in MODES]
    return "\n\n".join(f"{mode} ({HTTP_PROCESS_ENV}={MODES[mode]}):\n" + summary_of(part)
                       for mode, part in parts if part)


def summary_of(rows: list[dict]) -> str:
    quiet = [r["step_ms"] for r in rows if not r["stream"]]
    loud = [r["step_ms"] for r in rows if r["stream"]]
    loads = [r["load"] for r in rows]
    lines = ["| answers | rounds | leader's step (ms, median) | min / max | tokens/s (median) | mean steps |",
             "|---|---|---|---|---|---|"]
    for name, stream, values in (("whole (quiet HTTP side)", False, quiet), ("32 streaming clients", True, loud)):
        tps = [r["tokens_per_s"] for r in rows if r["stream"] == stream]
        steps = [r["steps"] for r in rows if r["stream"] == stream]
        lines.append(f"| {name} | {len(values)} | {statistics.median(values):.2f} | {min(values):.2f} / "
                     f"{max(values):.2f} | {statistics.median(tps):.0f} | {statistics.mean(steps):.0f} |")
    lines.append(f"\nstreaming / quiet step time: {statistics.median(loud) / statistics.median(quiet):.3f} "
                 f"(load average {min(loads):.1f}-{max(loads):.1f})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: the demo model in .cache/)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the rank's compute threads")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden size 64: steps of a few "
                        "ms, where the HTTP side's share is largest")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round: checks the script")
    parser.add_argument("--modes", default="apart,together", help="comma-separated: apart, together")
    args = parser.parse_args()
    if args.quick or args.tiny:
        model_dir = write_demo_model(Path(tempfile.mkdtemp()) / "tiny", DemoShape(layers=2, hidden=64, intermediate=128,
                                                                               heads=4, kv_heads=2, files=2))
        if args.quick:
            args.rounds, args.max_tokens = 1, 8
    else:
        model_dir = args.model or REPO / ".cache" / "demo-model"
        if not (model_dir / "config.json").is_file():
            write_demo_model(model_dir, DemoShape(), overwrite=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rows = [row for mode in args.modes.split(",")
            for row in run(model_dir, args.rounds, args.max_tokens, vocab, args.threads, mode)]
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
