"""Weight-only int8: symmetric, one float32 scale per output row (W ~ q * scale, q in [-127, 127]).

The loader quantizes each chunk of checkpoint rows as it reads it, with this one function; tests
quantize a whole model with it to build the reference the sharded model must match exactly.
"""

from __future__ import annotations

import torch


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
