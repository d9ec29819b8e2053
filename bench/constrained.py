"""What grammar-constrained decoding (response_format json_schema) adds to a decode step: the
sampler's time per step with and without a JSON schema, at the bench model's vocabulary (32000:
a byte-level BPE trained here on Python source, since the hub is out of reach), batch 1 and 4, in
one run; each against the decode step time given (--step-ms: the Decode section's bfloat16 TP=1
figure by default), as the share of decode tokens/s it costs. The mask is computed on the host
while the engine waits (not overlapped with the forward pass).

    .venv/bin/python bench/constrained.py                 # ~2 minutes, most of it training the tokenizer
    .venv/bin/python bench/constrained.py --tokenizer t.json --step-ms 50
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from shard_contract.wire import GenerateRequest
from shard_worker.engine.sampling import Sampler
from shard_worker.serving.grammar import Grammars

VOCAB = 32000
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    site = Path(torch.__file__).parents[1]
    files = sorted(glob.glob(str(site / "**" / "*.py"), recursive=True))[:3000]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(files, trainer)
    tokenizer.save(str(path))


def per_step(sampler: Sampler, rows: int, steps: int, schema: str | None, seed: int = 0) -> list[float]:
    """Seconds of each sampling step (sample, the host copy, the matchers taking the tokens);
    a row whose answer ends starts a new one."""
    requests = [GenerateRequest(prompt_ids=[1], temperature=1.0, seed=seed + r, json_schema=schema)
                for r in range(rows)]
    for row, request in enumerate(requests):
        sampler.place(row, request)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        logits = torch.randn(rows, VOCAB, generator=gen) * 3
        start = time.perf_counter()
        tokens = sampler.sample(logits).to_host().tokens
        sampler.accept(0, tokens)
        times.append(time.perf_counter() - start)
        for row, token in enumerate(tokens):
            if token in (2, -1):  # its answer ended (or failed): a new request takes the row
                sampler.place(row, requests[row])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json of 32000 tokens (default: train one)")
    parser.add_argument("--step-ms", type=float, default=51.6, help="the decode step it is compared with")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (a TP=1 rank of 1 thread: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # 2 threads on a loaded 2-core host: each small op waits ~10 ms
    with tempfile.TemporaryDirectory() as tmp:
        path = args.tokenizer or Path(tmp) / "tokenizer.json"
        if args.tokenizer is None:
            start = time.perf_counter()
            train_tokenizer(path)
            print(f"tokenizer trained in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        start = time.perf_counter()
        grammars = Grammars(path.read_text(), VOCAB, [2])
        print(f"llguidance's tokenizer built in {time.perf_counter() - start:.2f} s (once a process)")
    schema = json.dumps(SCHEMA)
    print(f"| rows | sampler ms/step, free | with a JSON schema | added ms/step | share of a {args.step_ms:g} ms "
          "decode step |")
    print("|---|---|---|---|---|")
    for rows in (1, 4):
        free = per_step(Sampler(rows), rows, args.steps, None)
        per_step(Sampler(rows, lambda: grammars), rows, 50, schema, seed=99)  # warm llguidance's caches
        held = per_step(Sampler(rows, lambda: grammars), rows, args.steps, schema)
        f, h = statistics.median(free) * 1e3, statistics.median(held) * 1e3
        mean_added = (statistics.mean(held) - statistics.mean(free)) * 1e3
        print(f"| {rows} | {f:.2f} | {h:.2f} (mean {statistics.mean(held) * 1e3:.2f}) | {h - f:.2f} "
              f"(mean {mean_added:.2f}) | {(h - f) / args.step_ms:.1%} (mean {mean_added / args.step_ms:.1%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
