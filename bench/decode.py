"""Decode speed of the sharded worker against its peers and the memory-bandwidth limit, in one run.

On one random Llama (hidden 2048, 16 layers, 16 heads, 4 KV heads, MLP 5632, vocab 32000: 853M
parameters), for float32 and bfloat16, one thread per rank, batch 1, a 32-token prompt and 64 new
tokens, it measures:

* the decode limit: every weight a decode step reads (all but the embedding table), streamed once
  through `F.linear` with a single vector (a bare matrix-vector product) on 1 core; and on 2 cores,
  the faster of 2 threads in one process and 2 one-thread processes streaming half each;
* HF transformers' `generate` with 1 and with 2 threads;
* our worker (`python -m shard_worker` ranks, started by the local launcher) at TP=1, TP=2, PP=2,
  with the share of each decode step spent communicating (and idle, waiting for another stage);
* PyTorch's own tensor-parallel API (`parallelize_module`, 2 ranks x 1 thread, gloo), if it runs.

Every figure is a child process run one after another, so the variants compare within one run on
a machine whose load changes. Usage:

    python bench/decode.py [--quick] [--dtypes float32,bfloat16] [--tokens 64] [--out FILE.json]

`--quick` uses a small model to check the script end to end in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support.checkpoints writes the model

FULL = dict(hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=16, num_kv_heads=4,
            vocab_size=32000, max_position_embeddings=2048)
QUICK = dict(hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2,
             vocab_size=8000, max_position_embeddings=2048)
PROMPT_TOKENS = 32


# ---------------------------------------------------------------- children (one measurement each)
def child_matvec(model_dir: str, dtype: str, repeats: int, threads: list[int], share: str = "0/1") -> dict:
    """Seconds to stream decode-time weights once through F.linear with one vector, for each
    thread count. `share` "i/n" takes every n-th weight from the i-th: a process of a group of n
    that together stream the model (what n TP ranks do)."""
    import torch
    import torch.nn.functional as F
    from safetensors import safe_open

    part, parts = (int(v) for v in share.split("/"))
    index = Path(model_dir) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    names = []
    for file in files:
        with safe_open(Path(model_dir) / file, "pt") as f:
            names += [(file, n) for n in sorted(f.keys()) if n.endswith("proj.weight") or n == "lm_head.weight"]
    weights = []
    for file, name in sorted(names, key=lambda fn: fn[1])[part::parts]:
        with safe_open(Path(model_dir) / file, "pt") as f:
            weights.append(f.get_tensor(name).to(getattr(torch, dtype)).contiguous())
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=weights[0].dtype) for w in weights}
    out = {"bytes": sum(w.numel() * w.element_size() for w in weights)}
    with torch.inference_mode():
        for n in threads:
            torch.set_num_threads(n)
            for w in weights:  # warm up
                F.linear(inputs[w.shape[1]], w)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)
                best = min(best, time.perf_counter() - start)
            out[str(n)] = best
    return out


def run_matvec(model_dir: str, dtype: str) -> dict:
    """The decode limit on 1 core, on 2 threads of one process, and on 2 one-thread processes
    streaming half the weights each at the same time (TP=2's shape of work)."""
    one_process = run_child("matvec", model_dir, dtype, "5", "1,2", "0/1")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "matvec", model_dir, dtype, "5", "1", f"{i}/2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    halves = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
    two_processes = max(h["1"] for h in halves)  # done when the slower half is
    return {"bytes": one_process["bytes"], "1": one_process["1"], "2 threads": one_process["2"],
            "2 processes": two_processes, "2": min(one_process["2"], two_processes)}


def _hf_decode_seconds(model, prompt, tokens: int) -> dict:
    import torch

    ids = torch.tensor([prompt])
    common = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **common)  # warm up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **common)
        total = time.perf_counter() - start
    return {"seconds_per_token": (total - prefill) / (tokens - 1), "prefill_seconds": prefill}


