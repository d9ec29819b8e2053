"""The matrix products of decode: our C kernel (`shard_worker._gemv`) where it applies, torch's
elsewhere.

A decode step multiplies a few token vectors by every weight matrix once, so it is bound by the
bytes of weights read; torch's CPU matrix-vector products stop well short of the memory's
bandwidth (bfloat16 and int8 the most). `_gemv` streams float32, bfloat16 and int8 weights
(one float32 scale per output row) for 1-8 rows of x, with AVX-512, AVX2 or portable C chosen
by CPUID, and up to MAX_TOKENS rows in groups of 8 that share each block of the weight while it is
in L2 (a decode step's rows beside a prompt chunk's tokens). Everything else -- prefill, float16,
GPUs, a package built without a compiler -- goes through torch. With int8 weights every path
quantizes x first (`quant.quantize_activations`).
The rest of a decode step has C versions too where torch's operators cost more than their work:
RMSNorm, attention (with its rope and KV-cache write) and SwiGLU's silu(gate) * up; `fused.py`
runs a whole decoder layer in one call.

A weight may be a view with rows further apart than its width (a column slice of a wider matrix:
a row-parallel slice read in place from the checkpoint), or a tuple of row blocks standing for
their concatenation (q, k and v read in place from three checkpoint tensors): each block is
multiplied on its own, which gives every output the very same sums as the concatenated matrix.

`SHARD_KERNEL` picks the path: `auto` (default: the best this CPU runs), `torch` (never ours), or
one level by name (`portable`, `avx2`, `avx512`, `avx512_vnni`, `avx512_bf16`) -- for tests and
benchmarks; a `level` argument does the same for one call.
"""

from __future__ import annotations

import importlib
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F

from shard_contract.env import KERNEL_ENV

from . import int8mm


def _extension() -> ModuleType | None:
    try:
        return importlib.import_module("shard_worker._gemv")
    except ImportError:  # built without a C compiler: torch's kernels only
        return None


_gemv = _extension()

MAX_ROWS = 8  # rows of x our kernels multiply together (a group: one read of each weight)
# rows one call of ours takes: groups of MAX_ROWS, each block of W read from memory once and from L2
# by the other groups (a decode step's rows and a prompt chunk's tokens together); more is
# prefill, where torch's GEMMs win
MAX_TOKENS: int = _gemv.MAX_TOKENS if _gemv is not None else MAX_ROWS
LEVELS: list[str] = _gemv.levels() if _gemv is not None else []  # slowest first
_WTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_XTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _chosen_level() -> str | None:
    want = os.environ.get(KERNEL_ENV, "auto")
    if want == "torch" or not LEVELS:
        return None
    if want == "auto":
        return LEVELS[-1]
    if want not in LEVELS:
        raise RuntimeError(f"SHARD_KERNEL={want!r}: this CPU and build run {['torch', *LEVELS]}")
    return want


LEVEL = _chosen_level()
_torch_only = False  # within `torch_only()`: our kernels (raw pointers, opaque to torch.compile) stay out


@contextmanager
def torch_only() -> Iterator[None]:
    """Every operator of the step through torch within: what a captured or compiled decode step
    runs (CUDA graphs and torch.compile see torch operators only). Not thread-safe: the engine's
    thread alone uses it."""
    global _torch_only
    before, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = before


def in_torch_only() -> bool:
    return _torch_only


def _default() -> str | None:
    return None if _torch_only else LEVEL


def native() -> ModuleType:
    """The C extension, where a level of ours was chosen (which needs it built)."""
    if _gemv is None:
        raise RuntimeError("shard_worker._gemv is not built: torch's kernels only")
    return _gemv


def describe() -> str:
    """Which kernel decode uses here, for logs and reports."""
    return f"shard_worker._gemv ({LEVEL})" if LEVEL else "torch (no _gemv kernel: " + (
        "SHARD_KERNEL=torch)" if _gemv is not None else "the extension is not built)")


