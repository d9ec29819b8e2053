"""Decode speed of a rank that streams some of its layers (offload) against the limit measured in the
same run and against HF accelerate's offload at the same memory budget.

On the random Llama of bench/decode.py (hidden 2048, 16 layers, 853M parameters), written as a
float32 and as a bfloat16 checkpoint (so streamed layers are read as the rank stores them), batch
1, a 32-token prompt and 64 new tokens, one rank (TP=1, one compute thread; its prefetch thread
reads beside it), for 0%, 25%, 50% and 100% of the layers streamed, it measures:

* the limit: max(compute, streamed bytes / fetch bandwidth), where compute is the decode step of
  the fully resident rank (the 0% run) and the fetch bandwidth is the rate at which the rank's
  prefetch thread brings every layer's projections in from the page-cached checkpoint
  (`Streamer.fetch`, best of 3 passes, alone: mapping them in place, or copying what it must);
* a bound that limit leaves out on a CPU: compute and copies share the memory bus, and a copy
  reads and writes its bytes, which the compute then reads again, so a step moves at least
  (decode bytes + 2 x copied bytes) at the 2-core streaming read bandwidth (bench/decode.py's);
  a layer computed on in place is read once, as a resident one is;
* our rank: tokens/s, and the shares of a decode step spent streaming (on the prefetch thread) and
  stalled (the forward pass waiting for a layer); the plan's predicted step beside it;
* HF accelerate's offload of the same checkpoint at the same budget: `from_pretrained(device_map=
  "auto", max_memory={"cpu": what our rank holds of weights and staging}, offload_folder=...)`,
  whose disk-offloaded layers are read from the files by hooks, synchronously, before each one
  runs (1 thread).

The budgets come from the planner: the largest device budget at which it streams that share of
the layers (tests/support/offload.py), and policy always for 100%. Every figure is a child process
run one after another, so they compare within one run on a machine whose load changes. Usage:

    nice python bench/offload.py [--quick] [--dtypes float32,bfloat16] [--tokens 64] [--skip accelerate]
                                 [--out FILE.json]

`--quick` uses a small model of 16 layers to check the script in a few minutes. accelerate is an
optional need of this bench (`pip install accelerate`); without it that column says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from decode import CACHE, FULL, PROMPT_TOKENS, STREAM_BYTES, _hf_decode_seconds, decode_bytes, ensure_checkpoint
from decode import run_child as run_script_child

QUICK = dict(hidden_size=256, intermediate_size=768, num_layers=16, num_heads=4, num_kv_heads=2, vocab_size=8000,
             max_position_embeddings=2048)
FRACTIONS = (0.0, 0.25, 0.5, 1.0)


# ---------------------------------------------------------------- children (one measurement each)
def child_read(model_dir: str, dtype: str, repeats: int) -> dict:
    """GB/s at which the rank's prefetch thread brings every layer's projections in from the
    page-cached checkpoint (each fetch also sends the layer before out, as a slot does), alone."""
    import torch

    from shard_contract.plan import OffloadPlan
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.model import Stage
    from shard_worker.model.offload import Streamer
    from shard_worker.model.slices import Layout
    from shard_worker.telemetry.accounting import Accounting

    torch.set_num_threads(1)
    config = ModelConfig.from_dir(model_dir)
    layers = list(range(config.num_layers))
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=False, has_lm_head=False)
    acct = Accounting()
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), acct), getattr(torch, dtype), torch.device("cpu"),
                  streamed=layers)
    plan = OffloadPlan(layers=layers, prefetch=1, streamed_bytes=0, compute_seconds=0, stream_seconds=0)
    streamer = Streamer(stage, plan, model_dir, acct)
    slot = streamer.slots[0]
    best = float("inf")
    try:
        nbytes = sum(p.nbytes for j in layers for parts in streamer.parts[j].values() for p in parts)
        for _ in range(repeats + 1):  # the first pass brings the files into the page cache
            start = time.perf_counter()
            for j in layers:
                streamer.fetch(j, slot, stale=slot.layer)
                slot.layer = j
            best = min(best, time.perf_counter() - start)
    finally:
        streamer.close()
    return {"gbps": nbytes / best / 1e9}


def child_accelerate(model_dir: str, dtype: str, budget: int, tokens: int, prompt: list[int], folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), device_map="auto",
                                                 max_memory={"cpu": budget}, offload_folder=folder).eval()
    placed = {}
    for device in model.hf_device_map.values():
        placed[str(device)] = placed.get(str(device), 0) + 1
    disk = [key for key, device in model.hf_device_map.items() if str(device) == "disk"]
    on_disk = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if any(name.startswith(key + ".") for key in disk))
    return {**_hf_decode_seconds(model, prompt, tokens), "placed": placed, "disk_bytes": on_disk}


# ---------------------------------------------------------------- the parent
def run_child(*args: str, threads: int) -> dict:
    return run_script_child(*args, threads=threads, script=__file__)


def streaming_plan(model_dir: str, dtype: str, fraction: float, max_len: int):
    from tests.support.offload import streaming_plan as plan_streaming

    return plan_streaming(Path(model_dir), 1, 1, fraction, max_len=max_len, dtype=dtype)


def run_ours(plan, model_dir: str, tokens: int, prompt: list[int]) -> dict:
    from shard_contract.wire import GenerateRequest, GenerateTask
    from shard_operator.local.launcher import run_generate

    task = GenerateTask(requests=[GenerateRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True)])
    result = run_generate(plan, model_dir, task, timeout=1800, threads_per_rank=1)
    (rank,) = result.ranks
    assert rank.report is not None, "the rank sent no report"
    g = rank.report.last_generate
    return {"seconds_per_token": result.decode_seconds / result.decode_steps,
            "stream_share": g["decode_stream_seconds"] / g["decode_seconds"],
            "stall_share": g["decode_stall_seconds"] / g["decode_seconds"],
            "streamed_per_step": g["decode_streamed_bytes"] / result.decode_steps}


def measure(model_dir: str, dtype: str, tokens: int, prompt: list[int], skip: set[str]) -> dict:
    def step(name: str, fn, *args, **kwargs):
        print(f"  {dtype} {name} ...", file=sys.stderr, flush=True)
        try:
            value = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- one failed variant must not lose the others
            value = {"error": str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}
        value["load"] = os.getloadavg()[0]
        print(f"  {dtype} {name}: {value}", file=sys.stderr, flush=True)
        return value

    out: dict = {"read": step("fetches of every layer", run_child, "read", model_dir, dtype, "3", threads=1),
                 "bytes": decode_bytes(model_dir, dtype, "none")}
    for fraction in FRACTIONS:
        plan = streaming_plan(model_dir, dtype, fraction, len(prompt) + tokens)
        rank = plan.ranks[0]
        off = rank.offload
        row = {"streamed_bytes": off.streamed_bytes if off else 0, "copied_bytes": off.copied_bytes if off else 0,
               "layers": len(off.layers) if off else 0,
               "predicted": plan.groups[0].critical_path_seconds,
               "budget": rank.predicted_bytes.weights + rank.predicted_bytes.staging}
        row["ours"] = step(f"ours, {fraction:.0%} streamed", run_ours, plan, model_dir, tokens, prompt)
        if "accelerate" not in skip:
            with tempfile.TemporaryDirectory(prefix="bench-offload-") as folder:
                row["accelerate"] = step(f"accelerate, {fraction:.0%} offloaded", run_child, "accelerate", model_dir,
                                         dtype, str(row["budget"]), str(tokens), ",".join(map(str, prompt)), folder,
                                         threads=1)
        out[f"{fraction:.2f}"] = row
    return out


def report(results: dict, bus: dict, shape: dict, tokens: int) -> str:
    lines = [f"Model: random Llama {shape}; batch 1, {PROMPT_TOKENS}-token prompt, {tokens} new tokens; one rank "
             "(one compute thread, its prefetch thread beside it); accelerate with one thread.",
             f"Streaming read on 2 cores (the shared bus): {bus.get('2', 0):.1f} GB/s (load {bus.get('load', 0):.1f}).",
             "",
             "| dtype | streamed | MiB/step (copied) | fetch GB/s | limit ms | bus bound ms | ours ms/token | tokens/s "
             "| limit / ours | streaming share | stall share | plan's ms | accelerate ms/token (MiB off) "
             "| accelerate / ours | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    goals = []
    for dtype, r in results.items():
        read = r["read"].get("gbps")
        compute = r["0.00"]["ours"].get("seconds_per_token")
        for fraction in FRACTIONS:
            row = r[f"{fraction:.2f}"]
            ours, acc = row["ours"], row.get("accelerate", {"error": "skipped"})
            t = ours.get("seconds_per_token")
            if t is None or compute is None or read is None:
                lines.append(f"| {dtype} | {fraction:.0%} | | | | | {ours.get('error', '')} | | | | | | | | |")
                continue
            limit = max(compute, row["streamed_bytes"] / (read * 1e9))
            bound = (r["bytes"] + 2 * row.get("copied_bytes", 0)) / (bus["2"] * 1e9) if bus.get("2") else 0.0
            a = acc.get("seconds_per_token")
            off = f" ({acc['disk_bytes'] / 2**20:.0f})" if a else ""
            lines.append(
                f"| {dtype} | {fraction:.0%} ({row['layers']} layers) | {row['streamed_bytes'] / 2**20:.0f} "
                f"({row.get('copied_bytes', 0) / 2**20:.0f}) | {read:.1f} "
                f"| {limit * 1e3:.1f} | {bound * 1e3:.1f} | {t * 1e3:.1f} | {1 / t:.2f} | {limit / t:.2f} "
                f"| {ours['stream_share']:.1%} | {ours['stall_share']:.1%} | {row['predicted'] * 1e3:.1f} "
                f"| {f'{a * 1e3:.1f}{off}' if a else acc.get('error', '')} | {f'{a / t:.2f}' if a else ''} "
                f"| {ours['load']:.1f} |")
            if fraction > 0:
                goals.append(f"| {dtype} | {fraction:.0%}: within 25% of the limit (limit / ours) | {limit / t:.2f} "
                             f"| >= 0.80 | {'met' if limit / t >= 0.8 else 'MISSED'} |")
                if a:
                    goals.append(f"| {dtype} | {fraction:.0%}: accelerate / ours | {a / t:.2f} | >= 1.50 "
                                 f"| {'met' if a / t >= 1.5 else 'MISSED'} |")
            if fraction == 0.25:
                goals.append(f"| {dtype} | 25%: stalls per step | {ours['stall_share']:.1%} | < 10% "
                             f"| {'met' if ours['stall_share'] < 0.1 else 'MISSED'} |")
    lines += ["", "| dtype | goal | measured | target | |", "|---|---|---|---|---|", *goals]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model of 16 layers, to check the script")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip", default="", help="comma-separated: accelerate")
    parser.add_argument("--out", type=Path, help="also write the raw figures as JSON here")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "read":
            out = child_read(rest[0], rest[1], int(rest[2]))
        else:
            out = child_accelerate(rest[0], rest[1], int(rest[2]), int(rest[3]), [int(t) for t in rest[4].split(",")],
                                   rest[5])
        print(json.dumps(out))
        return 0

    shape = QUICK if args.quick else FULL
    prompt = [(7 * i + 3) % shape["vocab_size"] for i in range(PROMPT_TOKENS)]
    skip = set(filter(None, args.skip.split(",")))
    load = os.getloadavg()
    bus = run_script_child("stream", str(STREAM_BYTES), "3", threads=2)  # bench/decode.py's streaming read
    bus["load"] = os.getloadavg()[0]
    results = {}
    for dtype in args.dtypes.split(","):
        directory = CACHE / f"bench-offload{'-quick' if args.quick else ''}-{dtype}"
        model_dir = str(ensure_checkpoint(directory, shape, dtype))
        results[dtype] = measure(model_dir, dtype, args.tokens, prompt, skip)
    text = report(results, bus, shape, args.tokens)
    print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f}\n")
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"shape": shape, "tokens": args.tokens, "bus": bus, "results": results},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
