"""Our grouped matrix products against torch's at the row counts a CPU rank sends to ours: 1-8 rows
(a decode step) and 9 to `kernels.MAX_TOKENS` rows (a decode step beside a prompt chunk, and a
short prompt's whole prefill); past MAX_TOKENS the worker calls torch's.

One layer's projections of the decode bench's 853M model (q, k, v
together; o; gate and up together; down), float32, bfloat16 and int8 weights (int8: the activation
in bfloat16, torch's path dequantizing rows in chunks as the worker's does), 1 and 2 threads. For
each (shape, dtype, threads, rows) the two run in turn (ours, torch, torch, ours: a drift of the
machine touches both alike), each call repeated for at least 50 ms; the median over `--rounds`.

Reported: ms a call for each, and torch's time over ours (above 1: ours is faster), with the
load average. The question it answers: does sending 9-64 rows to our kernel (where the fused step
needs it, and a short prefill gets it too) cost the prefill anything against torch's GEMMs?

    nice .venv/bin/python bench/linear_rows.py [--rows 1,8,9,16,32,64] [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from shard_worker.model import kernels, quant

SHAPES = {  # (out, in) of one layer's products, q/k/v and gate/up as the fused layer stores them
    "853M qkv": (2048 + 2 * 512, 2048), "853M o": (2048, 2048),
    "853M gate_up": (2 * 5632, 2048), "853M down": (2048, 5632),
}
DTYPES = ("float32", "bfloat16", "int8")


def weight(shape: tuple[int, int], dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(shape) / shape[1] ** 0.5
    if dtype != "int8":
        return w.to(getattr(torch, dtype)), None
    q, scale = quant.quantize(w)
    return q, scale


def per_call(fn, min_seconds: float = 0.05) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=f"1,8,9,16,32,{kernels.MAX_TOKENS}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    level = kernels.LEVELS[-1] if kernels.LEVELS else None
    if level is None:
        sys.exit("the C extension is not built: nothing of ours to compare")
    print(f"our kernel: {level}; torch {torch.__version__}; rows {rows_list}", flush=True)
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for (name, shape), dtype in ((s, d) for s in SHAPES.items() for d in DTYPES):
            w, scale = weight(shape, dtype)
            xtype = torch.float32 if dtype == "float32" else torch.bfloat16
            for rows in rows_list:
                x = torch.randn(rows, shape[1]).to(xtype)
                ours = lambda: kernels.linear(x, w, scale, level=level)  # noqa: E731
                theirs = lambda: kernels.linear(x, w, scale, level=None)  # noqa: E731
                times: dict[str, list[float]] = {"ours": [], "torch": []}
                for r in range(args.rounds):
                    order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
                    for who in order:
                        times[who].append(per_call(ours if who == "ours" else theirs))
                o, t = statistics.median(times["ours"]), statistics.median(times["torch"])
                row = dict(shape=name, dtype=dtype, threads=threads, rows=rows, ours_ms=o * 1e3,
                           torch_ms=t * 1e3, torch_over_ours=t / o, load=os.getloadavg()[0])
                results.append(row)
                print(f"{threads} thr {name:13s} {dtype:8s} rows {rows:3d}: ours {o * 1e3:8.3f} ms  "
                      f"torch {t * 1e3:8.3f} ms  torch/ours {t / o:5.2f}  load {row['load']:.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