def child_hf(model_dir: str, dtype: str, threads: int, tokens: int, prompt: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return _hf_decode_seconds(model, prompt, tokens)


def child_torch_tp(model_dir: str, dtype: str, tokens: int, prompt: list[int], rank: int, world: int,
                   port: int) -> dict:
    """HF's model split with torch.distributed.tensor.parallel (DTensor), one thread per rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    result = _hf_decode_seconds(model, prompt, tokens)
    dist.destroy_process_group()
    return result


# ---------------------------------------------------------------- the parent
def run_child(*args: str, timeout: float = 1800) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_torch_tp(model_dir: str, dtype: str, tokens: int, prompt: list[int]) -> dict:
    from shard_operator.local import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "torch-tp", model_dir, dtype, str(tokens),
                               ",".join(map(str, prompt)), str(rank), "2", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        err = next(o[1] for p, o in zip(procs, outs) if p.returncode != 0)
        return {"error": err.strip().splitlines()[-1] if err.strip() else "failed"}
    return json.loads(outs[0][0].strip().splitlines()[-1])


def run_ours(model_dir: str, dtype: str, tp: int, pp: int, tokens: int, prompt: list[int]) -> dict:
    from shard_contract.wire import GenerateRequest, GenerateTask
    from shard_operator.local import plan_local, run_generate

    plan = plan_local(model_dir, tp, pp, dtype=dtype, max_model_len=len(prompt) + tokens,
                      devices="bench:16GiB*2", device_kind="cpu")
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True)])
    result = run_generate(plan, model_dir, task, timeout=1800, threads_per_rank=1)
    ranks = [r.last_generate for r in result.ranks]
    return {"seconds_per_token": result.decode_seconds / result.decode_steps,
            "prefill_seconds": result.prefill_seconds,
            "comm_share": max(r["decode_comm_seconds"] / r["decode_seconds"] for r in ranks),
            "idle_share": max(r["decode_idle_seconds"] / r["decode_seconds"] for r in ranks),
            "load_seconds": max(r.load_seconds for r in result.ranks)}


def ensure_checkpoint(directory: Path, shape: dict) -> Path:
    marker = directory / "bench-shape.json"
    if marker.exists() and json.loads(marker.read_text()) == shape:
        return directory
    from tests.support.checkpoints import write_checkpoint

    print(f"writing a random checkpoint to {directory} ...", file=sys.stderr, flush=True)
    write_checkpoint(directory, "llama", seed=0, max_shard_size="2GB", **shape)
    marker.write_text(json.dumps(shape))
    return directory


def measure(model_dir: str, dtype: str, tokens: int, prompt: list[int]) -> dict:
    def step(name: str, fn, *args):
        print(f"  {dtype} {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        value = fn(*args)
        value["load"] = os.getloadavg()[0]  # 1-minute load average at the end (our own ranks included)
        print(f"  {dtype} {name}: {value} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        return value

    ids = ",".join(map(str, prompt))
    return {
        "matvec": step("matvec", run_matvec, model_dir, dtype),
        "hf1": step("hf 1 thread", run_child, "hf", model_dir, dtype, "1", str(tokens), ids),
        "hf2": step("hf 2 threads", run_child, "hf", model_dir, dtype, "2", str(tokens), ids),
        "tp1": step("ours TP=1", run_ours, model_dir, dtype, 1, 1, tokens, prompt),
        "tp2": step("ours TP=2", run_ours, model_dir, dtype, 2, 1, tokens, prompt),
        "pp2": step("ours PP=2", run_ours, model_dir, dtype, 1, 2, tokens, prompt),
        "torch_tp2": step("parallelize_module TP=2", run_torch_tp, model_dir, dtype, tokens, prompt),
    }


def report(results: dict, shape: dict, tokens: int) -> str:
    lines = [f"Model: random Llama {shape}; batch 1, {PROMPT_TOKENS}-token prompt, {tokens} new tokens; "
             "one thread per rank.", "",
             "| dtype | variant | ms/token | tokens/s | limit / measured | comm share | idle share | load |",
             "|---|---|---|---|---|---|---|---|"]
    goals = []
    for dtype, r in results.items():
        limit1, limit2 = r["matvec"]["1"], r["matvec"]["2"]
        mv = r["matvec"]
        rows = [("decode limit, 1 core (bare mat-vec)", limit1, limit1, mv),
                ("bare mat-vec, 2 threads of 1 process", mv["2 threads"], limit2, mv),
                ("bare mat-vec, 2 processes x half the weights", mv["2 processes"], limit2, mv),
                ("HF transformers generate, 1 thread", r["hf1"]["seconds_per_token"], limit1, r["hf1"]),
                ("HF transformers generate, 2 threads", r["hf2"]["seconds_per_token"], limit2, r["hf2"]),
                ("shard worker TP=1", r["tp1"]["seconds_per_token"], limit1, r["tp1"]),
                ("shard worker TP=2 (2 processes)", r["tp2"]["seconds_per_token"], limit2, r["tp2"]),
                ("shard worker PP=2 (2 processes)", r["pp2"]["seconds_per_token"], limit1, r["pp2"])]
        if "error" in r["torch_tp2"]:
            lines.append(f"| {dtype} | PyTorch parallelize_module TP=2 | failed: {r['torch_tp2']['error']} "
                         f"| | | | | {r['torch_tp2']['load']:.1f} |")
        else:
            rows.append(("PyTorch parallelize_module TP=2", r["torch_tp2"]["seconds_per_token"], limit2, r["torch_tp2"]))
        for name, seconds, limit, figures in rows:
            shares = (f"{figures['comm_share']:.1%} | {figures['idle_share']:.1%}" if "comm_share" in figures
                      else " | ")
            lines.append(f"| {dtype} | {name} | {seconds * 1e3:.1f} | {1 / seconds:.2f} | {limit / seconds:.2f} "
                         f"| {shares} | {figures['load']:.1f} |")
        tp1, tp2, hf2 = r["tp1"]["seconds_per_token"], r["tp2"]["seconds_per_token"], r["hf2"]["seconds_per_token"]
        checks = [("TP=2 speed-up over TP=1", tp1 / tp2, ">= 1.6", tp1 / tp2 >= 1.6),
                  ("TP=2 vs the 2-core decode limit (limit / TP=2)", limit2 / tp2, ">= 0.85", limit2 / tp2 >= 0.85),
                  ("TP=2 vs HF with 2 threads (HF / TP=2)", hf2 / tp2, ">= 0.95", hf2 / tp2 >= 0.95),
                  ("TP=1 vs the 1-core matrix-vector bandwidth (limit / TP=1)", limit1 / tp1, ">= 0.70",
                   limit1 / tp1 >= 0.70)]
        if "error" not in r["torch_tp2"]:
            torch_tp = r["torch_tp2"]["seconds_per_token"]
            checks.append(("TP=2 vs parallelize_module TP=2 (theirs / ours)", torch_tp / tp2, "well above 1",
                           torch_tp / tp2 > 1.2))
        for name, value, goal, ok in checks:
            goals.append(f"| {dtype} | {name} | {value:.2f} | {goal} | {'met' if ok else 'MISSED'} |")
    lines += ["", "| dtype | goal | measured | target | |", "|---|---|---|---|---|", *goals]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, to check the script")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint is kept "
                        "(default ~/.cache/shard-operator/bench-decode[-quick])")
    parser.add_argument("--out", type=Path, help="also write the raw figures as JSON here")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "matvec":
            out = child_matvec(rest[0], rest[1], int(rest[2]), [int(t) for t in rest[3].split(",")], rest[4])
        elif kind == "hf":
            out = child_hf(rest[0], rest[1], int(rest[2]), int(rest[3]), [int(t) for t in rest[4].split(",")])
        else:
            out = child_torch_tp(rest[0], rest[1], int(rest[2]), [int(t) for t in rest[3].split(",")],
                                 int(rest[4]), int(rest[5]), int(rest[6]))
        print(json.dumps(out))
        return 0

    shape = QUICK if args.quick else FULL
    default_dir = Path.home() / ".cache" / "shard-operator" / ("bench-decode-quick" if args.quick else "bench-decode")
    model_dir = str(ensure_checkpoint(args.model_dir or default_dir, shape))
    prompt = [(7 * i + 3) % shape["vocab_size"] for i in range(PROMPT_TOKENS)]
    load = os.getloadavg()
    results = {dtype: measure(model_dir, dtype, args.tokens, prompt) for dtype in args.dtypes.split(",")}
    text = report(results, shape, args.tokens)
    print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f}\n")
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"shape": shape, "tokens": args.tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