def linear(x: torch.Tensor, weight: torch.Tensor | tuple[torch.Tensor, ...], scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, level: str | None = "default",
           blocks: tuple[int, ...] = ()) -> torch.Tensor:
    """x W^T (times `scale` per output row for int8 W) + bias, in x's dtype. `weight`: a matrix
    whose rows are contiguous, or a tuple of such row blocks (float only); `blocks`: the rows of
    the blocks a matrix is made of (q, k and v), which torch multiplies one by one on a CPU, as it
    does a tuple's. `level`: one of LEVELS, None for torch only, or the process's choice
    (`SHARD_KERNEL`)."""
    level = _default() if level == "default" else level
    parts = weight if isinstance(weight, tuple) else (weight,)
    assert len(parts) == 1 or scale is None, "row blocks are float weights"
    k = parts[0].shape[1]
    rows = x.numel() // k
    if level is not None and all(_ours(x, w, scale, rows) for w in parts):
        x2 = x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        n = sum(w.shape[0] for w in parts)
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        column = 0  # each block into its columns of y (rows n apart): every row's sum on its own
        for w in parts if len(parts) == 1 else _adjacent_merged(parts):
            native().linear(_WTYPES[w.dtype], _XTYPES[x.dtype], w.data_ptr(), 0 if scale is None else scale.data_ptr(),
                         x2.data_ptr(), y.data_ptr() + column * y.element_size(), w.shape[0], k,
                         w.stride(0) if w.shape[0] > 1 else k, rows, x2.stride(0), n, torch.get_num_threads(),
                         LEVELS.index(level))
            column += w.shape[0]
        if bias is not None:
            y += bias
        return y
    on_cpu = parts[0].device.type == "cpu"  # where weights are read in place (a GPU's are copied whole)
    if isinstance(weight, torch.Tensor):
        if weight.dtype == torch.int8:
            if scale is None:
                raise ValueError("int8 weights come with their float32 scales, one per row")
            return _int8_torch(x, weight, scale, bias)
        parts = tuple(weight.split(blocks)) if len(blocks) > 1 and on_cpu else parts
    if rows <= MAX_ROWS and on_cpu and not _torch_only:
        # torch's matrix-vector products sum in an order that depends on the weight's layout and
        # alignment (float32: 16 bytes), so a weight read in place (strided, or at any 8-byte
        # offset of a file) gets the layout of a resident one. Its GEMMs pack their operands and
        # sum alike whatever the layout (tests/worker/test_kernels.py checks both).
        parts = tuple(w if w.is_contiguous() and w.data_ptr() % 64 == 0
                      else w.clone(memory_format=torch.contiguous_format) for w in parts)
    if len(parts) == 1:
        return F.linear(x, parts[0], bias)
    # One GEMM per block, as the resident and the streamed layers both do: a GEMM's sums for a
    # row of W can depend on how many rows it is given, so this keeps them equal bit for bit.
    ends = list(itertools.accumulate(w.shape[0] for w in parts))
    return torch.cat([F.linear(x, w, None if bias is None else bias[b - w.shape[0]:b])
                      for w, b in zip(parts, ends, strict=False)], dim=-1)


def _adjacent_merged(blocks: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The blocks, with those that follow one another in memory as one matrix (one call)."""
    merged = [blocks[0]]
    for w in blocks[1:]:
        last = merged[-1]
        if (w.stride() == last.stride() and w.dtype == last.dtype
                and w.data_ptr() == last.data_ptr() + last.shape[0] * last.stride(0) * last.element_size()):
            merged[-1] = last.as_strided((last.shape[0] + w.shape[0], last.shape[1]), last.stride())
        else:
            merged.append(w)
    return merged


def _ours(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, rows: int) -> bool:
    return (1 <= rows <= MAX_TOKENS and x.device.type == "cpu" and x.dtype in _XTYPES
            and weight.device.type == "cpu" and weight.stride(1) == 1
            and (weight.shape[0] <= 1 or weight.stride(0) >= weight.shape[1])
            and (weight.dtype == x.dtype or (weight.dtype == torch.int8 and scale is not None
                                              and scale.dtype == torch.float32 and scale.is_contiguous()))
            and x.shape[-1] == weight.shape[1])


def _int8_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8 rows through torch (`int8mm`: the reference dequantizing path, or on CUDA at decode a
    compiled product that converts the weight in registers). torch's CPU `_weight_int8pack_mm`
    is not used: its float32 path streams at a tenth of the memory's speed, and its bfloat16 one
    is off by more than two roundings."""
    return int8mm.linear(x, weight, scale, bias)


def _step_ops(x: torch.Tensor) -> bool:
    """Whether our C versions of a decode step's other operators take `x`'s dtype and device."""
    return x.device.type == "cpu" and x.dtype in _XTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, level: str | None = "default") -> torch.Tensor | None:
    """HF's RMSNorm of the rows of x (x / rms(x) in float32, rounded to x's dtype, times the
    weight), or None where ours does not apply (the caller uses torch). `level` as for `linear`."""
    level = _default() if level == "default" else level
    if level is None or not (_step_ops(x) and weight.dtype == x.dtype and x.is_contiguous()):
        return None
    y = torch.empty_like(x)
    h = x.shape[-1]
    native().rms_norm(_XTYPES[x.dtype], x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // h, h, eps,
                   LEVELS.index(level))
    return y


