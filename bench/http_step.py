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
their ratio, and tokens/s as the clients saw them, and the machine's load average; and the CPU
seconds spent during the batch, per decode step (/proc/PID/task/*/stat), by the engine thread, by
the other threads of the engine's process (what takes the engine thread's GIL: the event loop when
HTTP is served there, the pipe's threads when apart) and by the HTTP process: unlike wall time on
a loaded machine, what a thread itself computed hardly grows with the load, so it shows where the
HTTP work runs and what of it can still hold the engine's GIL.

Each of `--modes` is one group, all up at once and their batches interleaved: `apart` (the
leader's HTTP server in a process of its own, the default) and `together` (SHARD_HTTP_PROCESS=0:
its event loop on a thread of the engine's process, sharing its GIL), so one run compares both.

    .venv/bin/python bench/http_step.py                  # demo model, 5 rounds of 32 x 64 tokens
    .venv/bin/python bench/http_step.py --tiny --rounds 10   # a 2-layer model: steps of a few ms
    .venv/bin/python bench/http_step.py --quick          # a smoke run of the script
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from shard_operator.local.launcher import LocalGroup, plan_local

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from served import served

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


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid` so far."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def leader_processes(group: LocalGroup) -> tuple[int, int | None]:
    """The leader's engine process and its HTTP process (None when it serves in one)."""
    engine = group.ranks[0].process.pid
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == engine and (stat.parent / "cmdline").read_bytes().startswith(b"shard-worker-http"):
                return engine, int(stat.parent.name)
        except OSError:
            continue
    return engine, None


def cpu_split(before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """(the busiest thread's CPU seconds between two samples, the other threads' together): in the
    leader's engine process the busiest is the engine thread, and the others are what holds its
    GIL besides it (the event loop when HTTP is served there; the pipe's threads when apart)."""
    grown = sorted(after[t] - before.get(t, 0.0) for t in after)
    return (grown[-1], sum(grown[:-1])) if grown else (0.0, 0.0)


async def batch(url: str, prompts: list[list[int]], max_tokens: int, stream: bool,
                pids: tuple[int, int | None] = (0, None)) -> dict:
    engine, front = pids
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=CLIENTS + 4)) as http:
        before = await last_generate(http)
        threads, http_cpu = thread_cpu(engine), sum(thread_cpu(front).values()) if front else 0.0
        start = time.monotonic()
        tokens = await asyncio.gather(*(one(http, p, max_tokens, stream) for p in prompts))
        seconds = time.monotonic() - start
        engine_thread, others = cpu_split(threads, thread_cpu(engine))
        http_cpu = (sum(thread_cpu(front).values()) if front else 0.0) - http_cpu
        deadline = time.monotonic() + 60  # the report comes with the next heartbeat
        while (last := await last_generate(http)) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    steps = max(1, last.get("decode_steps", 0))
    return {"stream": stream, "tokens": sum(tokens), "seconds": seconds, "tokens_per_s": sum(tokens) / seconds,
            "step_ms": 1000 * last.get("decode_seconds", float("nan")) / steps, "steps": steps,
            "engine_thread_cpu_ms": 1000 * engine_thread / steps, "beside_cpu_ms": 1000 * others / steps,
            "http_cpu_ms": 1000 * http_cpu / steps}


MODES = {"apart": "1", "together": "0"}  # SHARD_HTTP_PROCESS


def run(model_dir: Path, rounds: int, max_tokens: int, vocab: int, threads: int, modes: list[str]) -> list[dict]:
    """Both modes' groups up at once (an idle one waits on a condition), their batches interleaved
    ABBA in both the mode and the answers, so that a drift of the machine's load cancels."""
    plan = plan_local(model_dir, 1, 1, max_model_len=256, max_batch_size=CLIENTS, devices="localhost:4GiB*1",
                      device_kind="cpu")
    prompts = [[1] + [(7 * i + 11 * j) % (vocab - 3) + 3 for j in range(15)] for i in range(CLIENTS)]
    rows = []
    with contextlib.ExitStack() as stack:
        leaders = {}
        for mode in modes:
            url, group = stack.enter_context(served(plan, model_dir, threads=threads, ready_seconds=300,
                                                    env={HTTP_PROCESS_ENV: MODES[mode]}))
            asyncio.run(batch(url, prompts[:2], 4, False))  # warm up
            leaders[mode] = (url, leader_processes(group))
        order = [(mode, stream) for mode in modes for stream in (False, True)]
        for r in range(rounds):
            for mode, stream in (order if r % 2 == 0 else order[::-1]):
                url, pids = leaders[mode]
                rows.append(asyncio.run(batch(url, prompts, max_tokens, stream, pids))
                            | {"load": os.getloadavg()[0], "mode": mode})
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
    lines = ["| answers | rounds | leader's step (ms, median) | min / max | tokens/s (median) | mean steps | CPU ms a "
             "step: engine thread / beside it in its process / HTTP process (median) |",
             "|---|---|---|---|---|---|---|"]
    for name, stream, values in (("whole (quiet HTTP side)", False, quiet), ("32 streaming clients", True, loud)):
        tps = [r["tokens_per_s"] for r in rows if r["stream"] == stream]
        steps = [r["steps"] for r in rows if r["stream"] == stream]
        cpu = [statistics.median(r[k] for r in rows if r["stream"] == stream)
               for k in ("engine_thread_cpu_ms", "beside_cpu_ms", "http_cpu_ms")]
        lines.append(f"| {name} | {len(values)} | {statistics.median(values):.2f} | {min(values):.2f} / "
                     f"{max(values):.2f} | {statistics.median(tps):.0f} | {statistics.mean(steps):.0f} | "
                     f"{cpu[0]:.2f} / {cpu[1]:.2f} / {cpu[2]:.2f} |")
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
    rows = run(model_dir, args.rounds, args.max_tokens, vocab, args.threads, args.modes.split(","))
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
