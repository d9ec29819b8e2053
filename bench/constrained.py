"""What grammar-constrained decoding (response_format json_schema) costs in decode tokens/s, in one run.

End to end (the default; the figure of issue 29's goal, at most 10%): the Decode section's bench
model (853M: hidden 2048, 16 layers, vocab 32000) in bfloat16, with a byte-level BPE of 32000
tokens trained here on Python source (the hub is out of reach) and the demo model's chat template,
served by one TP=1 rank of one thread (`shardctl run`'s path: `python -m shard_worker` under the
local launcher). The same streaming chat request (temperature 1, a seed each, `max_tokens` fixed)
is sent with and without a JSON schema, 1 and 4 at a time, in turn (ABBA, so that a drift of the
machine's load cancels). Decode tokens/s is what the client sees: the tokens after the first over
the time from the first to the last, summed over the requests of a batch; the leader's own step
time (decode seconds / steps of its last generate, from /v1/shards) is printed beside it.

With `--sampler`: the sampler's step alone (sampling on random logits, the host copy, each
constrained row's matcher taking its token), free and constrained, at the same vocabulary; that is
where the added time goes.

    .venv/bin/python bench/constrained.py                  # ~15 minutes on a quiet machine
    .venv/bin/python bench/constrained.py --quick          # a small model, 1 round: checks the script
    .venv/bin/python bench/constrained.py --sampler        # the sampler's step alone (~3 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from shard_contract.wire import GenerateRequest
from shard_operator.local import demo_model
from shard_operator.local.launcher import plan_local
from shard_worker.engine.grammar import Grammars
from shard_worker.engine.sampling import Sampler

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import decode
from served import served

VOCAB = 32000
# Long enough that most answers reach max_tokens (8 tags of up to 16 characters), as a free one does.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                    "minItems": 8, "maxItems": 8},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON: name, age, eight tags, ok."}]


def train_tokenizer(vocab: int) -> object:
    """The demo model's byte-level BPE (its special tokens: <unk> 0, <s> 1, </s> 2, chat roles),
    trained on torch's Python source to `vocab` tokens."""
    site = Path(torch.__file__).parents[1]
    files = sorted(glob.glob(str(site / "**" / "*.py"), recursive=True))[:3000]
    text = "\n".join(Path(f).read_text(errors="replace") for f in files)
    return demo_model.train_tokenizer(vocab, text)


def model_with_tokenizer(shape: dict, directory: Path) -> Path:
    """The bench checkpoint (decode.py's, written once into its cache) hard-linked beside a trained
    tokenizer of its vocabulary and the demo model's chat template (cached too)."""
    weights = decode.ensure_checkpoint(decode.CACHE / ("bench-decode-quick" if shape is decode.QUICK
                                                       else "bench-decode"), shape)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "tokenizer.json").exists():
        start = time.perf_counter()
        tokenizer = train_tokenizer(shape["vocab_size"])
        tokenizer.save(str(directory / "tokenizer.json.part"))
        os.replace(directory / "tokenizer.json.part", directory / "tokenizer.json")
        print(f"tokenizer trained in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": demo_model.BOS, "eos_token": demo_model.EOS,
        "unk_token": demo_model.UNK, "chat_template": demo_model.CHAT_TEMPLATE}))
    for file in weights.iterdir():
        if file.suffix in (".json", ".safetensors") and file.name != "bench-shape.json":
            (directory / file.name).unlink(missing_ok=True)
            os.link(file, directory / file.name)  # the containment check refuses links out; hard ones are files
    return directory


