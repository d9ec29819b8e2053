"""One pipeline stage of a Llama-family decoder, tensor-parallel within the stage.

The stage holds only its layer range; the first stage embeds, the last applies the final norm and
the LM head. Per rank, q/k/v are one column-parallel matrix and gate/up another (two matmuls where
HF does five), o and down are row-parallel: two all-reduces a layer, written where they happen.

`Layout` says which slices of each checkpoint tensor this rank holds (the rules of
`shard_operator.sizing`), and `Stage.pieces()` turns that into the name-mapping table the loader
follows: destination tensor -> checkpoint tensors, slice, and destination row.

A streamed layer (offload) holds its norms and biases but not its four projection matrices: a
streamer (`offload.py`) lends them to it for each forward pass (mapped in place from the
checkpoint, or copied into a staging slot).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from shard_contract.sharding import kv_head_start, kv_heads_per_rank, tp_problem, vocab_rows_per_rank

from ..comm.dist import Comm
from . import kernels, paged, paging
from .attention import MASKED, additive, allowed_keys, first_columns, grouped_attention, mask_kind
from .config import ModelConfig
from .fused import FusedDecode
from .layers import ColumnParallelLinear, ParallelLMHead, Projection, RMSNorm, RowParallelLinear, VocabParallelEmbedding


# ---------------------------------------------------------------- which slices
@dataclass(frozen=True)
class Layout:
    """This rank's share, by the contract's sharding rules (the planner sizes by them too):
    1/TP of the heads and MLP columns, ceil(kv/TP) KV heads, ceil(V/TP) vocabulary rows."""

    config: ModelConfig
    tp: int
    tp_rank: int
    layers: tuple[int, int]
    embeds: bool
    has_lm_head: bool

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return kv_heads_per_rank(self.config, self.tp)

    @property
    def kv_head_start(self) -> int:
        return kv_head_start(self.config, self.tp, self.tp_rank)

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.tp

    @property
    def vocab_rows(self) -> int:
        return vocab_rows_per_rank(self.config, self.tp)

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_rows

    @property
    def vocab_valid(self) -> int:
        """Rows of real vocabulary (the rest of the last rank's block is zero padding)."""
        return max(0, min(self.vocab_rows, self.config.vocab_size - self.vocab_start))

    @property
    def shares_embedding(self) -> bool:
        """Tied embeddings stored once: this stage both embeds and projects."""
        return self.config.tie_word_embeddings and self.embeds and self.has_lm_head


@dataclass(frozen=True)
class Piece:
    """Rows (dim 0) or columns (dim 1) [start, stop) of checkpoint `tensor`, written into the
    destination from row `offset` on."""

    tensor: str
    dim: int
    start: int
    stop: int
    offset: int = 0


def check_tp(config: ModelConfig, tp: int) -> None:
    problem = tp_problem(config, tp)
    if problem is not None:
        raise ValueError(f"this model cannot be split: {problem}")


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
    for the CPU kernels (see `first_columns`). A captured decode step (`Step.captured`) has no
    host column: `column` [1] is a device tensor, the keys and values are written there
    and attention reads `length` columns, masked past the step's own.

    `reads` [N, length] and `writes` [N, c1 - c0]: the pool slot of each column the pass attends
    to and computes, from its rows' block tables (`paging.slot_maps`; every layer uses them). A
    pass built without tables gets the cache's contiguous ones (`KVCache.maps`).

    For the pool read in place (`paged`): `tables` the rows' block tables and `positions` [N, S]
    each query's position (column - padding; negative for a padding query), on the device; without
    tables, `positions` are columns and `floor` each row's padding (the contiguous tables hold a
    row's columns, padding included). `blocks`: the block masks, per window, built once a step."""

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
              starts: torch.Tensor | None = None) -> Step:
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
        step = cls(r0, r1, c0, c1, cos, sin, masks, firsts)
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
                 windows: set[int | None], dtype: torch.dtype, tables: torch.Tensor) -> Step:
        """A decode step of rows [0, rows) at device column `column` [1], attending over `length`
        cache columns through the rows' block tables `tables` [>= rows, blocks], from device
        tensors only (no host value: it can be captured and replayed)."""
        positions = (column - pads[:rows]).clamp(min=0).unsqueeze(1)  # [rows, 1]
        cos, sin = rotary.at(positions, dtype)
        masks: dict[int | None, torch.Tensor | str | None] = {
            w: additive(allowed_keys(pads[:rows], column, 1, length, w), dtype) for w in windows}
        reads, writes = paging.captured_maps(tables[:rows], pads[:rows], column, length)
        return cls(0, rows, 0, 1, cos, sin, masks, None, column, length, reads, writes, tables[:rows],
                   (column - pads[:rows]).unsqueeze(1))


