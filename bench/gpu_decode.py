"""Decode speed of one worker rank on a GPU, beside HF transformers on the same GPU and the GPU's
memory-bandwidth limit, in one run (bench/gpu_check.sh runs it on a lent GPU machine).

The 853M random Llama of bench/decode.py (written by its checkpoint writer, stored in bfloat16),
batch 1, a 32-token prompt and N new tokens (default 128), greedy:

* the limit: the bytes a decode step reads (every weight but the embedding table, as the variant
  stores them: the planner's sizing) / the device's read bandwidth, measured as a torch `sum` over
  a 4 GiB buffer (best of 10, timed by CUDA events);
* our worker: one rank built by `Worker.start` (as `python -m shard_worker` builds it) from a plan
  that puts it on the GPU; a warm-up generate, then the timed one: the engine's decode seconds
  over its decode steps;
* HF transformers' `generate`, the same checkpoint in the same dtype on the same GPU: a warm-up,
  then a 1-token and an N-token generate (per token: the difference over N - 1). Like our worker,
  with cuDNN's attention off: torch picks it for bfloat16 on Hopper and it builds a new graph at
  every new key length (~45 ms a token; docs/benchmarks.md has HF's figures with it on).

Precisions: bfloat16 (the figure asked for), then int8 (our int8 weights with bfloat16
activations; HF has none here) and float32. Every measurement is a child process: one that fails
(a CUDA error poisons its process) is reported with its traceback and the others still run.

    python bench/gpu_decode.py [--device cuda|cpu] [--quick] [--tokens 128] [--prepare]
                               [--precisions bfloat16,int8,float32] [--model-dir DIR] [--out FILE.json]

`--device cpu --quick` runs the same code on a small model on a CPU: a check of the script where
there is no GPU (its figures mean nothing). `--prepare` only writes the checkpoint (a CPU job that
bench/gpu_check.sh runs while the GPU tests run). --out is rewritten after every measurement, so
a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode

PROMPT_TOKENS = decode.PROMPT_TOKENS
BANDWIDTH_BYTES = {"cuda": 4 * 2**30, "cpu": 256 * 2**20}
DEVICE_MEMORY = {"cuda": "80GiB", "cpu": "16GiB"}  # the rank's device in the plan (one rank, alone)
CHILD_TIMEOUT = 100.0  # one measurement; bench/gpu_check.sh gives the whole bench 130 s
# As `shardctl run` starts its ranks: gloo (the control group) and NCCL over loopback.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


# ---------------------------------------------------------------- children (one measurement each)
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child_probe(device: str) -> dict:
    """What this Python runs on; fails, saying why, where `device` is cuda and torch sees none."""
    import torch

    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no CUDA device")
        out.update(name=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    return out


def child_bandwidth(device: str, nbytes: int) -> dict:
    """GB/s of a torch sum over `nbytes` of float32 (reads it once), best of 10."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()  # warm up
    best = float("inf")
    for _ in range(10):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            x.sum()
            seconds = time.perf_counter() - start
        best = min(best, seconds)
    return {"bytes": nbytes, "gb_per_s": nbytes / best / 1e9}


