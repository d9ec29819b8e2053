"""Decode speed of one worker rank on a GPU, beside HF transformers on the same GPU, the GPU's
measured read limit and the planner's prediction, in one run (bench/gpu_check.sh runs it on a
lent GPU machine, once per model).

Models (`--model`): `bench`, the 853M random Llama of bench/decode.py (its checkpoint writer,
stored in bfloat16); `8b`, a random Llama with Llama-3-8B's shapes (32 layers, hidden 4096, MLP
14336, 32 heads over 8 KV heads, vocabulary 128256), written fast from a pool of random values
(its values do not matter to speed); `tiny` and `tiny-8b`, small models of the same two kinds
for a dry run on a CPU. A 32-token prompt per row (each row its own) and N new tokens, greedy:

* the limit: the bytes a decode step reads (every weight but the embedding table, as the variant
  stores them: the planner's sizing) / the device's read bandwidth, measured as a torch `sum`
  over a 4 GiB buffer (best of 10, timed by CUDA events);
* ours: one rank built by `Worker.start` (as `python -m shard_worker` builds it) from a plan
  that puts it on the GPU, for each batch size (`--batches`, default 1,8,32): a warm-up generate
  (which captures that batch's decode graph), then the timed one; the engine's decode seconds
  over its decode steps. int8 runs once per CUDA product (`--int8-modes`, SHARD_INT8_CUDA). The
  plan's KV cache holds what the largest batch needs (`kv_memory`), not 0.9 of the card: the
  step does not read the pool's unused blocks, and the plan then fits any card that holds the
  weights (the device memory named in the plan is a nominal 80 GiB; an H100 has 79.6);
* predicted: the plan's decode step for that batch on a device of the measured bandwidth (the
  planner's step model, planning/step.py: its GPU constants are what this calibrates);
* HF transformers' `generate` on the same GPU and dtype with its static cache, which it
  compiles with torch.compile on CUDA (`--hf static`; `eager`: its dynamic cache): warm-ups,
  then a 1-token and an N-token generate (per token: the difference over N - 1). cuDNN's
  attention off, as in our worker (it rebuilds its graph at every new key length).

Every measurement is a child process: one that fails (a CUDA error poisons its process) is
reported with its traceback and the others still run. Ours in bfloat16 and int8 by the first
product named run first, then HF's peer (its compile is the longest), then the other int8
products. `--out` is rewritten after every measurement and `--deadline` stops starting new ones,
so a run cut short keeps what it measured.

    python bench/gpu_decode.py [--device cuda|cpu] [--model bench|8b|tiny|tiny-8b] [--tokens 128]
        [--batches 1,8,32] [--precisions bfloat16,int8] [--int8-modes compiled,int8pack]
        [--hf static|eager|none] [--prepare] [--model-dir DIR] [--out FILE.json] [--deadline S]

`--device cpu --model tiny` runs the same code on a CPU (its figures mean nothing). `--prepare`
only writes the checkpoint (a CPU job that bench/gpu_check.sh runs while the GPU tests run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode

PROMPT_TOKENS = decode.PROMPT_TOKENS
BANDWIDTH_BYTES = {"cuda": 4 * 2**30, "cpu": 256 * 2**20}
DEVICE_MEMORY = {"cuda": "80GiB", "cpu": "16GiB"}  # the rank's device in the plan (one rank, alone)
CHILD_TIMEOUT = 150.0  # one measurement, at most
# As `shardctl run` starts its ranks: gloo (the control group) and NCCL over loopback.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                vocab_size=128256, max_position_embeddings=8192)
SHAPES = {"bench": decode.FULL, "8b": LLAMA_8B,
          "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                       vocab_size=512, max_position_embeddings=512),
          "tiny-8b": dict(hidden_size=256, intermediate_size=896, num_layers=2, num_heads=8, num_kv_heads=2,
                          vocab_size=2048, max_position_embeddings=512)}
FAST_WRITE = {"8b", "tiny-8b"}  # written from a pool of random values, not by HF's model
SHARD_BYTES = 2 * 2**30


def write_fast_checkpoint(directory: Path, shape: dict, dtype: str = "bfloat16") -> Path:
    """A Llama checkpoint of `shape` whose tensors are slices of one pool of random values (at
    the scale `tests.support.checkpoints.randomize` gives: 1/sqrt(fan-in), norms near 1): seconds
    for 16 GB where building HF's model on a CPU takes minutes. Safetensors shards of 2 GiB."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from tests.support.checkpoints import hf_config

    marker = directory / "bench-shape.json"
    written = {**shape, "dtype": dtype, "writer": "pool"}
    if marker.exists() and json.loads(marker.read_text()) == written:
        return directory
    print(f"writing a random checkpoint to {directory} ...", file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config("llama", **shape)
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(2**24 + 7, generator=generator).to(getattr(torch, dtype))
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    files = 0

    def flush() -> None:
        nonlocal shard, files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard = {}

    for i, (name, size) in enumerate(sorted(names.items())):
        n = math.prod(size)
        start = (i * 7919) % (pool.numel() - 1)
        values = pool.roll(-start)[:n] if n <= pool.numel() else pool.repeat(n // pool.numel() + 1)[start:start + n]
        if name.endswith("norm.weight"):
            tensor = (1.0 + 0.2 * values.float()).to(pool.dtype)
        elif "embed_tokens" in name:
            tensor = values
        else:
            gain = 3.0 if name.startswith("lm_head") else 1.0
            tensor = (values.float() * (gain / math.sqrt(size[1]))).to(pool.dtype)
        shard[name] = tensor.reshape(size).contiguous()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            flush()
    flush()
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(directory)
    total = sum(math.prod(s) for s in names.values()) * pool.element_size()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    marker.write_text(json.dumps(written))
    return directory


def ensure_model(model: str, model_dir: Path) -> Path:
    if model in FAST_WRITE:
        return write_fast_checkpoint(model_dir, SHAPES[model])
    return decode.ensure_checkpoint(model_dir, SHAPES[model], dtype="bfloat16")


def kv_memory(kv_bytes_per_token: int, rows: int, max_len: int) -> str:
    """The plan's kvCacheMemory for `rows` sequences of `max_len` tokens: their whole blocks and
    the two reserved ones, a quarter more, in MiB."""
    from shard_contract.sharding import KV_BLOCK_SIZE, KV_RESERVED_BLOCKS, kv_blocks

    tokens = (rows * kv_blocks(max_len) + KV_RESERVED_BLOCKS) * KV_BLOCK_SIZE
    return f"{math.ceil(1.25 * tokens * kv_bytes_per_token / 2**20)}MiB"


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """A 32-token prompt per row, each its own."""
    return [[(7 * i + 3 + 11 * row) % vocab for i in range(PROMPT_TOKENS)] for row in range(batch)]


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


def child_ours(device: str, model_dir: str, dtype: str, quantization: str, int8_mode: str, tokens: int,
               batches: list[int], gb_per_s: float) -> dict:
    """One rank of our worker on `device`: load once, then per batch a warm-up and a timed generate."""
    os.environ.update({k: v for k, v in LOOPBACK.items() if k not in os.environ})
    if int8_mode:
        os.environ["SHARD_INT8_CUDA"] = int8_mode
    from shard_contract.env import WorkerEnv
    from shard_contract.wire import GenerateRequest
    from shard_operator.local.launcher import free_port, plan_local
    from shard_operator.planning.profile import profile_model
    from shard_worker.model import kernels
    from shard_worker.rank.runtime import Worker

    profile = profile_model(model_dir)
    vocab = profile.shape.vocab_size
    speed = f"@{gb_per_s / 1e3:.4f}" if gb_per_s > 0 else ""  # the measured read bandwidth, in TB/s
    max_len = PROMPT_TOKENS + tokens + 8
    kv = kv_memory(profile.kv_bytes_per_token(dtype), max(batches), max_len)

    def planned(batch: int):
        return plan_local(model_dir, 1, 1, dtype=dtype, quantization=quantization,
                          max_model_len=max_len, max_batch_size=batch,
                          devices=f"localhost:{DEVICE_MEMORY[device]}{speed}",
                          device_kind="gpu" if device == "cuda" else "cpu", kv_cache_memory=kv)

    plan = planned(max(batches))
    env = WorkerEnv(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp_size=1, pp_size=1,
                    plan_file="(in memory)", model_dir=model_dir, rendezvous_timeout=60)
    started = time.perf_counter()
    worker = Worker.start(env, plan)
    out_all = {"load_seconds": time.perf_counter() - started, "device": str(worker.stage.device),
               "dtype": str(worker.stage.dtype).removeprefix("torch."), "int8_mode": int8_mode or None,
               "resident_weights": worker.resident.weights, "planned_weights": plan.ranks[0].predicted_bytes.weights,
               "kernel": kernels.describe() if device == "cpu" else "torch (CUDA)", "batches": {}}
    try:
        for batch in batches:
            def run(n: int, batch: int = batch):
                return worker.engine.generate([GenerateRequest(prompt_ids=p, max_new_tokens=n, ignore_eos=True)
                                               for p in prompts(batch, vocab)])

            run(8)  # warm up: the kernels of prefill and decode shapes, this batch's decode graph
            out = run(tokens)
            step = out.decode_seconds / out.decode_steps
            out_all["batches"][str(batch)] = {
                "seconds_per_step": step, "tokens_per_s": batch / step, "prefill_seconds": out.prefill_seconds,
                "decode_steps": out.decode_steps,
                "predicted_step_seconds": planned(batch).groups[0].critical_path_seconds,
                "tokens": out.completions[0].token_ids[:16]}
            print(f"batch {batch}: {json.dumps(out_all['batches'][str(batch)])}", file=sys.stderr, flush=True)
        return out_all
    finally:
        worker.close()


def child_hf(device: str, model_dir: str, dtype: str, tokens: int, cache: str, batch: int) -> dict:
    """HF transformers' generate on `device`: its static cache (compiled on CUDA) or its dynamic one."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if device == "cuda":  # as our worker does: cuDNN's attention rebuilds its graph at every new length
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts(batch, model.config.vocab_size), device=device)
    static = {"cache_implementation": "static"} if cache == "static" else {}

    def timed(n: int):
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, **static)
        _sync(device)
        return time.perf_counter() - start, out

    with torch.inference_mode():
        started = time.perf_counter()
        timed(tokens)  # warm up: compiles (static cache on CUDA) and records its graphs
        warm = time.perf_counter() - started
        timed(tokens)
        prefill, _ = timed(1)
        total, out = timed(tokens)
    step = (total - prefill) / (tokens - 1)
    return {"seconds_per_step": step, "tokens_per_s": batch / step, "prefill_seconds": prefill,
            "first_generate_seconds": warm, "cache": cache, "batch": batch, "transformers": transformers.__version__,
            "compiled": cache == "static" and device == "cuda",
            "attention": getattr(model.config, "_attn_implementation", None),
            "tokens": out[0, PROMPT_TOKENS:PROMPT_TOKENS + 16].tolist()}


# ---------------------------------------------------------------- the parent
def step(name: str, errors: list[str], deadline: float, *args: str) -> dict:
    """One child, timed and printed; a failure is kept (with its traceback's tail) and run on."""
    left = deadline - time.monotonic()
    if left < 15:
        errors.append(f"{name}: not run, out of time")
        print(f"[{time.strftime('%H:%M:%S')}] {name}: not run, out of time", file=sys.stderr, flush=True)
        return {"error": "not run: out of time"}
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        value = decode.run_child(*args, timeout=min(CHILD_TIMEOUT, left - 5), threads=os.cpu_count() or 1,
                                 script=__file__)
    except Exception as err:  # noqa: BLE001 -- one failed measurement must not lose the others
        text = str(err).strip() or type(err).__name__
        errors.append(f"{name}: {text.splitlines()[-1]}")
        said = getattr(err, "stderr", None)  # what a child past its time printed (subprocess.TimeoutExpired)
        said = said.decode(errors="replace") if isinstance(said, bytes) else said or ""
        if said:
            text += "\n" + said[-3000:]
        print(f"[{time.strftime('%H:%M:%S')}] {name} FAILED:\n{text}", file=sys.stderr, flush=True)
        failed: dict = {"error": text[-2000:]}
        done = finished_batches(said + "\n" + text)
        if done:  # the batches it measured before it failed or ran out of time
            failed["batches"] = done
        return failed
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(value)} ({time.perf_counter() - started:.1f} s)",
          file=sys.stderr, flush=True)
    return value


def finished_batches(output: str) -> dict[str, dict]:
    """The batches an `ours` child printed as it measured them ("batch N: {...}" on its stderr),
    from the output of one that failed or ran out of time: what it measured stays in the report."""
    done = {}
    for line in output.splitlines():
        match = re.match(r"^batch (\d+): (\{.*\})$", line.strip())
        if match:
            try:
                done[match.group(1)] = json.loads(match.group(2))
            except json.JSONDecodeError:  # a line cut off as the child was stopped
                continue
    return done


def rows(report: dict) -> list[dict]:
    """One row per (variant, batch): tokens/s, share of the limit, predicted vs measured, vs HF."""
    gbps = report["bandwidth"].get("gb_per_s")
    out = []
    for variant, r in report["results"].items():
        limit_step = r["bytes"] / (gbps * 1e9) if gbps else None
        hf = r.get("hf", {})
        for batch, b in (r.get("ours", {}).get("batches") or {}).items():
            measured = b["seconds_per_step"]
            peer = hf.get(batch, {})
            out.append({"variant": variant, "batch": int(batch), "tokens_per_s": b["tokens_per_s"],
                        "share_of_limit": limit_step / measured if limit_step else None,
                        "predicted_ms": b["predicted_step_seconds"] * 1e3, "measured_ms": measured * 1e3,
                        "predicted_over_measured": b["predicted_step_seconds"] / measured,
                        "hf_tokens_per_s": peer.get("tokens_per_s"),
                        "ours_over_hf": peer["seconds_per_step"] / measured if "seconds_per_step" in peer else None,
                        "same_first_tokens": _same(b.get("tokens"), peer.get("tokens"))})
    return out


def _same(ours: list[int] | None, theirs: list[int] | None) -> int | None:
    """How many first tokens agree (greedy from the same prompt: all, until a near-tie)."""
    if not ours or not theirs:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))


def table(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"device: {report['probe'].get('name', report['device'])}; torch {report['probe'].get('torch')} "
             f"(CUDA {report['probe'].get('cuda_build')}); read bandwidth {bw.get('gb_per_s', float('nan')):.0f} GB/s "
             f"(sum over {bw.get('bytes', 0) / 2**30:.2f} GiB)",
             f"model {report['model']}: random Llama {report['shape']}; {PROMPT_TOKENS}-token prompts, "
             f"{report['tokens']} new tokens", "",
             "| variant | MiB read a step | batch | ours tok/s | share of limit | predicted ms | measured ms "
             "| predicted / measured | HF tok/s | ours / HF | same first tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(value, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    for row in rows(report):
        r = report["results"][row["variant"]]
        lines.append(f"| {row['variant']} | {r['bytes'] / 2**20:.0f} | {row['batch']} "
                     f"| {cell(row['tokens_per_s'], '.1f')} "
                     f"| {cell(row['share_of_limit'], '.3f')} | {cell(row['predicted_ms'], '.2f')} "
                     f"| {cell(row['measured_ms'], '.2f')} | {cell(row['predicted_over_measured'], '.2f')} "
                     f"| {cell(row['hf_tokens_per_s'], '.1f')} | {cell(row['ours_over_hf'], '.2f')} "
                     f"| {cell(row['same_first_tokens'], 'd')} |")
    if report["errors"]:
        lines += ["", "FAILED or not run:", *(f"  {e}" for e in report["errors"])]
    return "\n".join(lines)


def variants(precisions: list[str], int8_modes: list[str]) -> list[tuple[str, str, str, str]]:
    """(name, dtype, quantization, int8 mode): bfloat16 first (the figure asked for), then int8 by product."""
    out = []
    for precision in precisions:
        dtype, quantization, _ = decode.PRECISIONS[precision]
        if quantization == "int8":
            out += [(f"int8 {mode}", dtype, quantization, mode) for mode in int8_modes]
        else:
            out.append((precision, dtype, quantization, ""))
    return out


def measure_order(chosen: list[tuple[str, str, str, str]], first_mode: str
                  ) -> tuple[list[tuple[str, str, str, str]], list[tuple[str, str, str, str]]]:
    """Which of our variants run before HF's peer, and which after it: the unquantized ones and
    int8 by the first product named (what issue 25 asks of a run) first, the other int8 products
    after (the deadline takes the last first)."""
    first = [v for v in chosen if v[3] in ("", first_mode)]
    return first, [v for v in chosen if v not in first]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens of the timed generate")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--precisions", default="bfloat16,int8")
    parser.add_argument("--int8-modes", default="compiled,int8pack", help="SHARD_INT8_CUDA values to measure")
    parser.add_argument("--hf", choices=("static", "eager", "none"), default="static",
                        help="the peer: HF's static cache (compiled on CUDA), its dynamic cache, or none")
    parser.add_argument("--hf-batches", default="1")
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint is kept (default "
                        "~/.cache/shard-operator/bench-gpu-decode-MODEL)")
    parser.add_argument("--prepare", action="store_true", help="only write the checkpoint")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here (after each measurement)")
    parser.add_argument("--deadline", type=float, default=3600, help="seconds after which no measurement starts")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, device, rest = args.child[0], args.child[1], args.child[2:]
        if kind == "probe":
            out = child_probe(device)
        elif kind == "bandwidth":
            out = child_bandwidth(device, int(rest[0]))
        elif kind == "ours":
            out = child_ours(device, rest[0], rest[1], rest[2], rest[3], int(rest[4]),
                             [int(b) for b in rest[5].split(",")], float(rest[6]))
        else:
            out = child_hf(device, rest[0], rest[1], int(rest[2]), rest[3], int(rest[4]))
        print(json.dumps(out))
        return 0

    deadline = time.monotonic() + args.deadline
    model_dir = args.model_dir or decode.CACHE / f"bench-gpu-decode-{args.model}"
    errors: list[str] = []
    report = {"device": args.device, "model": args.model, "shape": SHAPES[args.model], "tokens": args.tokens,
              "bandwidth": {}, "probe": {}, "results": {}, "rows": [], "errors": errors}

    def save() -> None:
        report["rows"] = rows(report)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    if not args.prepare:
        report["probe"] = step("probe", errors, deadline, "probe", args.device)
        save()
        if "error" in report["probe"]:
            print(f"gpu_decode: cannot run on {args.device}: {errors[-1]}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    model_dir = str(ensure_model(args.model, model_dir))
    print(f"[{time.strftime('%H:%M:%S')}] checkpoint {model_dir} ready ({time.perf_counter() - started:.0f} s)",
          file=sys.stderr, flush=True)
    if args.prepare:
        return 0
    report["bandwidth"] = step("read bandwidth", errors, deadline, "bandwidth", args.device,
                               str(BANDWIDTH_BYTES[args.device]))
    save()
    gbps = report["bandwidth"].get("gb_per_s", 0.0)
    int8_modes = args.int8_modes.split(",")
    chosen = variants(args.precisions.split(","), int8_modes)
    for name, dtype, quantization, _ in chosen:
        report["results"][name] = {"bytes": decode.decode_bytes(model_dir, dtype, quantization)}

    def ours(name: str, dtype: str, quantization: str, mode: str) -> None:
        report["results"][name]["ours"] = step(f"ours {name}", errors, deadline, "ours", args.device, model_dir,
                                               dtype, quantization, mode, str(args.tokens), args.batches, str(gbps))
        save()

    first, later = measure_order(chosen, int8_modes[0])
    for variant in first:
        ours(*variant)
    for name, dtype, quantization, _ in chosen:  # the peer, whose compile is the longest
        if quantization == "none" and args.hf != "none":
            hf = report["results"][name]["hf"] = {}
            for batch in args.hf_batches.split(","):
                hf[batch] = step(f"hf {name} batch {batch}", errors, deadline, "hf", args.device, model_dir,
                                 dtype, str(args.tokens), args.hf, batch)
                save()
    for variant in later:
        ours(*variant)
    print(table(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