class KVCache:
    """Keys and values of this rank's layers and KV heads, paged: a pool of `num_blocks` blocks of
    `paging.BLOCK_SIZE` positions (and the reserved ZERO and TRASH blocks), allocated (and zeroed,
    so resident) once: k and v [layers, kv_heads, slots, head_dim]. Which blocks a row holds is
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
        self.batch, self.max_len = batch, max_len
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
            step.reads, step.writes = reads.to(self.k.device), writes.to(self.k.device)
        return step.reads, step.writes

    def update(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys/values (k, v [rows, kv_heads, c1 - c0, head_dim]) in their slots,
        and zero what follows each row's last one in its block (`paged.tail_slots`: a masked key
        that attention reads in place must not be NaN)."""
        _, writes = self.maps(step)
        n, kv, s, d = k.shape
        at = writes.reshape(-1)
        tail = paged.tail_slots(writes, self.block_size).reshape(-1)
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            pool.index_copy_(1, at, new.transpose(0, 1).reshape(kv, n * s, d))
            pool.index_fill_(1, tail, 0.0)

    def mask(self, step: Step, window: int | None) -> BlockMask:
        """The step's block mask for layers of `window` (`paged.paged_mask`), built once a step."""
        if window not in step.blocks:
            assert step.positions is not None
            tables = step.tables if step.tables is not None else self.contiguous[step.r0:step.r1].to(self.k.device)
            lo, hi = paged.bounds(step.positions, window, step.floor)
            step.blocks[window] = paged.paged_mask(tables, lo, hi, self.num_blocks + paging.RESERVED_BLOCKS,
                                                   self.block_size)
        return step.blocks[window]

    def gather(self, layer: int, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' keys and values of columns [0, step.length) by their read map: a copy of each
        row's whole context (what the torch path did before `paged`; the bench's reference)."""
        reads, _ = self.maps(step)
        return self.k[layer][:, reads].transpose(0, 1), self.v[layer][:, reads].transpose(0, 1)


# ---------------------------------------------------------------- layers
class Attention:
    def __init__(self, layout: Layout, window: int | None, comm: Comm, dtype: torch.dtype, device: torch.device,
                 quantized: bool, streamed: bool = False):
        c = layout.config
        self.heads, self.kv_heads, self.head_dim, self.window = layout.heads, layout.kv_heads, c.head_dim, window
        self.q_size, self.kv_size = self.heads * c.head_dim, self.kv_heads * c.head_dim
        self.qkv = ColumnParallelLinear(c.hidden_size, self.q_size + 2 * self.kv_size, c.qkv_bias, dtype, device,
                                        quantized, streamed, blocks=(self.q_size, self.kv_size, self.kv_size))
        self.o = RowParallelLinear(self.q_size, c.hidden_size, c.o_bias, comm, dtype, device, quantized, streamed)

    def __call__(self, x: torch.Tensor, step: Step, cache: KVCache, layer: int) -> torch.Tensor:
        n, s, _ = x.shape
        qkv = self.qkv(x)
        if step.firsts is not None:  # a decode step: our kernel where it applies, in one call
            reads, writes = cache.maps(step)
            out = kernels.attend(qkv, step.cos, step.sin, cache.k[layer], cache.v[layer], step.firsts[self.window],
                                 step.c0, self.heads, self.kv_heads, slots=reads, wslots=writes)
            if out is not None:
                return self.o(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, s, self.heads, self.head_dim).transpose(1, 2), step.cos, step.sin)
        k = apply_rope(k.view(n, s, self.kv_heads, self.head_dim).transpose(1, 2), step.cos, step.sin)
        v = v.view(n, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cache.update(layer, step, k, v)
        if not step.fresh and paged.in_place(q.device):  # decode and later chunks: the pool read in place
            out = paged.attend(q, cache.k[layer], cache.v[layer], cache.mask(step, self.window))
            return self.o(out.transpose(1, 2).reshape(n, s, self.q_size))
        keys, values = (k, v) if step.fresh else cache.gather(layer, step)  # a first chunk's keys are its own
        mask = step.masks[self.window]
        if isinstance(mask, str):  # CAUSAL: SDPA's kernels take it unmasked
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                                 enable_gqa=self.heads > self.kv_heads)
        else:
            out = grouped_attention(q, keys, values, mask if isinstance(mask, torch.Tensor) else None)
        return self.o(out.transpose(1, 2).reshape(n, s, self.q_size))


class MLP:
    def __init__(self, layout: Layout, comm: Comm, dtype: torch.dtype, device: torch.device, quantized: bool,
                 streamed: bool = False):
        c = layout.config
        self.gate_up = ColumnParallelLinear(c.hidden_size, 2 * layout.intermediate, c.mlp_bias, dtype, device,
                                            quantized, streamed, blocks=(layout.intermediate, layout.intermediate))
        self.down = RowParallelLinear(layout.intermediate, c.hidden_size, c.mlp_bias, comm, dtype, device, quantized,
                                      streamed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        act = kernels.silu_mul(gate_up)  # ours on a CPU, as the fused layers compute it
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down(act)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's matrices: what a streamed layer borrows


class DecoderLayer:
    def __init__(self, layout: Layout, index: int, comm: Comm, dtype: torch.dtype, device: torch.device,
                 quantized: bool, streamed: bool = False):
        c = layout.config
        self.index, self.streamed = index, streamed
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.attn = Attention(layout, c.sliding_windows[index], comm, dtype, device, quantized, streamed)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MLP(layout, comm, dtype, device, quantized, streamed)
        self._placeholders = {name: p.weight for name, p in self.projections().items()}

    def projections(self) -> dict[str, ColumnParallelLinear | RowParallelLinear]:
        return {"qkv": self.attn.qkv, "o": self.attn.o, "gate_up": self.mlp.gate_up, "down": self.mlp.down}

    def borrow(self, weights: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] | None) -> None:
        """A streamed layer's projections use `weights` (a staging slot's, or the row blocks of each
        mapped in place), or nothing again (None)."""
        for name, projection in self.projections().items():
            projection.weight = self._placeholders[name] if weights is None else weights[name]

    def __call__(self, x: torch.Tensor, step: Step, cache: KVCache, slot: int) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), step, cache, slot)
        return x + self.mlp(self.post_norm(x))


# ---------------------------------------------------------------- the stage
def _own_tensors(name: str, projection: Projection) -> dict[str, torch.Tensor]:
    """A projection's tensors by our name: its weight unless streamed (a streamed one holds none
    of its own: the streamer lends it blocks for a pass), its int8 scales and its bias if any."""
    out = {}
    if not projection.streamed:
        if not isinstance(projection.weight, torch.Tensor):
            raise RuntimeError(f"{name}: a resident projection holds one weight tensor, not row blocks")
        out[name + ".weight"] = projection.weight
    if projection.scale is not None:
        out[name + ".scale"] = projection.scale
    if projection.bias is not None:
        out[name + ".bias"] = projection.bias
    return out


class Stage:
    """`quantization` "int8": the decoder layers' projections hold int8 weights and per-row
    scales; embeddings, norms and the LM head stay in `dtype`."""

    def __init__(self, layout: Layout, comm: Comm, dtype: torch.dtype, device: torch.device,
                 quantization: str = "none", streamed: Iterable[int] = ()):
        check_tp(layout.config, layout.tp)
        c = layout.config
        self.layout, self.config, self.dtype, self.device = layout, c, dtype, device
        quantized = quantization == "int8"
        streamed = set(streamed)
        if streamed and quantized:
            raise ValueError("int8 layers cannot be streamed (they would be quantized again at every step)")
        if not streamed <= set(range(*layout.layers)):
            raise ValueError(f"streamed layers {sorted(streamed)} are not all in this stage's {list(layout.layers)}")
        self.embed = VocabParallelEmbedding(layout.vocab_start, layout.vocab_rows, c.hidden_size, comm, dtype,
                                            device) if layout.embeds else None
        self.layers = [DecoderLayer(layout, i, comm, dtype, device, quantized, i in streamed)
                       for i in range(*layout.layers)]
        self.streamer: Any = None  # lends streamed layers their weights (offload.Streamer)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device) if layout.has_lm_head else None
        self.lm_head = None
        if layout.has_lm_head:
            shared = self.embed.weight if self.embed is not None and layout.shares_embedding else None
            self.lm_head = ParallelLMHead(layout.vocab_rows, c.hidden_size, c.vocab_size, comm, dtype, device,
                                          weight=shared)
        self.windows = {c.sliding_windows[i] for i in range(*layout.layers)}
        self.fused = FusedDecode(comm)

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        """Token ids [N, S] (first stage) or hidden states [N, S, H] -> hidden states [N, S, H]."""
        if self.embed is not None:
            x = self.embed(x)
        fused = self.fused.ready(x, step, cache)
        if fused:
            x = x.clone(memory_format=torch.contiguous_format)  # the fused layers update it in place
        for slot, layer in enumerate(self.layers):
            if fused and not layer.streamed and self.fused.run(layer, slot, x) is not None:
                continue
            with self.streamer.lend(layer) if layer.streamed else nullcontext():
                x = layer(x, step, cache, slot)
            if fused:
                x = x.contiguous()
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, H] -> float32 logits [N, vocab] (last stage)."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("logits come from the last stage (this one has no LM head)")
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------ what the loader fills
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this rank holds, by our name (tied embeddings appear once); an int8
        projection's scales are `<name>.scale` beside its `<name>.weight`."""
        out: dict[str, torch.Tensor] = {}
        if self.embed is not None:
            out["embed.weight"] = self.embed.weight
        for layer in self.layers:
            p = f"layers.{layer.index}."
            out[p + "input_norm.weight"], out[p + "post_norm.weight"] = layer.input_norm.weight, layer.post_norm.weight
            for name, module in (("qkv", layer.attn.qkv), ("o", layer.attn.o),
                                 ("gate_up", layer.mlp.gate_up), ("down", layer.mlp.down)):
                out.update(_own_tensors(p + name, module))
        if self.norm is not None:
            out["norm.weight"] = self.norm.weight
        if self.lm_head is not None and not self.layout.shares_embedding:
            out["lm_head.weight"] = self.lm_head.weight
        return out

    def streamed_pieces(self) -> dict[int, dict[str, list[Piece]]]:
        """For each streamed layer, the checkpoint slices of each of its projections (by the names
        of PROJECTIONS)."""
        table = self.pieces(streamed=True)
        return {layer.index: {name: table[f"layers.{layer.index}.{name}.weight"] for name in PROJECTIONS}
                for layer in self.layers if layer.streamed}

    def pieces(self, streamed: bool = False) -> dict[str, list[Piece]]:
        """The name-mapping table: for each of our tensors (but int8 scales, which the loader
        computes beside their weights), the checkpoint slices that fill it; with `streamed`, the
        streamed layers' projections too (which `tensors()` does not hold)."""
        lay, c = self.layout, self.config
        hd, r = c.head_dim, lay.tp_rank
        q = (r * lay.heads * hd, (r + 1) * lay.heads * hd)
        kv = (lay.kv_head_start * hd, (lay.kv_head_start + lay.kv_heads) * hd)
        mlp = (r * lay.intermediate, (r + 1) * lay.intermediate)
        q_local, kv_local = q[1] - q[0], kv[1] - kv[0]
        table: dict[str, list[Piece]] = {}
        vocab = (lay.vocab_start, lay.vocab_start + lay.vocab_valid)
        if lay.embeds:
            table["embed.weight"] = [Piece("model.embed_tokens.weight", 0, *vocab)]
        for i in range(*lay.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            for kind in (("weight", "bias") if c.qkv_bias else ("weight",)):
                table[dst + f"qkv.{kind}"] = [
                    Piece(src + f"self_attn.q_proj.{kind}", 0, *q),
                    Piece(src + f"self_attn.k_proj.{kind}", 0, *kv, offset=q_local),
                    Piece(src + f"self_attn.v_proj.{kind}", 0, *kv, offset=q_local + kv_local)]
            table[dst + "o.weight"] = [Piece(src + "self_attn.o_proj.weight", 1, *q)]
            for kind in (("weight", "bias") if c.mlp_bias else ("weight",)):
                table[dst + f"gate_up.{kind}"] = [
                    Piece(src + f"mlp.gate_proj.{kind}", 0, *mlp),
                    Piece(src + f"mlp.up_proj.{kind}", 0, *mlp, offset=lay.intermediate)]
            table[dst + "down.weight"] = [Piece(src + "mlp.down_proj.weight", 1, *mlp)]
            replicated = {"input_norm.weight": "input_layernorm.weight",
                          "post_norm.weight": "post_attention_layernorm.weight"}
            if c.o_bias:
                replicated["o.bias"] = "self_attn.o_proj.bias"
            if c.mlp_bias:
                replicated["down.bias"] = "mlp.down_proj.bias"
            for ours, theirs in replicated.items():
                size = c.tensor_shapes[src + theirs][0]
                table[dst + ours] = [Piece(src + theirs, 0, 0, size)]
        if lay.has_lm_head:
            table["norm.weight"] = [Piece("model.norm.weight", 0, 0, c.hidden_size)]
            if not lay.shares_embedding:
                source = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
                table["lm_head.weight"] = [Piece(source, 0, *vocab)]
        if not streamed:
            for layer in self.layers:
                if layer.streamed:
                    for name in PROJECTIONS:
                        del table[f"layers.{layer.index}.{name}.weight"]
        return table