def child_ours(device: str, model_dir: str, dtype: str, quantization: str, tokens: int, prompt: list[int]) -> dict:
    """One rank of our worker on `device`: load, a warm-up generate, the timed one."""
    os.environ.update({k: v for k, v in LOOPBACK.items() if k not in os.environ})
    from shard_contract.env import WorkerEnv
    from shard_contract.wire import GenerateRequest
    from shard_operator.local import free_port, plan_local
    from shard_worker import kernels
    from shard_worker.runtime import Worker

    plan = plan_local(model_dir, 1, 1, dtype=dtype, quantization=quantization, max_model_len=len(prompt) + tokens,
                      devices=f"localhost:{DEVICE_MEMORY[device]}", device_kind="gpu" if device == "cuda" else "cpu")
    env = WorkerEnv(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp_size=1, pp_size=1,
                    plan_file="(in memory)", model_dir=model_dir, rendezvous_timeout=60)
    started = time.perf_counter()
    worker = Worker.start(env, plan)
    load = time.perf_counter() - started
    try:
        def run(n: int):
            return worker.engine.generate([GenerateRequest(prompt_ids=prompt, max_new_tokens=n, ignore_eos=True)])

        run(8)  # warm up: the kernels of prefill and decode shapes
        out = run(tokens)
        figures = worker.engine.last_generate
        return {"seconds_per_token": out.decode_seconds / out.decode_steps, "prefill_seconds": out.prefill_seconds,
                "decode_steps": out.decode_steps, "load_seconds": load,
                "decode_compute_share": figures.get("decode_compute_seconds", 0) / figures.get("decode_seconds", 1),
                "device": str(worker.stage.device), "dtype": str(worker.stage.dtype).removeprefix("torch."),
                "resident_weights": worker.resident.weights, "planned_weights": plan.ranks[0].predicted_bytes.weights,
                "kernel": kernels.describe() if device == "cpu" else "torch (CUDA)",
                "tokens": out.completions[0].token_ids[:16]}
    finally:
        worker.close()


def child_hf(device: str, model_dir: str, dtype: str, tokens: int, prompt: list[int]) -> dict:
    """HF transformers' generate on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cuda":  # as our worker does: cuDNN's attention rebuilds its graph at every new length
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def timed(n: int):
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        _sync(device)
        return time.perf_counter() - start, out

    with torch.inference_mode():
        timed(2)  # warm up
        prefill, _ = timed(1)
        total, out = timed(tokens)
    return {"seconds_per_token": (total - prefill) / (tokens - 1), "prefill_seconds": prefill,
            "attention": getattr(model.config, "_attn_implementation", None),
            "tokens": out[0, len(prompt):len(prompt) + 16].tolist()}


# ---------------------------------------------------------------- the parent
def step(name: str, errors: list[str], *args: str) -> dict:
    """One child, timed and printed; a failure is kept (with its traceback's tail) and run on."""
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        value = decode.run_child(*args, timeout=CHILD_TIMEOUT, threads=os.cpu_count() or 1, script=__file__)
    except Exception as err:  # noqa: BLE001 -- one failed measurement must not lose the others
        text = str(err).strip() or type(err).__name__
        print(f"[{time.strftime('%H:%M:%S')}] {name} FAILED:\n{text}", file=sys.stderr, flush=True)
        errors.append(f"{name}: {text.splitlines()[-1]}")
        return {"error": text[-2000:]}
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(value)} ({time.perf_counter() - started:.1f} s)",
          file=sys.stderr, flush=True)
    return value


def summarize(results: dict, bandwidth: dict) -> None:
    """Per precision: the limit and each engine's tokens/s, its share of the limit, ours vs HF."""
    for r in results.values():
        limit = r["bytes"] / (bandwidth["gb_per_s"] * 1e9) if "gb_per_s" in bandwidth else None
        r["limit_tokens_per_s"] = 1 / limit if limit else None
        for engine in ("ours", "hf"):
            seconds = r.get(engine, {}).get("seconds_per_token")
            if seconds:
                r[engine]["tokens_per_s"] = 1 / seconds
                r[engine]["share_of_limit"] = limit / seconds if limit else None
        ours, hf = (r.get(e, {}).get("seconds_per_token") for e in ("ours", "hf"))
        r["ours_vs_hf"] = hf / ours if ours and hf else None
        ours_tokens, hf_tokens = (r.get(e, {}).get("tokens") for e in ("ours", "hf"))
        if ours_tokens and hf_tokens:  # greedy from the same prompt: the same tokens until a near-tie
            same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens, strict=False)) if a != b),
                        len(ours_tokens))
            r["same_first_tokens"] = same


