"""int8 weight-only products through torch: y = x (q * scale)^T, with x quantized first as our C
kernels quantize it (`quant.fake_quantize_activations`). Everything but our CPU kernels comes
here: prefill, GPUs, a package built without a compiler.

Three ways to one result (equal up to float rounding; tests/worker/test_int8mm.py):

- `dequant`, the reference: rows of q converted to x's dtype a bounded chunk at a time, one
  GEMM per chunk, scaled after it in float32. Right for prefill (compute-bound: the conversion
  costs little beside the GEMM) and no full-size copy of the weight ever exists. On a GPU at
  decode it reads the int8 weight, writes and reads it again in bfloat16 and launches a dozen
  kernels a projection: slower than bfloat16 weights (the H200 run: 29 against 91 tokens/s).
- `compiled`: decode's few rows (<= FUSED_ROWS) as one function compiled by `torch.compile`:
  the activation quantization and, per row of x, the product written as a reduction over the
  int8 weight converted in registers (as gpt-fast's int8, whose product inductor decomposes the
  same way), the rows' reductions fused into one kernel that reads q once. What a CUDA graph
  of the decode step then replays.
- `int8pack`: torch's `_weight_int8pack_mm` with x in its own dtype (bfloat16 activations), for
  decode's rows; torch's own kernel, no compilation.

`SHARD_INT8_CUDA` picks the CUDA decode path (`compiled` by default; `int8pack`, `dequant`); the
device check (bench/gpu_check.sh) measures each against bfloat16 weights. Until it has, the
planner does not count int8 faster than bfloat16 on a GPU (planning/costs.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import recompiles
from .quant import fake_quantize_activations

ENV = "SHARD_INT8_CUDA"
MODES = ("compiled", "int8pack", "dequant")
FUSED_ROWS = 8  # rows of x one compiled call takes (decode's batch buckets up to 8); more: dequant
DEQUANT_CHUNK_BYTES = 8 * 2**20  # int8 rows dequantized at once on the reference path


def cuda_mode() -> str:
    mode = os.environ.get(ENV, "compiled")
    if mode not in MODES:
        raise RuntimeError(f"{ENV}={mode!r}: one of {', '.join(MODES)}")
    return mode


def dequant(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: x2 [m, k] (already quantized) times (q * scale)^T, in x2's dtype, one chunk
    of rows of q at a time (each GEMM's output rounded to x2's dtype, then scaled in float32)."""
    k = weight.shape[1]
    y = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
    step = max(1, DEQUANT_CHUNK_BYTES // (k * x2.element_size()))
    for a in range(0, weight.shape[0], step):
        y[:, a:a + step] = F.linear(x2, weight[a:a + step].to(x2.dtype)).float() * scale[a:a + step]
    return y


def fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [m, k] (not yet quantized; m <= FUSED_ROWS) times (q * scale)^T, written for the
    compiler: each row's product a reduction over q converted to float32 (bfloat16 products are
    exact in float32, so this is the reference's sum in another order), scaled, then rounded once
    to x's dtype. Never run it eagerly on a real weight: uncompiled, each row materialises a
    float32 copy of q."""
    x2 = fake_quantize_activations(x).float()
    wf = weight.float()
    rows = [(x2[i] * wf).sum(dim=-1) for i in range(x2.shape[0])]
    return (torch.stack(rows) * scale).to(x.dtype)


_compiled: Callable[..., torch.Tensor] | None = None


def compiled() -> Callable[..., torch.Tensor]:
    """`fused` compiled (once a process; a variant per shape, so decode's kernels are static)."""
    global _compiled
    if _compiled is None:
        recompiles.allow()  # a variant per (rows, weight shape)
        _compiled = torch.compile(fused, dynamic=False, fullgraph=True)
    return _compiled


def int8pack(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's int8 weight-only kernel with x quantized, in x's dtype (bfloat16 activations).
    torch's CUDA kernel computes in float32, and some versions return that float32 whatever x's
    dtype (aten/src/ATen/native/cuda/int8mm.cu allocated `out` as kFloat; later ones convert it
    back): cast, or a bfloat16 stage would meet float32 (the KV cache's index_copy_ refuses it)."""
    x2 = fake_quantize_activations(x).contiguous()
    return torch.ops.aten._weight_int8pack_mm(x2, weight, scale).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           mode: str | None = None) -> torch.Tensor:
    """x [..., k] times int8 rows `weight` [n, k] with float32 `scale` [n], plus bias, in x's
    dtype. `mode`: the CUDA decode path (default: SHARD_INT8_CUDA); a CPU, prefill and float16 on
    `int8pack` take the reference."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    decode = x2.shape[0] <= FUSED_ROWS and x.device.type == "cuda"
    mode = (mode or cuda_mode()) if decode else "dequant"
    if mode == "compiled":
        y = compiled()(x2, weight, scale)
    elif mode == "int8pack" and x.dtype in (torch.bfloat16, torch.float32):
        y = int8pack(x2, weight, scale)
    else:
        y = dequant(fake_quantize_activations(x2), weight, scale)
    y = y.view(*x.shape[:-1], weight.shape[0])
    if bias is not None:
        y = y + bias
    return y