def silu_mul(gate_up: torch.Tensor, level: str | None = "default") -> torch.Tensor | None:
    """F.silu(gate) * up for gate_up = (gate | up) along its last dimension (the silu rounded to
    the dtype before the product, as torch's two operators round), or None where ours does not
    apply (the caller uses torch). `level` as for `linear`."""
    level = _default() if level == "default" else level
    if level is None or not (_step_ops(gate_up) and gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0):
        return None
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    native().silu_mul(_XTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                   LEVELS.index(level))
    return out


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           first: torch.Tensor, col: int, heads: int, kv_heads: int, level: str | None = "default",
           slots: torch.Tensor | None = None, wslots: torch.Tensor | None = None,
           cols: torch.Tensor | None = None) -> torch.Tensor | None:
    """A step's attention for rows [n] of one layer: rope (HF's, `cos` / `sin` [n, ..., head_dim]
    in qkv's dtype) on q and k; k and v written into the caches (this layer's [rows, kv_heads,
    max_len, head_dim], from the step's first row) at column `col`; then each query head's
    softmax(q k^T / sqrt(head_dim)) v over the cached columns [first[row], col] of its KV head.
    Paged (`slots` [n, >= col + 1] and `wslots` [n, s], int64): the caches are this layer's pools
    [kv_heads, slots, head_dim], row b's column c is read in place at slot slots[b, c], and its k
    and v are written at wslots[b] (`paging.slot_maps`). `qkv`: [n, s, (heads + 2 kv_heads)
    head_dim]: a decode step's one token a row (s = 1), or a chunk's s tokens a row, paged, each at
    its column `cols` [n, s] attending to [first[b, j], cols[b, j]] (`first` [n, s]), the keys of
    the tokens before it in the chunk included (every token's k and v are written first). Returns
    [n, s, heads * head_dim], or None where ours does not apply (the caller uses torch). `level`
    as for `linear`."""
    level = _default() if level == "default" else level
    n, s, hd = qkv.shape[0], qkv.shape[1], k_cache.shape[-1]
    per_token = s > 1 or cols is not None
    if level is None or not (_step_ops(qkv) and qkv.is_contiguous() and n * s <= MAX_TOKENS
            and k_cache.dtype == qkv.dtype and k_cache.stride()[-2:] == (hd, 1) and v_cache.stride() == k_cache.stride()
            and (slots is None or (wslots is not None and slots.device.type == "cpu"))
            and (not per_token or (slots is not None and cols is not None))):
        return None
    out = torch.empty(n, s, heads * hd, dtype=qkv.dtype)
    cos, sin, first = cos.contiguous(), sin.contiguous(), first.to(torch.int64).contiguous()
    paged, row, head = (0, 0, 0), k_cache.stride(0), k_cache.stride(1)
    if slots is not None and wslots is not None:  # a pool [kv_heads, slots, head_dim]: a slot's stride, a head's
        slots, wslots = slots.to(torch.int64).contiguous(), wslots.to(torch.int64).contiguous()
        paged, row, head = (slots.data_ptr(), slots.shape[1], wslots.data_ptr()), k_cache.stride(1), k_cache.stride(0)
    tokens: tuple[int, ...] = ()
    if per_token and cols is not None:  # each token's column, and its row of slots (a chunk's tokens share it)
        cols = cols.to(torch.int64).contiguous()
        srow = torch.arange(n, dtype=torch.int64).repeat_interleave(s)
        col, tokens = int(cols.max()), (cols.data_ptr(), srow.data_ptr())
    native().attend(_XTYPES[qkv.dtype], qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                 v_cache.data_ptr(), first.data_ptr(), out.data_ptr(), n * s, heads, kv_heads, hd, row, head, col,
                 *paged, hd**-0.5, torch.get_num_threads(), LEVELS.index(level), *tokens)
    return out


def read_once(buffer: torch.Tensor, threads: int, streams: int = 1) -> int:
    """Read `buffer` once with plain vector loads, split over `threads`, each reading its share as
    `streams` sequential streams side by side (1-8): the machine's read limit. Returns a checksum
    (whose value depends on the split: it only keeps the reads from being optimised away)."""
    return native().read(buffer.data_ptr(), buffer.numel() * buffer.element_size(), threads, len(LEVELS) - 1, streams)