def table(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"device: {report['probe'].get('name', report['device'])}; torch {report['probe'].get('torch')} "
             f"(CUDA {report['probe'].get('cuda_build')}); read bandwidth {bw.get('gb_per_s', float('nan')):.0f} GB/s "
             f"(sum over {bw.get('bytes', 0) / 2**30:.2f} GiB)",
             f"model: random Llama {report['shape']}; batch 1, {PROMPT_TOKENS}-token prompt, "
             f"{report['tokens']} new tokens", "",
             "| precision | MiB read a token | limit tok/s | ours tok/s | ours share of limit | HF tok/s "
             "| HF share of limit | ours / HF | same first tokens |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(value, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    for precision, r in report["results"].items():
        ours, hf = r.get("ours", {}), r.get("hf", {})
        lines.append(f"| {precision} | {r['bytes'] / 2**20:.0f} | {cell(r['limit_tokens_per_s'], '.0f')} "
                     f"| {cell(ours.get('tokens_per_s'), '.1f') if 'error' not in ours else 'FAILED'} "
                     f"| {cell(ours.get('share_of_limit'), '.3f')} "
                     f"| {cell(hf.get('tokens_per_s'), '.1f') if 'error' not in hf else 'FAILED'} "
                     f"| {cell(hf.get('share_of_limit'), '.3f')} | {cell(r['ours_vs_hf'], '.2f')} "
                     f"| {r.get('same_first_tokens', '-')} |")
    if report["errors"]:
        lines += ["", "FAILED:", *(f"  {e}" for e in report["errors"])]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="bench/decode.py's small model, to check the script")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens of the timed generate")
    parser.add_argument("--precisions", default="bfloat16,int8,float32")
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint is kept (default "
                        "~/.cache/shard-operator/bench-gpu-decode[-quick])")
    parser.add_argument("--prepare", action="store_true", help="only write the checkpoint")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here (after each measurement)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, device, rest = args.child[0], args.child[1], args.child[2:]
        if kind == "probe":
            out = child_probe(device)
        elif kind == "bandwidth":
            out = child_bandwidth(device, int(rest[0]))
        elif kind == "ours":
            out = child_ours(device, rest[0], rest[1], rest[2], int(rest[3]), [int(t) for t in rest[4].split(",")])
        else:
            out = child_hf(device, rest[0], rest[1], int(rest[2]), [int(t) for t in rest[3].split(",")])
        print(json.dumps(out))
        return 0

    shape = decode.QUICK if args.quick else decode.FULL
    model_dir = args.model_dir or decode.CACHE / ("bench-gpu-decode-quick" if args.quick else "bench-gpu-decode")
    errors: list[str] = []
    report = {"device": args.device, "shape": shape, "tokens": args.tokens, "bandwidth": {}, "results": {},
              "errors": errors}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    if not args.prepare:
        report["probe"] = step("probe", errors, "probe", args.device)
        save()
        if "error" in report["probe"]:
            print(f"gpu_decode: cannot run on {args.device}: {errors[-1]}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    model_dir = str(decode.ensure_checkpoint(model_dir, shape, dtype="bfloat16"))
    print(f"[{time.strftime('%H:%M:%S')}] checkpoint {model_dir} ready ({time.perf_counter() - started:.0f} s)",
          file=sys.stderr, flush=True)
    if args.prepare:
        return 0
    prompt = ",".join(str((7 * i + 3) % shape["vocab_size"]) for i in range(PROMPT_TOKENS))
    report["bandwidth"] = step("read bandwidth", errors, "bandwidth", args.device, str(BANDWIDTH_BYTES[args.device]))
    save()
    for precision in args.precisions.split(","):
        dtype, quantization, _ = decode.PRECISIONS[precision]
        r = report["results"][precision] = {"bytes": decode.decode_bytes(model_dir, dtype, quantization)}
        r["ours"] = step(f"ours {precision}", errors, "ours", args.device, model_dir, dtype, quantization,
                         str(args.tokens), prompt)
        if quantization == "none":
            r["hf"] = step(f"hf {precision}", errors, "hf", args.device, model_dir, dtype, str(args.tokens), prompt)
        summarize(report["results"], report["bandwidth"])
        save()
    print(table(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
