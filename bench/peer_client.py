"""bench/serve_peer.py's clients: the same streaming HTTP client for both servers, and the load of
each phase. Every request is kept, a failed one with its reason (peer_report counts them).

A fresh connection per request (`Connection: close`, no kept-alive connections in the pool):
llama-server (cpp-httplib 0.58) closes the connection after every streamed response although
its headers offered keep-alive (its chunked content provider returns false after the last chunk,
which httplib takes as an error, `write_content_chunked`, and it leaves its keep-alive loop
without a `Connection: close`); a client that reuses it sends its next request into a closing
socket: `RemoteProtocolError: Server disconnected without sending a response`, an error of the
client, not of the server, which had answered every request. Both servers get the same client,
so both pay the same loopback connect (tens of microseconds) in their TTFT.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shard_contract.sharding import KV_BLOCK_SIZE, kv_pool_tokens

FAILURES_PER_CLIENT = 3  # a client of the throughput phases stops after this many failed requests


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
        return len(chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else 0

    def total(self, chunk: dict) -> int | None:
        """The tokens the whole stream generated, where its last chunk says (llama-server's final
        chunk has `tokens_predicted`: the last token of a stream that hits n_predict is not sent
        as a chunk of its own)."""
        return chunk.get("tokens_predicted") if self.llama and chunk.get("stop") else None


def client_of(server: Server, timeout: float = 900) -> httpx.AsyncClient:
    """The one client both servers get: a fresh connection per request (the module's docstring)."""
    return httpx.AsyncClient(base_url=server.url, timeout=timeout, headers={"Connection": "close"},
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


async def stream(http: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int,
                 cache: bool = True, first: asyncio.Event | None = None) -> dict:
    """One streaming request: its start, the (time, tokens) of each chunk, its end, and `error`
    (None, or why it failed: a transport error, a status other than 200, an error in the stream).
    `first` is set at its first tokens, or when it ends without any."""
    path, body = server.body(prompt, max_tokens, cache)
    start, events, total, error = time.monotonic(), [], None, None
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {text[:160]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        error = f"error in the stream: {json.dumps(chunk['error'])[:160]}"
                        break
                    n, total = server.tokens(chunk), server.total(chunk) or total
                    if n:
                        events.append((time.monotonic(), n))
                        if first is not None:
                            first.set()
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        if first is not None:
            first.set()  # ended without tokens: whoever waits for it goes on (and sees the error)
    return {"start": start, "end": time.monotonic(), "events": events, "error": error,
            "tokens": total if total is not None else sum(n for _, n in events),
            "ttft": events[0][0] - start if events else None}


def prompt_of(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


async def load(server: Server, clients: int, seconds: float, max_tokens: int, vocab: int,
               seed: str = "load") -> list[dict]:
    """`clients` clients sending requests back to back for `seconds` (each one at least). Prompts
    (8-40 tokens) are drawn per phase and client (`seed`, the client count, its index): no phase
    repeats another's prompts, which either server's prefix cache would find."""
    results: list[dict] = []
    deadline = time.monotonic() + seconds

    async def one(i: int) -> None:
        rng = random.Random(f"{seed}-{clients}-{i}")
        sent = failed = 0
        while (time.monotonic() < deadline or not sent) and failed < FAILURES_PER_CLIENT:
            sent += 1
            results.append(await stream(http, server, prompt_of(rng, rng.randrange(8, 40), vocab), max_tokens))
            failed += results[-1]["error"] is not None

    async with client_of(server) as http:
        await asyncio.gather(*(one(i) for i in range(clients)))
    return results


async def long_joins(server: Server, vocab: int, with_long: bool, short_tokens: int,
                     long_len: int) -> tuple[list[dict], dict | None]:
    """8 short streams of `short_tokens` tokens; with `with_long`, a `long_len`-token prompt (8 new
    tokens) is sent once each has its first token. Returns (the shorts, the long one or None)."""
    rng = random.Random(f"long-{with_long}")  # the runs' short prompts differ: no prefix cache between them
    async with client_of(server) as http:
        started = [asyncio.Event() for _ in range(8)]
        shorts = [asyncio.create_task(stream(http, server, prompt_of(rng, 16, vocab), short_tokens, first=e))
                  for e in started]
        try:
            long = None
            if with_long:
                await asyncio.gather(*(e.wait() for e in started))
                long = await stream(http, server, prompt_of(rng, long_len, vocab), 8)
            done = await asyncio.gather(*shorts)
        finally:  # past the budget: none of them outlives the phase
            for task in shorts:
                task.cancel()
            await asyncio.gather(*shorts, return_exceptions=True)
    return list(done), long


async def shared_prefix(server: Server, vocab: int, cached: bool, rounds: int, prefix_len: int) -> list[dict]:
    """8 x `rounds` requests (8 at a time) whose prompts are a `prefix_len`-token system prompt and
    a short tail. Cached: one system prompt for all, after one request has filled the cache;
    uncached: a system prompt of the same length of its own for each request, so no server finds
    a prefix to reuse (the same requests' work, whatever a server's flags)."""
    rng = random.Random(f"prefix-{cached}")
    system = prompt_of(rng, prefix_len, vocab)
    async with client_of(server) as http:
        fill = await stream(http, server, system + [5, 6, 7], 2)  # fills the cache (when there is one)
        if fill["error"]:
            return [fill]
        results = []
        for _ in range(rounds):
            heads = [system if cached else prompt_of(rng, prefix_len, vocab) for _ in range(8)]
            results += await asyncio.gather(*(stream(http, server, head + prompt_of(rng, 8, vocab)[1:], 4)
                                              for head in heads))
    return results


async def overflow(server: Server, vocab: int, requests: int, prompt_len: int, new_tokens: int) -> list[dict]:
    """`requests` requests at once, each a `prompt_len`-token prompt and `new_tokens` new tokens."""
    rng = random.Random("overflow")
    async with client_of(server, 1800) as http:
        return list(await asyncio.gather(*(stream(http, server, prompt_of(rng, prompt_len, vocab), new_tokens)
                                           for _ in range(requests))))


def counter(url: str, name: str) -> float:
    """The sum of a counter family's `_total` samples in the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise KeyError(f"{name} is not in {url}/metrics")


def kv_of_free(url: str) -> dict:
    """The leader's KV cache against the memory its plan leaves free."""
    shards = httpx.get(url + "/v1/shards", timeout=30).json()
    entry = shards["ranks"][0]
    plan, report = entry["plan"], entry.get("report") or {}
    p = plan["predicted_bytes"]
    free = plan["usable_bytes"] - (p["weights"] + p["activations"] + p["overhead"] + p.get("staging", 0))
    held = (report.get("allocated_bytes") or {}).get("kv_cache", 0)
    block = p["kv_cache"] // kv_pool_tokens(plan["kv_cache_tokens"]) * KV_BLOCK_SIZE
    return {"free_bytes": free, "planned_kv_bytes": p["kv_cache"], "held_kv_bytes": held, "block_bytes": block,
            "planned_tokens": plan["kv_cache_tokens"], "held_tokens": shards["kv_cache_tokens"],
            "planned_of_free": p["kv_cache"] / free, "held_of_free": held / free}
