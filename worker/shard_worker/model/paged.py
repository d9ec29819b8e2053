"""Attention that reads the paged KV cache in place: FlexAttention over the rows' block tables.

The pool of a layer is [kv_heads, slots, head_dim] (`KVCache`); FlexAttention takes it as keys
and values of batch 1 ([1, kv_heads, slots, head_dim], a view) broadcast over the rows, and a
*block mask* that lists, for each row, the pool blocks it reads, in logical order: its block
table from the window's first block to its last position's (`paged_mask`). A fused kernel then
loads those blocks where they lie (Triton on CUDA, inductor's C++ template on a CPU): nothing
is gathered per row, whatever the context length, and nothing is materialised but each row's
softmax state. Within the blocks read, a `mask_mod` keeps the keys of logical positions
[lo, hi] of each query (causality, the sliding window); it finds a pool slot's logical position
through the rows' inverse block tables (`inverse`, built on the device at each pass).

Padding is gone from attention: a row's positions start at 0 in its first block, so left
padding only shifts each query's position (a padding query, position < 0, reads nothing: its
output is 0 and unused). Prefix-cache positions are in the shared blocks at the head of the
table and read like any other. Grouped-query attention is FlexAttention's `enable_gqa` (the
queries are grouped, the keys never expanded).

Everything here is device tensors of static shapes (the pool's block count, the step's rows
and query columns): a captured decode step (CUDA graphs) builds its mask without a host value,
and launches the kernel, compiled on its own, inside the capture; a compiled step (the decode
graphs' compile mode) takes the mask's tensors as inputs (`mask_tensors`, then `block_mask` in
the graph) and inductor lowers flex_attention with the step. The pool must reach the kernel as a
tensor of its own, each layer's (`KVCache.layer_k`): inductor's C++ template (torch 2.13) reads
its key and value from their buffer's start, dropping a view's storage offset, so `k[layer]`
taken inside the graph read layer 0's keys at every layer (Triton's template adds the offset).
A masked key is multiplied
by 0 in the kernel (0 x NaN is NaN): what a row has not yet written in its last block is
therefore zeroed when the row writes the position before it (`tail_slots`, used by
`KVCache.update`), so a block reused from a failed sequence cannot poison its new owner.

Why FlexAttention rather than a gather (`KVCache.gather`, what every layer did before: a copy
of each row's whole context per layer per step) or SDPA (which needs the keys contiguous per
row): see docs/architecture.md ("Paged attention on the torch path") and bench/paged_attention.py.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from shard_contract.env import PAGED_ATTENTION_ENV
from shard_contract.sharding import MASK_QUERY_BLOCK

from . import kernels, recompiles
from .paging import BLOCK_SIZE, TRASH_BLOCK

# query columns a mask block: a decode step's one, a chunk's in 128s (Triton's BLOCK_M divides it)
Q_BLOCK = MASK_QUERY_BLOCK
_FAR = 1 << 30  # a bound no position reaches: the padded query columns of a mask read nothing

Attend = Callable[..., torch.Tensor]
_compiled: dict[str, Attend] = {}


def inverse(tables: torch.Tensor, pool_blocks: int) -> torch.Tensor:
    """[N, pool_blocks] int32: the logical index of each pool block in each row's table (-1 where
    the row does not hold it). A block a row's table lists twice (TRASH, in a free row's or past
    a row's held blocks) gets one of its indices: such blocks are never among those a row reads."""
    n, width = tables.shape
    inv = torch.full((n, pool_blocks), -1, dtype=torch.int32, device=tables.device)
    at = torch.arange(width, dtype=torch.int32, device=tables.device).expand(n, width)
    return inv.scatter_(1, tables, at)


MaskTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def paged_mask(tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pool_blocks: int,
               block_size: int = BLOCK_SIZE) -> BlockMask:
    """The block mask of a pass whose query (b, i) attends to its row's logical positions
    [lo[b, i], hi[b, i]] (device tensors [N, S]; hi < lo: nothing), through the rows' block
    tables `tables` [N, blocks] (device), over a pool of `pool_blocks` blocks of `block_size`."""
    return block_mask(mask_tensors(tables, lo, hi, pool_blocks, block_size), lo.shape[1], pool_blocks, block_size)


def mask_tensors(tables: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pool_blocks: int,
                 block_size: int = BLOCK_SIZE) -> MaskTensors:
    """`paged_mask`'s tensors: each query block's count of pool blocks and their indices (in
    logical order), the rows' inverse tables, and lo and hi padded to whole query blocks. A
    compiled step takes them as inputs, built outside it (see `block_mask`)."""
    n, s = lo.shape
    device = tables.device
    q_blocks = -(-s // Q_BLOCK)
    pad = q_blocks * Q_BLOCK - s
    lo = F.pad(lo, (0, pad), value=_FAR)
    hi = F.pad(hi, (0, pad), value=-1)
    # each query block's first and last logical block: the span of its queries' bounds
    first = lo.view(n, q_blocks, Q_BLOCK).amin(-1).clamp(min=0, max=_FAR - 1) // block_size
    last = hi.view(n, q_blocks, Q_BLOCK).amax(-1).div(block_size, rounding_mode="floor")
    count = (last - first + 1).clamp(min=0, max=tables.shape[1])
    logical = first.unsqueeze(-1) + torch.arange(pool_blocks, device=device)  # [N, q_blocks, pool_blocks]
    listed = tables.unsqueeze(1).expand(n, q_blocks, tables.shape[1])
    indices = listed.gather(2, logical.clamp(max=tables.shape[1] - 1))
    indices = torch.where(logical - first.unsqueeze(-1) < count.unsqueeze(-1), indices, TRASH_BLOCK)
    return (count.to(torch.int32).unsqueeze(1), indices.to(torch.int32).unsqueeze(1), inverse(tables, pool_blocks),
            lo, hi)


def block_mask(tensors: MaskTensors, queries: int, pool_blocks: int, block_size: int = BLOCK_SIZE) -> BlockMask:
    """The BlockMask of `mask_tensors` for `queries` query columns. Inside a compiled step the
    tensors must be the step's inputs: inductor's C++ template (torch 2.13) cannot take a tensor
    the graph computes into a mask_mod (one from pointwise operators fails its lowering, no
    choices; the inverse tables from a scatter gave wrong scores)."""
    count, indices, inv, lo, hi = tensors

    def within(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        held = inv[b, kv // block_size]
        position = held * block_size + kv % block_size
        return (held >= 0) & (position >= lo[b, q]) & (position <= hi[b, q])

    return BlockMask.from_kv_blocks(count, indices, BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=within,
                                    seq_lengths=(queries, pool_blocks * block_size), **SKIP_Q_BLOCKS)


# The backward pass's transposed block lists, which inference never reads: not computed where
# from_kv_blocks can skip them (a dense [query blocks, pool blocks] sort per step otherwise). Decided
# by the signature: the GPU machines' torch (2.11 when last seen) is older than this repository's.
SKIP_Q_BLOCKS: dict[str, Any] = (
    {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {})


def bounds(positions: torch.Tensor, window: int | None, floor: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) for queries at logical positions `positions` [N, S] (negative: a padding query,
    which reads nothing): causal, no further back than `window`, nor before `floor` [N] (the
    first position a row may read, where positions are columns: the padding of an unpaged
    row's columns)."""
    lo = torch.zeros_like(positions) if window is None else (positions - window + 1).clamp(min=0)
    if floor is not None:
        lo = torch.maximum(lo, floor.unsqueeze(1))
    hi = torch.where(positions >= lo, positions, -1)
    return lo, hi


def tail_slots(writes: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """[N, block_size - 1]: the pool slots after each row's last written slot (writes [N, S]) in
    the same block, which nothing has written yet and the row's next reads mask (TRASH's first
    slot past the block's end: never read)."""
    last = writes[:, -1:]
    after = last + torch.arange(1, block_size, device=writes.device)
    return torch.where(last % block_size + torch.arange(1, block_size, device=writes.device) < block_size, after,
                       TRASH_BLOCK * block_size)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v of q [N, heads, S, d] over the pool keys, values [kv_heads,
    slots, d] (this layer's, read in place: `KVCache.layer_k`, a tensor of its own) under `mask`
    (`paged_mask`) -> [N, heads, S, d]."""
    grouped = q.shape[1] != keys.shape[0]
    out = _kernel(q.device)(q, keys.unsqueeze(0), values.unsqueeze(0), block_mask=mask, enable_gqa=grouped,
                            kernel_options=kernel_options(q.device, mask.BLOCK_SIZE[1]))
    assert isinstance(out, torch.Tensor)
    return out


def kernel_options(device: torch.device, block_size: int = BLOCK_SIZE) -> dict[str, bool | int] | None:
    """flex_attention's kernel options on `device` for a mask of `block_size`-position KV blocks.

    On CUDA inductor's Triton template walks the keys BLOCK_N at a time and needs BLOCK_N to
    divide the mask's KV block (its lowering raises "Q and KV block size must be divisible by
    BLOCK_M and BLOCK_N" otherwise); its default tiles take 32-128 keys for heads of up to 128 on
    Ampere and Hopper, so our 16-position blocks need BLOCK_N = 16, as vLLM's paged FlexAttention
    sets it from the mask's block size. FORCE_USE_FLEX_ATTENTION keeps every shape on that template: the
    flex_decoding one, taken for a query batch it knows statically, sizes its BLOCK_M from the
    query columns times the group, and past the mask's 128-query block (one row's chunk of 33+
    columns at 4 query heads per KV head) it has no config at all. Every default BLOCK_M (32-128)
    divides the 128-query block. The CPU's C++ template has neither limit: None (its defaults)."""
    if device.type != "cuda":
        return None
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_N": block_size}


def _kernel(device: torch.device) -> Attend:
    """flex_attention as a fused kernel, compiled once per device type. Without compiling, flex_attention
    computes every row's scores against the whole pool (its reference path): never used here.
    Inside a compiled step, flex_attention itself: the step's compile lowers it."""
    if torch.compiler.is_compiling():
        return flex_attention
    kind = device.type
    if kind not in _compiled:
        # dynamic: one kernel for every batch and chunk length (a decode step's shapes differ by
        # rows only); the block size and pool stay static
        _compiled[kind] = torch.compile(flex_attention, dynamic=True, fullgraph=True)
        if kind == "cuda":  # every attention pass of a GPU rank comes here (a CPU rank's rarely)
            recompiles.allow()  # batches and chunk lengths vary as it serves
    return _compiled[kind]



def in_place(device: torch.device) -> bool:
    """Whether a pass on `device` reads the pool in place (`attend`) or gathers each row's context
    (`KVCache.gather`): SHARD_PAGED_ATTENTION (flex, gather, auto). auto: in place on CUDA and on a
    CPU rank without our C kernels (not built, or SHARD_KERNEL=torch); a CPU rank with them reads
    in place in its decode attention (`kernels.attend`) and gathers for a later prefill chunk
    (whose queries share the copy; compiling the kernel costs a CPU rank 10-60 s a process).
    Inside a compiled step (the decode graphs' compile mode) auto reads in place on every device:
    the kernel is compiled with the step, and the C kernels are not in it."""
    want = os.environ.get(PAGED_ATTENTION_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "flex", "gather"):
        raise ValueError(f"{PAGED_ATTENTION_ENV}={want!r}: one of auto, flex, gather")
    if want != "auto":
        return want == "flex"
    return torch.compiler.is_compiling() or device.type == "cuda" or kernels.LEVEL is None
