"""Where a decode step's time goes on a GPU: F.linear's matrix-vector products by dtype and BLAS
back end, and torch.profiler over one rank of our worker and over HF generate (a 4-layer model of
bench/decode.py's shape). A diagnosis for a lent GPU machine, run from the repository root with
the environment bench/gpu_check.sh sets up:  python3 bench/gpu_profile.py
(Written after the first device check found bfloat16 decode 6x slower than float32 on an H200, for
HF generate as for our rank; the loan ended before it could run, so it has not run on a GPU yet.)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import decode
import gpu_decode
import torch
import torch.nn.functional as F

SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632), (32000, 2048)]  # (out, in) of the model's projections


def per_call_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def linear_table() -> None:
    print("F.linear on CUDA, microseconds a call (GPU time; 200 calls after 10)")
    print("dtype     out x in      rows=1  rows=2  W@x(mv)  rows=1 cublaslt  bytes/us(rows=1)")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for out, k in SHAPES:
            w = torch.randn(out, k, device="cuda", dtype=dtype)
            x1, x2 = torch.randn(1, k, device="cuda", dtype=dtype), torch.randn(2, k, device="cuda", dtype=dtype)
            xv = x1[0]
            t1 = per_call_us(lambda: F.linear(x1, w))
            t2 = per_call_us(lambda: F.linear(x2, w))
            tv = per_call_us(lambda: torch.mv(w, xv))
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                tl = per_call_us(lambda: F.linear(x1, w))
            except Exception as e:  # noqa: BLE001 -- a library without cuBLASLt: the column says nan
                tl = float("nan")
                print("cublaslt:", e)
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            print(f"{str(dtype)[6:]:9} {out:5} x {k:5}  {t1:6.1f}  {t2:6.1f}  {tv:7.1f}  {tl:15.1f}  "
                  f"{w.numel() * w.element_size() / t1 / 1e3:8.0f} GB/s")
    print(flush=True)


def profile_ours(model_dir: str, dtype: str, tokens: int = 16) -> None:
    from shard_contract.env import WorkerEnv
    from shard_contract.wire import GenerateRequest
    from shard_operator.local.launcher import free_port, plan_local
    from shard_worker.rank.runtime import Worker

    os.environ.update({k: v for k, v in gpu_decode.LOOPBACK.items() if k not in os.environ})
    prompt = list(range(1, 33))
    plan = plan_local(model_dir, 1, 1, dtype=dtype, quantization="none", max_model_len=128,
                      devices="localhost:80GiB", device_kind="gpu")
    env = WorkerEnv(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), tp_size=1, pp_size=1,
                    plan_file="(in memory)", model_dir=model_dir, rendezvous_timeout=60)
    worker = Worker.start(env, plan)
    try:
        def run(n):
            return worker.engine.generate([GenerateRequest(prompt_ids=prompt, max_new_tokens=n, ignore_eos=True)])

        run(4)
        started = time.perf_counter()
        out = run(tokens)
        print(f"ours {dtype}: {out.decode_seconds / out.decode_steps * 1e3:.2f} ms a decode step "
              f"({time.perf_counter() - started:.2f} s for {tokens} tokens)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(tokens)
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60), flush=True)
    finally:
        worker.close()


def profile_hf(model_dir: str, dtype: str, tokens: int = 16) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda().eval()
    ids = torch.arange(1, 33, device="cuda")[None]
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    print(f"HF {dtype}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60),
          flush=True)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    linear_table()
    model_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "shard-gpu-profile"
    decode.ensure_checkpoint(model_dir, {**decode.FULL, "num_layers": 4})
    for what in sys.argv[1:] or ["ours:bfloat16", "ours:float32", "hf:bfloat16"]:
        kind, dtype = what.split(":")
        try:
            (profile_ours if kind == "ours" else profile_hf)(str(model_dir), dtype)
        except Exception as e:  # noqa: BLE001 -- a diagnosis goes on
            print(f"{what} failed: {e!r}", flush=True)


if __name__ == "__main__":
    main()
