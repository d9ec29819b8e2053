"""Weight-only int8: symmetric, one float32 scale per output row (W ~ q * scale, q in [-127, 127]).

The loader quantizes each chunk of checkpoint rows as it reads it, with this one function; tests
quantize a whole model with it to build the reference the sharded model must match exactly.

An int8 projection's input x is quantized too, at every call, to int16 with one power-of-two
scale per block of ACT_BLOCK columns: the C kernels then sum each block's products exactly in
integers (`csrc/`), and torch's path (prefill, GPUs, no extension) computes with the same
quantized x, so every path agrees to float rounding. Each value moves by at most 2^-14 of the
largest magnitude in its block, and a bfloat16 value within 2^7 of that largest not at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACT_BLOCK = 128  # columns of x sharing one scale (QBLOCK in csrc/gemv.h)
ACT_QMAX = 32767
ACT_EXP_MIN = -100  # blocks whose largest |x| is below 2^-101 are scaled as if it were


def quantize_rows_(rows: torch.Tensor) -> torch.Tensor:
    """Quantize float32 `rows` [n, k] in place to integral values in [-127, 127]; return their
    scales [n] (largest magnitude / 127, so it maps to 127 exactly)."""
    largest = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())
    scale = largest.div_(127).clamp_(min=torch.finfo(torch.float32).tiny)  # all-zero rows stay zero
    rows.div_(scale.unsqueeze(1)).round_().clamp_(-127, 127)
    return scale


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q, float32 scales) of a weight [out, in], as the loader makes them."""
    rows = weight.to(torch.float32, copy=True)
    scale = quantize_rows_(rows)
    return rows.to(torch.int8), scale


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e (int32 e in [-126, 127]) as float32, built from its bits: exact."""
    return ((e + 127) << 23).view(torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] (float32 or bfloat16) as int8 projections see it: int16 values [..., kpad]
    (k padded with zeros to a multiple of ACT_BLOCK) and float32 scales [..., kpad / ACT_BLOCK].

    A block whose largest magnitude lies in [2^(e-1), 2^e) gets the scale 2^(e-15) and the values
    round(x / scale) (half to even) clamped to +-32767; a block holding inf or NaN gets zeros and a
    NaN scale, so what it touches comes out NaN. The same bits as `_gemv.quantize`."""
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, -k % ACT_BLOCK)).unflatten(-1, (-1, ACT_BLOCK))
    largest = (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1, keepdim=True)  # |x|'s bits, NaN above inf
    finite = largest < 0x7F800000
    exponent = ((largest >> 23) - 126).clamp_(min=ACT_EXP_MIN)
    q = (blocks * _pow2(15 - exponent)).round_().clamp_(-ACT_QMAX, ACT_QMAX).masked_fill_(~finite, 0)
    scale = _pow2(exponent - 15).masked_fill_(~finite, float("nan"))
    return q.to(torch.int16).flatten(-2), scale.squeeze(-1)


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x after the round trip through `quantize_activations`, in x's dtype (exact: a bfloat16 x
    comes back with at most its own 8 significant bits)."""
    q, scale = quantize_activations(x)
    k = x.shape[-1]
    values = q.unflatten(-1, (-1, ACT_BLOCK)).float() * scale.unsqueeze(-1)
    return values.flatten(-2)[..., :k].to(x.dtype)
