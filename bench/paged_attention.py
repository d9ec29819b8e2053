"""Decode attention over the paged KV cache: gathering each row's context vs reading the pool in place.

One layer of an 8B-shaped model per rank (32 query heads, 8 KV heads, head_dim 128), a batch of
rows each with `context` positions in shuffled 16-position blocks of one pool, one decode query a
row. Two ways, as the worker's torch path has them (`shard_worker.model.model.KVCache`):

* gather: each row's columns indexed out of the pool by its read map (`paging.slot_maps`) into a
  [rows, kv_heads, context, head_dim] copy, then grouped SDPA under the step's additive mask
  (`attention.grouped_attention`): what every layer did at every step before `paged.py`;
* in place: FlexAttention, compiled, over the rows' block tables (`paged.paged_mask`,
  `paged.attend`): the kernel loads each row's blocks where they lie.

Both masks are built from device tensors each round, as a step builds them (once a step, shared by
its layers: counted here once a layer, which favours neither much). Rounds interleave the two ways
(ABAB...), and the medians' ratio is reported with the bytes each moves: the pool's K and V of the
rows' contexts, read once in place; gathered, read, written as a copy and read again (3x), plus
the mask's. `--device cuda` runs the same on a GPU (bench/gpu_check.sh).

    python bench/paged_attention.py --contexts 512,2048,8192 --rows 8 --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("worker", "contract")]

from shard_worker.model import paged
from shard_worker.model.attention import additive, allowed_keys, grouped_attention
from shard_worker.model.paging import BLOCK_SIZE, RESERVED_BLOCKS, blocks_for, slot_maps

HEADS, KV_HEADS, DIM = 32, 8, 128


def setup(rows: int, context: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    per_row = blocks_for(context + 1)
    pool = RESERVED_BLOCKS + rows * per_row
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(KV_HEADS, pool * BLOCK_SIZE, DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(KV_HEADS, pool * BLOCK_SIZE, DIM, generator=gen).to(dtype).to(device)
    tables = (torch.randperm(rows * per_row, generator=gen) + RESERVED_BLOCKS).view(rows, per_row)
    pads = torch.randint(0, 8, (rows,), generator=gen)  # left padding, as a batch has
    q = torch.randn(rows, HEADS, 1, DIM, generator=gen).to(dtype).to(device)
    return k, v, tables, pads, q, pool


def gather_step(k, v, tables, pads, q, col):
    reads, _ = slot_maps(tables, pads, torch.zeros_like(pads), col, col + 1)
    reads = reads.to(q.device)
    keys, values = k[:, reads].transpose(0, 1), v[:, reads].transpose(0, 1)
    mask = additive(allowed_keys(pads.to(q.device), col, 1, col + 1, None), q.dtype)
    return grouped_attention(q, keys, values, mask)


def flex_step(k, v, tables, pads, q, col, pool):
    positions = (col - pads).view(-1, 1).to(q.device)
    lo, hi = paged.bounds(positions, None)
    return paged.attend(q, k, v, paged.paged_mask(tables.to(q.device), lo, hi, pool))


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(rows: int, context: int, rounds: int, dtype: torch.dtype, device: torch.device) -> dict:
    k, v, tables, pads, q, pool = setup(rows, context, dtype, device)
    col = context + 7  # every row's position: context - 1 .. context + 6
    with torch.inference_mode():
        want = gather_step(k, v, tables, pads, q, col)
        first = timed(lambda: flex_step(k, v, tables, pads, q, col, pool), device)  # compiles, the first time
        err = (flex_step(k, v, tables, pads, q, col, pool).float() - want.float()).abs().max().item()
        ways = {"gather": lambda: gather_step(k, v, tables, pads, q, col),
                "in_place": lambda: flex_step(k, v, tables, pads, q, col, pool)}
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(rounds):
            for name, fn in ways.items():
                times[name].append(timed(fn, device))
    kv_bytes = 2 * rows * (col + 1) * KV_HEADS * DIM * k.element_size()  # the rows' K and V, padding included
    median = {w: statistics.median(t) for w, t in times.items()}
    return {"rows": rows, "context": context, "dtype": str(dtype).removeprefix("torch."), "device": device.type,
            "gather_ms": 1e3 * median["gather"], "in_place_ms": 1e3 * median["in_place"],
            "speedup": median["gather"] / median["in_place"], "max_abs_diff": err,
            "gather_bytes": 3 * kv_bytes, "in_place_bytes": kv_bytes,
            "first_call_s": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reference", action="store_true",
                    help="flex_attention uncompiled (a dry run's: it scores every row against the whole pool)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.reference:
        from torch.nn.attention.flex_attention import flex_attention
        paged._compiled[device.type] = flex_attention
    results = []
    t = time.perf_counter()
    for context in (int(c) for c in args.contexts.split(",")):
        r = measure(args.rows, context, args.rounds, dtype, device)
        results.append(r)
        print(f"rows {r['rows']:3d} context {context:6d} {r['dtype']}: gather {r['gather_ms']:8.2f} ms, "
              f"in place {r['in_place_ms']:8.2f} ms ({r['speedup']:.2f}x); bytes {r['gather_bytes'] / 2**20:.0f} "
              f"-> {r['in_place_bytes'] / 2**20:.0f} MiB; max |diff| {r['max_abs_diff']:.1e}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": results, "torch": torch.__version__, "load": os.getloadavg(),
                           "seconds": time.perf_counter() - t}, f, indent=1)


if __name__ == "__main__":
    main()
