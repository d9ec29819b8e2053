"""Tensor-parallel building blocks. Each allocates only this rank's shard, uninitialised (the
loader fills it), and keeps weights in `nn.Linear`'s [out, in] layout, which both our decode
kernels and `F.linear` stream row by row (`kernels.linear` picks one).

With `quantized`, a projection holds int8 weights and one float32 scale per output row
(weight-only, symmetric: W ~ q * scale); activations stay in the runtime dtype. With `streamed`
(offload), it holds no weight: `weight` is an empty placeholder until a streamer points it at its
weights for the one forward pass that needs it (a staging slot, or views of the checkpoint file
mapped in place: then a tuple of row blocks, one per checkpoint tensor, e.g. q, k and v).

A float projection made of several checkpoint tensors (`blocks`: q, k, v; gate, up) has torch
multiply each block on its own on a CPU, resident or streamed in place, so both give the same bits
(our decode kernel sums every output on its own anyway: `kernels.linear`).

Plain classes rather than `nn.Module`: no hooks, no per-call dispatch, and the collective each
layer needs is the one line you see in its `__call__`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.dist import Comm
from . import kernels
from .kernels import linear


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=device)


class Projection:
    """A weight [out, in] in the runtime dtype, or int8 with a float32 scale per output row; or,
    `streamed`, none of its own (see the module docstring). `blocks`: the rows of each checkpoint
    tensor it is made of, in order."""

    def __init__(self, out_features: int, in_features: int, bias: bool, quantized: bool, dtype: torch.dtype,
                 device: torch.device, streamed: bool = False, blocks: tuple[int, ...] = ()):
        self.shape = (out_features, in_features)
        self.streamed = streamed
        assert not blocks or sum(blocks) == out_features, (blocks, out_features)
        self.blocks = blocks if len(blocks) > 1 and not quantized else ()
        rows = 0 if streamed else out_features
        self.weight: torch.Tensor | tuple[torch.Tensor, ...] = _empty(
            rows, in_features, dtype=torch.int8 if quantized else dtype, device=device)
        self.scale = _empty(out_features, dtype=torch.float32, device=device) if quantized else None
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None


class ColumnParallelLinear(Projection):
    """y_r = x W_r^T + b_r with W_r this rank's rows (output features). No communication: the
    output stays split, ready for a row-parallel layer."""

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 quantized: bool = False, streamed: bool = False, blocks: tuple[int, ...] = ()):
        super().__init__(out_local, in_features, bias, quantized, dtype, device, streamed, blocks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scale, self.bias, blocks=self.blocks)


class RowParallelLinear(Projection):
    """y = sum_r x_r W_r^T + b with W_r this rank's columns (input features): one all-reduce,
    and the bias added once, after it. An int8 rank's scales are those of whole rows (every rank
    holds the same), so the quantization does not depend on the tensor-parallel degree."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Comm, dtype: torch.dtype,
                 device: torch.device, quantized: bool = False, streamed: bool = False):
        super().__init__(out_features, in_local, bias, quantized, dtype, device, streamed)
        self.comm = comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.scale, blocks=self.blocks)
        self.comm.all_reduce(y)
        if self.bias is not None:
            y += self.bias
        return y


class VocabParallelEmbedding:
    """Rows [start, start + rows) of the embedding table (the last rank's tail is padding).

    Every rank looks up the ids it owns, writes zeros for the rest, and an all-reduce sums the
    partial results: each id is owned by exactly one rank.
    """

    def __init__(self, start: int, rows: int, hidden: int, comm: Comm, dtype: torch.dtype, device: torch.device):
        self.start, self.rows, self.comm = start, rows, comm
        self.weight = _empty(rows, hidden, dtype=dtype, device=device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.topo.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        self.comm.all_reduce(out)
        return out


class ParallelLMHead:
    """Logits of this rank's vocabulary rows, gathered over the TP group into the full vocabulary
    (float32, padding columns dropped) so every TP rank samples from identical logits."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, comm: Comm, dtype: torch.dtype,
                 device: torch.device, weight: torch.Tensor | None = None):
        self.vocab_size, self.comm = vocab_size, comm
        self.weight = weight if weight is not None else _empty(rows, hidden, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight)
        return self.comm.all_gather(local)[..., :self.vocab_size].float()


class RMSNorm:
    """Replicated on every rank. Normalises in float32, like HF, then scales in the model dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        self.eps = eps
        self.weight = _empty(hidden, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ours = kernels.rms_norm(x, self.weight, self.eps)  # one call where torch makes several
        if ours is not None:
            return ours
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight
