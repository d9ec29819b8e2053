"""Decode speed of the sharded worker against the machine's memory-bandwidth limit and its peers,
in one run.

On one random Llama (hidden 2048, 16 layers, 16 heads, 4 KV heads, MLP 5632, vocab 32000: 853M
parameters), batch 1, a 32-token prompt and 64 new tokens, for float32, bfloat16 and int8 weights
(int8: bfloat16 activations, beside llama.cpp's Q8_0), it measures:

* the limit: a plain streaming read of a buffer far larger than the caches (vector loads summed,
  `shard_worker._gemv.read`, the faster of 1 and 4 streams a core) on 1 core and on 2, the
  median of back-to-back reads for a few seconds, on transparent huge pages as the worker's
  weights are (torch's THP_MEM_ALLOC_ENABLE: a read on 4 KiB pages is 3-15% slower here, so the
  limit is the faster), measured again before and after each variant: every variant is reported
  against the bytes a decode step reads (every weight but the embedding table, as the variant
  stores them) divided by the mean of the two reads around it (the bandwidth of that minute).
  Where those two reads differ by more than 15%, the host moved our cores while the variant ran
  (two cores read ~35 GB/s together most of the time here, ~55-60 in bursts), and the variant is
  measured again;
* the bare matrix-vector products over those weights: torch's GEMV (`F.linear`) and ours
  (`shard_worker.model.kernels`), with 1 and 2 threads, each beside a streaming read in the same process;
* HF transformers' `generate` with 1 and 2 threads (float32, bfloat16);
* our worker (`python -m shard_worker` ranks, started by the local launcher) at TP=1 with 1 and
  with 2 threads, TP=2 and PP=2 (one thread a rank), with the share of each decode step spent
  communicating (and idle, waiting for another stage);
* llama.cpp (llama-cpp-python, built from source in its own virtualenv: see
  bench/llamacpp_peer.py) on the same model as GGUF (F32, BF16, Q8_0) with 1 and 2 threads, and
  its layers split over two processes (its RPC backend) beside our PP=2, where it is set up; the
  bench says why where it is not;
* PyTorch's own tensor-parallel API (`parallelize_module`, 2 ranks x 1 thread, gloo), if it runs.

Every figure is a child process run one after another, so the variants compare within one run on
a machine whose load changes. The bandwidth these machines get from memory drifts from minute to
minute (their host is shared: two cores read 31-60 GB/s within an hour), so `--rounds N` measures
everything N times in turn, the limit included, and reports the median of each figure. Usage:

    nice python bench/decode.py [--quick] [--precisions float32,bfloat16,int8] [--tokens 64]
                                [--skip hf,torch-tp,llama] [--rounds 1] [--out FILE.json]

`--quick` uses a small model to check the script end to end in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support.checkpoints writes the model

FULL = dict(hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=16, num_kv_heads=4,
            vocab_size=32000, max_position_embeddings=2048)
QUICK = dict(hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2,
             vocab_size=8000, max_position_embeddings=2048)
PROMPT_TOKENS = 32
STREAM_BYTES = 2 * 2**30  # four times this machine's L3 (480 MiB)
STEADY = 1.15  # reads around a variant that differ by more than this: measure it again
MEASURES = 3  # at most, a variant
CACHE = Path.home() / ".cache" / "shard-operator"
LLAMA_PYTHON = CACHE / "llamacpp-venv" / "bin" / "python"
RPC_SERVER = CACHE / "rpc-build" / "bin" / "ggml-rpc-server"
# precision -> (our runtime dtype, our quantization, llama.cpp's GGUF type)
PRECISIONS = {"float32": ("float32", "none", "F32"), "bfloat16": ("bfloat16", "none", "BF16"),
              "int8": ("bfloat16", "int8", "Q8_0")}


# ---------------------------------------------------------------- children (one measurement each)
READ_STREAMS = (1, 4)  # a read front to back, and 4 parts side by side (as a GEMV reads rows)


def stream_seconds(buffer, threads: int) -> float:
    """The faster of plain reads of `buffer` as 1 and as 4 sequential streams a thread."""
    from shard_worker.model import kernels

    best = float("inf")
    for streams in READ_STREAMS:
        start = time.perf_counter()
        kernels.read_once(buffer, threads, streams)
        best = min(best, time.perf_counter() - start)
    return best


def child_stream(nbytes: int, seconds: float) -> dict:
    """GB/s of a plain read of `nbytes` on 1 core and on 2: the median of back-to-back reads for
    `seconds` each (and the fastest, for the record). The median, not the best: the host gives our
    two cores ~35 GB/s together most of the time and ~55-60 in bursts (half a second to a minute),
    and a best of a few reads catches a burst that the minutes around it do not have."""
    import torch

    buffer = torch.ones(nbytes, dtype=torch.uint8)  # touched: resident before the first read
    out: dict = {"fastest": {}}
    for threads in (1, 2):
        rates, end = [], time.perf_counter() + seconds
        while not rates or time.perf_counter() < end:
            rates.append(nbytes / stream_seconds(buffer, threads) / 1e9)
        out[str(threads)], out["fastest"][str(threads)] = statistics.median(rates), max(rates)
    return out


def decode_weights(model_dir: str, dtype: str, quantization: str) -> list[tuple]:
    """(weight, scale) of every matrix a decode step reads, stored as the worker stores them."""
    import torch
    from safetensors import safe_open

    from shard_worker.model.quant import quantize

    index = Path(model_dir) / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = []
    for file in files:
        with safe_open(Path(model_dir) / file, "pt") as f:
            for name in sorted(f.keys()):
                if not (name.endswith("proj.weight") or name == "lm_head.weight"):
                    continue
                w = f.get_tensor(name)
                if quantization == "int8" and name != "lm_head.weight":
                    out.append(quantize(w))
                else:
                    out.append((w.to(getattr(torch, dtype)).contiguous(), None))
    return out


def child_matvec(model_dir: str, dtype: str, quantization: str, repeats: int) -> dict:
    """Seconds to stream the decode weights once through torch's GEMV and through ours, with 1 and
    2 threads, each interleaved with a streaming read of the same bytes in this process."""
    import torch
    import torch.nn.functional as F

    from shard_worker.model import kernels

    weights = decode_weights(model_dir, dtype, quantization)
    act = getattr(torch, dtype)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=act) for w, _ in weights}
    nbytes = sum(w.numel() * w.element_size() + (s.numel() * 4 if s is not None else 0) for w, s in weights)
    flat = torch.ones(nbytes, dtype=torch.uint8)

    def torch_gemv(w, s):
        return F.linear(inputs[w.shape[1]], w) if s is None else kernels.linear(inputs[w.shape[1]], w, s, level=None)

    def ours(w, s):
        return kernels.linear(inputs[w.shape[1]], w, s)

    out = {"bytes": nbytes, "kernel": kernels.describe()}
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            best = {"torch": float("inf"), "ours": float("inf"), "read": float("inf")}
            for fn in (torch_gemv, ours):  # warm up
                for w, s in weights:
                    fn(w, s)
            for _ in range(repeats):
                for name, fn in (("torch", torch_gemv), ("ours", ours)):
                    start = time.perf_counter()
                    for w, s in weights:
                        fn(w, s)
                    best[name] = min(best[name], time.perf_counter() - start)
                best["read"] = min(best["read"], stream_seconds(flat, threads))
            out[str(threads)] = best
    return out


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
# A child's torch puts its large buffers on transparent huge pages: the limit is the faster read
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}


def run_child(*args: str, timeout: float = 1800, threads: int = 2, script: str = __file__) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **HUGE_PAGES}
    proc = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_torch_tp(model_dir: str, dtype: str, tokens: int, prompt: list[int]) -> dict:
    from shard_operator.local.launcher import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "torch-tp", model_dir, dtype, str(tokens),
                               ",".join(map(str, prompt)), str(rank), "2", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **HUGE_PAGES}) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        err = next(o[1] for p, o in zip(procs, outs, strict=True) if p.returncode != 0)
        return {"error": err.strip().splitlines()[-1] if err.strip() else "failed"}
    return json.loads(outs[0][0].strip().splitlines()[-1])


def run_ours(model_dir: str, dtype: str, quantization: str, tp: int, pp: int, threads: int, tokens: int,
             prompt: list[int]) -> dict:
    from shard_contract.wire import GenerateRequest, GenerateTask
    from shard_operator.local.launcher import plan_local, run_generate

    plan = plan_local(model_dir, tp, pp, dtype=dtype, quantization=quantization,
                      max_model_len=len(prompt) + tokens, devices="bench:16GiB*2", device_kind="cpu")
    task = GenerateTask(requests=[GenerateRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True)])
    result = run_generate(plan, model_dir, task, timeout=1800, threads_per_rank=threads)
    reports = [r.report for r in result.ranks if r.report is not None]
    ranks = [r.last_generate for r in reports]
    return {"seconds_per_token": result.decode_seconds / result.decode_steps,
            "prefill_seconds": result.prefill_seconds,
            "comm_share": max(r["decode_comm_seconds"] / r["decode_seconds"] for r in ranks),
            "idle_share": max(r["decode_idle_seconds"] / r["decode_seconds"] for r in ranks),
            "load_seconds": max(r.load_seconds for r in reports)}


def llama_unavailable(python: Path) -> str | None:
    """Why llama.cpp cannot be the peer here (None: it can)."""
    if not python.exists():
        return f"no llama-cpp-python virtualenv at {python.parent.parent} (see bench/llamacpp_peer.py)"
    probe = subprocess.run([str(python), "-c", "import llama_cpp, gguf, numpy"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python}: " + (probe.stderr.strip().splitlines() or ["cannot import llama_cpp"])[-1]
    return None


def run_llama(python: Path, *args: str, rpc_layers: int | None = None) -> dict:
    """One llama.cpp child (bench/llamacpp_peer.py); with `rpc_layers`, beside a one-thread
    ggml-rpc-server process holding that many layers (llama.cpp's split over two processes)."""
    peer = str(Path(__file__).with_name("llamacpp_peer.py"))
    server = None
    try:
        if rpc_layers is not None:
            from shard_operator.local.launcher import free_port

            port = free_port()
            server = subprocess.Popen([str(RPC_SERVER), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2)
            args = (*args, f"127.0.0.1:{port}", str(rpc_layers))
        proc = subprocess.run([str(python), peer, *args], capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "OMP_NUM_THREADS": args[2] if args[0] == "time" else "2"})
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": f"llama.cpp {args[0]} failed: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_checkpoint(directory: Path, shape: dict, dtype: str = "float32") -> Path:
    marker = directory / "bench-shape.json"
    written = {**shape, **({"dtype": dtype} if dtype != "float32" else {})}
    if marker.exists() and json.loads(marker.read_text()) == written:
        return directory
    from tests.support.checkpoints import write_checkpoint

    print(f"writing a random checkpoint to {directory} ...", file=sys.stderr, flush=True)
    shutil.rmtree(directory / "gguf", ignore_errors=True)
    write_checkpoint(directory, "llama", seed=0, max_shard_size="2GB", dtype=dtype, **shape)
    marker.write_text(json.dumps(written))
    return directory


def stream_now() -> dict:
    """GB/s of the plain read on 1 and 2 cores now (the median over 1.5 s each: between two variants)."""
    return run_child("stream", str(STREAM_BYTES), "1.5")


def decode_bytes(model_dir: str, dtype: str, quantization: str) -> int:
    """Bytes our decode step reads: every weight but the embedding table, as stored (the planner's
    sizing: the same numbers the plan predicts)."""
    from shard_operator.planning.profile import profile_model
    from shard_operator.planning.sizing import Shard, weight_bytes

    profile = profile_model(model_dir)
    return weight_bytes(profile, Shard(tp=1, layers=(0, profile.shape.num_layers), embeds=False, has_lm_head=True),
                        dtype, quantization)


def measure(model_dir: str, precision: str, tokens: int, prompt: list[int], skip: set[str],
            llama_python: Path, layers: int) -> dict:
    dtype, quantization, gguf_kind = PRECISIONS[precision]
    before = [stream_now()]  # the read just before the next variant (the one after the last)

    def step(name: str, fn, *args, **kwargs):
        """Measure a variant; again (up to MEASURES times in all) while the reads before and after it
        disagree: the host moved our cores meanwhile, and neither read is the limit it ran under."""
        print(f"  {precision} {name} ...", file=sys.stderr, flush=True)
        for attempt in range(MEASURES):
            started = time.perf_counter()
            try:
                value = fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 -- one failed variant must not lose the others
                value = {"error": str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}
            value["load"] = os.getloadavg()[0]  # 1-minute load average at the end (our own ranks included)
            after = stream_now()
            reads = {n: (before[0][n], after[n]) for n in ("1", "2")}
            value["stream"] = {n: sum(pair) / 2 for n, pair in reads.items()}  # that minute's limit
            value["remeasured"] = attempt
            before[0] = after
            steady = all(max(pair) <= STEADY * min(pair) for pair in reads.values())
            value["steady"] = int(steady)  # 0: the last measure, its reads still apart
            print(f"  {precision} {name}: {value} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            if steady or "error" in value:
                break
            print(f"  {precision} {name}: the reads around it differ ({reads}): again", file=sys.stderr, flush=True)
        return value

    ids = ",".join(map(str, prompt))
    r: dict = {"bytes": decode_bytes(model_dir, dtype, quantization),
               "matvec": step("bare matrix-vector products", run_child, "matvec", model_dir, dtype, quantization, "3")}
    if "hf" not in skip and quantization == "none":
        r["hf1"] = step("hf 1 thread", run_child, "hf", model_dir, dtype, "1", str(tokens), ids)
        r["hf2"] = step("hf 2 threads", run_child, "hf", model_dir, dtype, "2", str(tokens), ids)
    for key, tp, pp, threads in (("tp1", 1, 1, 1), ("tp1x2", 1, 1, 2), ("tp2", 2, 1, 1), ("pp2", 1, 2, 1)):
        r[key] = step(f"ours {key}", run_ours, model_dir, dtype, quantization, tp, pp, threads, tokens, prompt)
    if "llama" not in skip:
        why = llama_unavailable(llama_python)
        converted = {"error": why} if why else step(f"llama.cpp convert {gguf_kind}", run_llama, llama_python,
                                                    "convert", model_dir, gguf_kind)
        r["llama_bytes"] = converted.get("decode_bytes")
        for threads in (1, 2):
            r[f"llama{threads}"] = converted if "error" in converted else step(
                f"llama.cpp {threads} thread(s)", run_llama, llama_python, "time", converted["path"], str(threads),
                str(tokens), ids)
        if "error" in converted or not RPC_SERVER.exists():
            missing = {"error": f"no {RPC_SERVER} (see bench/llamacpp_peer.py)"}
            r["llama_rpc"] = converted if "error" in converted else missing
        else:
            r["llama_rpc"] = step("llama.cpp layers over 2 processes (RPC)", run_llama, llama_python, "time",
                                  converted["path"], "1", str(tokens), ids, rpc_layers=layers // 2)
    if "torch-tp" not in skip and quantization == "none":
        r["torch_tp2"] = step("parallelize_module TP=2", run_torch_tp, model_dir, dtype, tokens, prompt)
    return r


def report(stream: dict, results: dict, shape: dict, tokens: int) -> str:
    bw1, bw2 = stream["1"] * 1e9, stream["2"] * 1e9
    lines = [f"Model: random Llama {shape}; batch 1, {PROMPT_TOKENS}-token prompt, {tokens} new tokens.",
             f"Streaming read (the limit): {stream['1']:.1f} GB/s on 1 core, {stream['2']:.1f} GB/s on 2 cores "
             f"(medians of 3 s of reads of a {STREAM_BYTES / 2**30:.0f} GiB buffer; the fastest read "
             f"{stream['fastest']['1']:.1f} and {stream['fastest']['2']:.1f}; load {stream['load']:.1f}) at the "
             "start of a round; each variant's share is against the mean of the reads (medians of 1.5 s) just "
             "before and after it, measured again while those differ by more than "
             f"{STEADY - 1:.0%} ({MEASURES} times at most).", "",
             "| precision | variant | cores | ms/token | tokens/s | share of the streaming limit | vs llama.cpp "
             "| comm share | idle share | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    goals = []
    for precision, r in results.items():
        ours_bytes, llama_bytes = r["bytes"], r.get("llama_bytes") or r["bytes"]
        limit = {1: ours_bytes / bw1, 2: ours_bytes / bw2}
        lines.append(f"| {precision} | streaming limit for {ours_bytes / 2**20:.0f} MiB a token | 1 | "
                     f"{limit[1] * 1e3:.1f} | {1 / limit[1]:.2f} | 1.00 | | | | |")
        lines.append(f"| {precision} | streaming limit for {ours_bytes / 2**20:.0f} MiB a token | 2 | "
                     f"{limit[2] * 1e3:.1f} | {1 / limit[2]:.2f} | 1.00 | | | | |")
        llama = {n: r.get(f"llama{n}", {}).get("seconds_per_token") for n in (1, 2)}
        llama_rpc = r.get("llama_rpc", {}).get("seconds_per_token")
        rows = []

        def near(figures: dict, n: int, nbytes: int = ours_bytes) -> float:
            """Seconds a token at the limit measured around a variant (the round's where it has none)."""
            bw = figures.get("stream", {}).get(str(n))
            return nbytes / (bw * 1e9) if bw else nbytes / (bw1 if n == 1 else bw2)

        mv = r["matvec"]
        if "error" not in mv:
            scale = ours_bytes / mv["bytes"]  # the bare weights lack norms and biases: per token
            for n in (1, 2):
                chunked = ', int8 dequantized in chunks' if precision == 'int8' else ''
                rows.append((f"torch's GEMV (F.linear{chunked}), bare",
                             n, mv[str(n)]["torch"] * scale, near(mv, n), None, {"load": mv["load"]}))
                rows.append((f"our GEMV ({mv['kernel']}), bare; beside a read of the same bytes: "
                             f"{mv[str(n)]['read'] / mv[str(n)]['ours']:.2f}", n, mv[str(n)]["ours"] * scale,
                             near(mv, n), None, {"load": mv["load"]}))
        for key, name, n in (("hf1", "HF transformers generate, 1 thread", 1),
                             ("hf2", "HF transformers generate, 2 threads", 2),
                             ("tp1", "shard worker TP=1, 1 thread", 1), ("tp1x2", "shard worker TP=1, 2 threads", 2),
                             ("tp2", "shard worker TP=2 (2 processes x 1 thread)", 2),
                             ("pp2", "shard worker PP=2 (2 processes x 1 thread)", 1),
                             ("torch_tp2", "PyTorch parallelize_module TP=2", 2)):
            if key in r:
                peer = {"pp2": llama_rpc}.get(key, llama[n]) if key != "torch_tp2" else llama[n]
                rows.append((name, n, r[key].get("seconds_per_token"), near(r[key], n), peer, r[key]))
        for n in (1, 2):
            if f"llama{n}" in r:
                quant = PRECISIONS[precision][2]
                rows.append((f"llama.cpp {quant}, {n} thread(s) "
                             f"({llama_bytes / 2**20:.0f} MiB a token)", n, llama[n],
                             near(r[f"llama{n}"], n, llama_bytes),
                             None, r[f"llama{n}"]))
        if "llama_rpc" in r:
            rows.append(("llama.cpp layers over 2 processes (RPC), 1 thread each", 1, llama_rpc,
                         near(r["llama_rpc"], 1, llama_bytes), None, r["llama_rpc"]))
        for name, n, seconds, lim, peer, figures in rows:
            if seconds is None:
                lines.append(f"| {precision} | {name} | {n} | {figures.get('error', 'not run')} | | | | | | "
                             f"{figures.get('load', 0):.1f} |")
                continue
            shares = (f"{figures['comm_share']:.1%} | {figures['idle_share']:.1%}" if "comm_share" in figures
                      else " | ")
            versus = f"{peer / seconds:.2f}" if peer else ""
            lines.append(f"| {precision} | {name} | {n} | {seconds * 1e3:.1f} | {1 / seconds:.2f} "
                         f"| {lim / seconds:.2f} "
                         f"| {versus} | {shares} | {figures.get('load', 0):.1f} |")
        tp1, tp2 = r["tp1"].get("seconds_per_token"), r["tp2"].get("seconds_per_token")
        checks = []
        if tp1 and tp2 and precision != "int8":
            checks += [("TP=1 share of the 1-core streaming limit", near(r["tp1"], 1) / tp1, ">= 0.85"),
                       ("TP=2 share of the 2-core streaming limit", near(r["tp2"], 2) / tp2, ">= 0.80")]
        for n, ours in ((1, tp1), (2, tp2)):
            if ours and llama[n]:
                checks.append((f"TP={n} vs llama.cpp with {n} thread(s) (theirs / ours)", llama[n] / ours, ">= 1.00"))
        if r["pp2"].get("seconds_per_token") and llama_rpc:
            checks.append(("PP=2 vs llama.cpp's RPC split (theirs / ours)", llama_rpc / r["pp2"]["seconds_per_token"],
                           "reported"))
        for name, value, goal in checks:
            met = "" if goal == "reported" else ("met" if value >= float(goal.split()[-1]) else "MISSED")
            goals.append(f"| {precision} | {name} | {value:.2f} | {goal} | {met} |")
    lines += ["", "| precision | goal | measured | target | |", "|---|---|---|---|---|", *goals]
    return "\n".join(lines)


def median_of(rounds: list):
    """One figure from each round's: the median of numbers, key by key through nested dicts; a
    measurement that failed in some rounds is the median of the others (an error where all failed)."""
    first = rounds[0]
    if isinstance(first, dict):
        ok = [r for r in rounds if "error" not in r] or rounds
        return {k: median_of([r[k] for r in ok if k in r]) for k in ok[0]}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(rounds)
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, to check the script")
    parser.add_argument("--precisions", default="float32,bfloat16,int8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip", default="", help="comma-separated: hf, torch-tp, llama")
    parser.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON,
                        help=f"python of the llama-cpp-python virtualenv (default {LLAMA_PYTHON})")
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint is kept "
                        "(default ~/.cache/shard-operator/bench-decode[-quick])")
    parser.add_argument("--rounds", type=int, default=1, help="measure everything this many times in turn; "
                        "report medians")
    parser.add_argument("--out", type=Path, help="also write the raw figures as JSON here")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, rest = args.child[0], args.child[1:]
        if kind == "stream":
            out = child_stream(int(rest[0]), float(rest[1]))
        elif kind == "matvec":
            out = child_matvec(rest[0], rest[1], rest[2], int(rest[3]))
        elif kind == "hf":
            out = child_hf(rest[0], rest[1], int(rest[2]), int(rest[3]), [int(t) for t in rest[4].split(",")])
        else:
            out = child_torch_tp(rest[0], rest[1], int(rest[2]), [int(t) for t in rest[3].split(",")],
                                 int(rest[4]), int(rest[5]), int(rest[6]))
        print(json.dumps(out))
        return 0

    shape = QUICK if args.quick else FULL
    default_dir = CACHE / ("bench-decode-quick" if args.quick else "bench-decode")
    model_dir = str(ensure_checkpoint(args.model_dir or default_dir, shape))
    prompt = [(7 * i + 3) % shape["vocab_size"] for i in range(PROMPT_TOKENS)]
    skip = set(filter(None, args.skip.split(",")))
    load = os.getloadavg()
    rounds = []
    for n in range(args.rounds):
        if args.rounds > 1:
            print(f"round {n + 1} of {args.rounds}", file=sys.stderr, flush=True)
        stream = run_child("stream", str(STREAM_BYTES), "3")
        stream["load"] = os.getloadavg()[0]
        print(f"  streaming read: {stream}", file=sys.stderr, flush=True)
        rounds.append({"stream": stream, "results": {
            p: measure(model_dir, p, args.tokens, prompt, skip, args.llama_python, shape["num_layers"])
            for p in args.precisions.split(",")}})
        if args.out:  # what is measured so far survives a run cut short
            args.out.write_text(json.dumps({"shape": shape, "tokens": args.tokens, "rounds": rounds}, indent=2))
    stream, results = median_of([r["stream"] for r in rounds]), median_of([r["results"] for r in rounds])
    text = report(stream, results, shape, args.tokens)
    print(f"load average before: {load[0]:.2f}, after: {os.getloadavg()[0]:.2f}"
          + (f"; every figure is the median of {args.rounds} rounds" if args.rounds > 1 else "") + "\n")
    print(text)
    measures = [f for rnd in rounds for r in rnd["results"].values() for f in r.values() if isinstance(f, dict)]
    again, unsteady = sum(f.get("remeasured", 0) for f in measures), sum(1 - f.get("steady", 1) for f in measures)
    print(f"\nMeasures taken again because the reads around them differed by more than {STEADY - 1:.0%}: {again}; "
          f"kept with their reads still apart after {MEASURES} measures: {unsteady}.")
    if args.out:
        args.out.write_text(json.dumps({"shape": shape, "tokens": args.tokens, "stream": stream,
                                        "results": results, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
