"""One forward pass's context: its rows and columns, their positions (RoPE) and masks, and the
paged KV cache it reads and writes.

A `Step` is built once a pass, on the host from the batch's paddings and block tables
(`Step.build`), or from device tensors only for a decode step that is captured and replayed
(`Step.captured`); every layer of the stage reads it. The `KVCache` is the pool of KV blocks the
rows' block tables point into (`paging.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from . import kernels, paged, paging
from .attention import MASKED, additive, allowed_keys, first_columns, mask_kind
from .config import ModelConfig


# ---------------------------------------------------------------- RoPE
def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with `linear` or `llama3` scaling."""
    rope, dim = config.rope, config.head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(between, blended, scaled)
    return inv_freq


class Rotary:
    """cos/sin of every position up to `max_len`, computed once in float32."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device):
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(config))
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, S, head_dim] tables for positions [N, S], broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------- one forward pass's context
@dataclass
class Step:
    """Rows [r0, r1) of the batch, cache columns [c0, c1): one forward pass through a stage.

    `masks`, per attention window: None, CAUSAL, or an additive device mask [N, 1, S, `length`]
    (see `attention_mask`). `firsts`: a decode step's first allowed column per row, on the host,
    for the CPU kernels (see `first_columns`); a step built `per_token` (a prompt chunk's, for the
    C kernels and fused layers, which take each token at its own column): each token's [N, S], and
    `cols` [N, S] each token's column. A captured decode step (`Step.captured`) has no
    host column: `column` [1] is a device tensor, the keys and values are written there
    and attention reads `length` columns, masked past the step's own.

    `reads` [N, length] and `writes` [N, c1 - c0]: the pool slot of each column the pass attends
    to and computes, from its rows' block tables (`paging.slot_maps`; every layer uses them). A
    pass built without tables gets the cache's contiguous ones (`KVCache.maps`).

    For the pool read in place (`paged`): `tables` the rows' block tables and `positions` [N, S]
    each query's position (column - padding; negative for a padding query), on the device; without
    tables, `positions` are columns and `floor` each row's padding (the contiguous tables hold a
    row's columns, padding included). `blocks`: the block masks, per window, built once a step
    (from `block_inputs`, their tensors, where a compiled step was given them)."""

    r0: int
    r1: int
    c0: int
    c1: int
    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict[int | None, torch.Tensor | str | None]
    firsts: dict[int | None, torch.Tensor] | None = None
    column: torch.Tensor | None = None
    length: int = 0
    reads: torch.Tensor | None = None
    writes: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    floor: torch.Tensor | None = None
    blocks: dict[int | None, BlockMask] = field(default_factory=dict)
    block_inputs: dict[int | None, paged.MaskTensors] | None = None
    cols: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.length = self.length or self.c1

    @property
    def fresh(self) -> bool:
        """A first chunk: the keys it attends to are its own, just computed (no cache read)."""
        return self.c0 == 0 and self.column is None

    @classmethod
    def build(cls, r0: int, r1: int, c0: int, c1: int, pads: torch.Tensor, rotary: Rotary,
              windows: set[int | None], dtype: torch.dtype, device: torch.device,
              device_pads: torch.Tensor | None = None, tables: torch.Tensor | None = None,
              starts: torch.Tensor | None = None, per_token: bool = False) -> Step:
        """`pads`: every row's padding on the host (the decisions); `device_pads` the same on the
        device, if the caller keeps it there (else copied from `pads`). `tables` [rows, blocks]
        and `starts` [rows]: every row's block table and first own position, on the host (see
        `paging`); without them, the cache's contiguous tables."""
        rows = pads[r0:r1]
        dev_rows = (device_pads[r0:r1] if device_pads is not None
                    else rows.to(device, non_blocking=True))
        positions = (torch.arange(c0, c1, device=device).unsqueeze(0) - dev_rows.unsqueeze(1)).clamp(min=0)
        cos, sin = rotary.at(positions, dtype)
        masks: dict[int | None, torch.Tensor | str | None] = {}
        for w in windows:
            kind = mask_kind(rows, c0, c1, w)
            masks[w] = additive(allowed_keys(dev_rows, c0, c1 - c0, c1, w), dtype) if kind == MASKED else kind
        firsts = {w: first_columns(rows, c0, w) for w in windows} if c1 - c0 == 1 else None
        cols = None
        if per_token and c1 - c0 > 1 and (r1 - r0) * (c1 - c0) <= kernels.MAX_TOKENS:
            cols = torch.arange(c0, c1).expand(r1 - r0, c1 - c0)
            firsts = {w: first_columns(rows.unsqueeze(1), cols, w) for w in windows}
        step = cls(r0, r1, c0, c1, cos, sin, masks, firsts, cols=cols)
        columns = torch.arange(c0, c1, device=device).expand(r1 - r0, c1 - c0)
        if tables is not None:
            own = starts[r0:r1] if starts is not None else torch.zeros_like(rows)
            reads, writes = paging.slot_maps(tables[r0:r1], rows, own, c0, c1)
            step.reads, step.writes = reads.to(device, non_blocking=True), writes.to(device, non_blocking=True)
            step.tables, step.positions = tables[r0:r1].to(device, non_blocking=True), columns - dev_rows.unsqueeze(1)
        else:  # the cache's contiguous tables, a row's columns its positions: the padding is read past
            step.positions, step.floor = columns, dev_rows
        return step

    @classmethod
    def captured(cls, rows: int, length: int, column: torch.Tensor, pads: torch.Tensor, rotary: Rotary,
                 windows: set[int | None], dtype: torch.dtype, tables: torch.Tensor,
                 block_inputs: dict[int | None, paged.MaskTensors] | None = None) -> Step:
        """A decode step of rows [0, rows) at device column `column` [1], attending over `length`
        cache columns through the rows' block tables `tables` [>= rows, blocks], from device
        tensors only (no host value: it can be captured and replayed). `block_inputs`: its block
        masks' tensors per window (`graphs.decode_masks`), where built outside a compiled step."""
        positions = (column - pads[:rows]).clamp(min=0).unsqueeze(1)  # [rows, 1]
        cos, sin = rotary.at(positions, dtype)
        masks: dict[int | None, torch.Tensor | str | None] = {
            w: additive(allowed_keys(pads[:rows], column, 1, length, w), dtype) for w in windows}
        reads, writes = paging.captured_maps(tables[:rows], pads[:rows], column, length)
        return cls(0, rows, 0, 1, cos, sin, masks, None, column, length, reads, writes, tables[:rows],
                   (column - pads[:rows]).unsqueeze(1), block_inputs=block_inputs)