# ---------------------------------------------------------------- end to end
async def one(http: httpx.AsyncClient, seed: int, max_tokens: int, schema: bool) -> dict:
    model = (await http.get("/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if schema:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    first = last = None
    text, tokens = "", 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.monotonic()
                    text += choice["delta"]["content"]
                if choice.get("finish_reason"):
                    last = time.monotonic()
    # The first token's chunk starts the clock: the tokens after it over the time to the last.
    return {"tokens": max(0, tokens - 1), "seconds": (last - first) if first and last else 0.0, "text": text}


async def last_generate(http: httpx.AsyncClient) -> dict:
    leader = (await http.get("/v1/shards")).json()["ranks"][0]
    return (leader.get("report") or {}).get("last_generate", {})


async def batch(url: str, rows: int, max_tokens: int, schema: bool, seed: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        before = await last_generate(http)
        answers = await asyncio.gather(*(one(http, seed + r, max_tokens, schema) for r in range(rows)))
        deadline = time.monotonic() + 60  # the leader's figures come with its next heartbeat
        while (last := await last_generate(http)) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    parsed = 0
    for answer in answers:
        try:
            json.loads(answer["text"])
            parsed += 1
        except ValueError:
            pass
    rate = sum(a["tokens"] / a["seconds"] for a in answers if a["seconds"] > 0)  # the batch's decode tokens/s
    return {"rows": rows, "schema": schema, "tokens": sum(a["tokens"] for a in answers), "tokens_per_s": rate,
            "step_ms": 1000 * last.get("decode_seconds", float("nan")) / max(1, last.get("decode_steps", 0)),
            "parsed": parsed, "load": os.getloadavg()[0]}


def end_to_end(model_dir: Path, rounds: int, max_tokens: int, threads: int, dtype: str) -> list[dict]:
    plan = plan_local(model_dir, 1, 1, dtype=dtype, max_model_len=512, max_batch_size=4,
                      devices="localhost:8GiB*1", device_kind="cpu")
    results = []
    with served(plan, model_dir, threads=threads, ready_seconds=900) as (url, _):
        asyncio.run(batch(url, 1, 8, True, 999))  # warm up: the grammar's tokenizer, the first steps
        asyncio.run(batch(url, 1, 8, False, 999))
        for r in range(rounds):
            for rows in (1, 4):
                for schema in ((False, True) if r % 2 == 0 else (True, False)):  # ABBA: drift cancels
                    results.append(asyncio.run(batch(url, rows, max_tokens, schema, 100 * r)))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def end_to_end_table(results: list[dict], max_tokens: int) -> str:
    lines = ["| requests at once | decode tokens/s, free | with a JSON schema | ratio | leader's step ms, free "
             "/ schema | schema answers that parse | load (1 min) |", "|---|---|---|---|---|---|---|"]
    for rows in (1, 4):
        free = [r for r in results if r["rows"] == rows and not r["schema"]]
        held = [r for r in results if r["rows"] == rows and r["schema"]]
        if not free or not held:
            continue
        f, h = (statistics.median(r["tokens_per_s"] for r in side) for side in (free, held))
        sf, sh = (statistics.median(r["step_ms"] for r in side) for side in (free, held))
        loads = [r["load"] for r in free + held]
        lines.append(f"| {rows} | {f:.2f} | {h:.2f} | {h / f:.3f} | {sf:.1f} / {sh:.1f} | "
                     f"{sum(r['parsed'] for r in held)} of {rows * len(held)} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines) + (f"\n\n{len(results) // 4} rounds, medians; max_tokens {max_tokens} (an answer cut "
                               "there does not parse)")


# ---------------------------------------------------------------- the sampler alone
def per_step(sampler: Sampler, requests: list[GenerateRequest], steps: int, gen: torch.Generator,
             vocab: int) -> list[float]:
    """Seconds of each sampling step (sample, the host copy, the matchers taking the tokens);
    a row whose answer ends starts a new one."""
    times = []
    for _ in range(steps):
        logits = torch.randn(len(requests), vocab, generator=gen) * 3
        start = time.perf_counter()
        tokens = sampler.sample(logits).to_host().tokens
        sampler.accept(0, tokens)
        times.append(time.perf_counter() - start)
        for row, token in enumerate(tokens):
            if token in (2, -1):  # its answer ended (or failed): a new request takes the row
                sampler.place(row, requests[row])
    return times


def sampler_alone(tokenizer: Path, vocab: int, steps: int, blocks: int = 8) -> str:
    start = time.perf_counter()
    grammars = Grammars(tokenizer.read_text(), vocab, [2])
    print(f"llguidance's tokenizer built in {time.perf_counter() - start:.2f} s (once a process)", file=sys.stderr)
    schema = json.dumps(SCHEMA)
    lines = ["| rows | sampler ms/step, free | with a JSON schema | added ms/step |", "|---|---|---|---|"]
    for rows in (1, 4):
        sides = {}
        for name, with_schema in (("free", None), ("held", schema)):
            requests = [GenerateRequest(prompt_ids=[1], temperature=1.0, seed=r, json_schema=with_schema)
                        for r in range(rows)]
            sampler = Sampler(rows, lambda: grammars)
            for row, request in enumerate(requests):
                sampler.place(row, request)
            sides[name] = (sampler, requests, torch.Generator().manual_seed(rows), [])
            per_step(sampler, requests, 20, sides[name][2], vocab)  # warm up (llguidance's lazy lexer states)
        for block in range(blocks):  # blocks in turn: a drift of the machine's load hits both
            for name in (("free", "held") if block % 2 == 0 else ("held", "free")):
                sampler, requests, gen, times = sides[name]
                times += per_step(sampler, requests, steps // blocks, gen, vocab)
        f, h = (statistics.median(sides[name][3]) * 1e3 for name in ("free", "held"))
        held_mean = statistics.mean(sides["held"][3]) * 1e3
        lines.append(f"| {rows} | {f:.2f} | {h:.2f} (mean {held_mean:.2f}) | {h - f:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 1 round: checks the script")
    parser.add_argument("--sampler", action="store_true", help="the sampler's step alone")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="the rank's (or the sampler's) torch threads")
    parser.add_argument("--steps", type=int, default=400, help="--sampler: steps of each measure")
    args = parser.parse_args()
    shape = decode.QUICK if args.quick else decode.FULL
    if args.quick:
        args.rounds, args.max_tokens = 1, 12
    model_dir = model_with_tokenizer(shape, decode.CACHE / f"bench-constrained{'-quick' if args.quick else ''}")
    load = os.getloadavg()[0]
    if args.sampler:
        torch.set_num_threads(args.threads)  # 2 threads on a loaded 2-core host: each small op waits ~10 ms
        print(sampler_alone(model_dir / "tokenizer.json", shape["vocab_size"], args.steps))
    else:
        results = end_to_end(model_dir, args.rounds, args.max_tokens, args.threads, args.dtype)
        print(end_to_end_table(results, args.max_tokens))
    print(f"load average (1 min) before: {load:.1f}, after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
