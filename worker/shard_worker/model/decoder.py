"""A decoder layer of the Llama family, tensor-parallel: attention and the MLP around their norms.

Per rank, q/k/v are one column-parallel matrix and gate/up another (two matmuls where HF does
five), o and down are row-parallel: two all-reduces a layer, written where they happen (in the
row-parallel layers' forward, `layers.py`). A decode step's attention, and a small prompt chunk's
(a step built `per_token`), is our C kernel where it applies (`kernels.attend`); otherwise the pool
is read in place (`paged.py`) or gathered.

A streamed layer (offload) holds its norms and biases but not its four projection matrices: a
streamer (`offload.py`) lends them to it for each forward pass (`DecoderLayer.borrow`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.dist import Comm
from . import kernels, paged
from .attention import grouped_attention
from .layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from .slices import Layout
from .step import KVCache, Step, apply_rope


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
        if step.firsts is not None:  # a decode step or a small chunk: our kernel where it applies, in one call
            reads, writes = cache.maps(step)
            out = kernels.attend(qkv, step.cos, step.sin, cache.layer_k[layer], cache.layer_v[layer],
                                 step.firsts[self.window], step.c0, self.heads, self.kv_heads, slots=reads,
                                 wslots=writes, cols=step.cols)
            if out is not None:
                return self.o(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, s, self.heads, self.head_dim).transpose(1, 2), step.cos, step.sin)
        k = apply_rope(k.view(n, s, self.kv_heads, self.head_dim).transpose(1, 2), step.cos, step.sin)
        v = v.view(n, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cache.update(layer, step, k, v)
        if not step.fresh and paged.in_place(q.device):  # decode and later chunks: the pool read in place
            out = paged.attend(q, cache.layer_k[layer], cache.layer_v[layer], cache.mask(step, self.window))
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