class KVCache:
    """Keys and values of this rank's layers and KV heads, paged: a pool of `num_blocks` blocks of
    `paging.BLOCK_SIZE` positions (and the reserved ZERO and TRASH blocks), allocated (and zeroed,
    so resident) once: k and v [layers, kv_heads, slots, head_dim], and each layer's [kv_heads,
    slots, head_dim] as a view of its own (`layer_k`, `layer_v`). Which blocks a row holds is
    its block table (the engine's; see `paging`). `tokens`: the positions the pool holds (the
    plan's kvCacheTokens; by default `batch` x `max_len`, every row at its longest).

    What a forward pass asks of a cache (all of it): `update(layer, step, k, v)` stores the step's
    keys and values; `mask(step, window)` the step's block mask, to read the pools `k` and `v` in
    place (`paged.attend`), or `gather(layer, step)` each row's context as a copy; `batch` (rows:
    the most sequences at once) and `max_len`; `maps(step)` (the slots of the step's columns)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, tokens: int | None = None):
        self.block_size = paging.BLOCK_SIZE
        self.num_blocks = max(1, paging.blocks_for(tokens if tokens is not None else batch * max_len))
        slots = (self.num_blocks + paging.RESERVED_BLOCKS) * self.block_size
        shape = (layers, kv_heads, slots, head_dim)  # a head's positions side by side, as an unpaged cache's
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Each layer's pool as a tensor object of its own (views of k and v), which every pass
        # uses: a compiled step then takes each as a graph input at its own address. `k[layer]`
        # taken inside the graph is a view at an offset, which inductor's C++ FlexAttention
        # template (torch 2.13) drops: every layer would read layer 0's keys and values.
        self.layer_k, self.layer_v = self.k.unbind(0), self.v.unbind(0)
        self.batch, self.max_len, self.device = batch, max_len, device
        self.blocks_per_row = paging.blocks_for(max_len)
        self.contiguous = paging.contiguous_tables(batch, max_len, self.num_blocks)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def maps(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's read and write maps (built now from the contiguous tables if it has none)."""
        if step.reads is None or step.writes is None:
            pads = torch.zeros(step.r1 - step.r0, dtype=torch.int64)
            reads, writes = paging.slot_maps(self.contiguous[step.r0:step.r1], pads, pads, step.c0, step.c1)
            step.reads, step.writes = reads.to(self.device), writes.to(self.device)
        return step.reads, step.writes

    def update(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys/values (k, v [rows, kv_heads, c1 - c0, head_dim]) in their slots,
        and zero what follows each row's last one in its block (`paged.tail_slots`: a masked key
        that attention reads in place must not be NaN)."""
        _, writes = self.maps(step)
        n, kv, s, d = k.shape
        at = writes.reshape(-1)
        tail = paged.tail_slots(writes, self.block_size).reshape(-1)
        for pool, new in ((self.layer_k[layer], k), (self.layer_v[layer], v)):
            pool.index_copy_(1, at, new.transpose(0, 1).reshape(kv, n * s, d))
            pool.index_fill_(1, tail, 0.0)

    def mask(self, step: Step, window: int | None) -> BlockMask:
        """The step's block mask for layers of `window` (`paged.paged_mask`), built once a step."""
        pool = self.num_blocks + paging.RESERVED_BLOCKS
        if window not in step.blocks and step.block_inputs is not None:
            step.blocks[window] = paged.block_mask(step.block_inputs[window], step.c1 - step.c0, pool, self.block_size)
        if window not in step.blocks:
            assert step.positions is not None
            tables = step.tables if step.tables is not None else self.contiguous[step.r0:step.r1].to(self.device)
            lo, hi = paged.bounds(step.positions, window, step.floor)
            step.blocks[window] = paged.paged_mask(tables, lo, hi, pool, self.block_size)
        return step.blocks[window]

    def gather(self, layer: int, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' keys and values of columns [0, step.length) by their read map: a copy of each
        row's whole context (what the torch path did before `paged`; the bench's reference)."""
        reads, _ = self.maps(step)
        return self.layer_k[layer][:, reads].transpose(0, 1), self.layer_v[layer][:, reads].transpose(0, 1)
