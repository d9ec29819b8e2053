"""Which cache columns each query may attend to, and attention that reads K/V in place.

Rows are left-padded (row b's tokens start at column pads[b]); what a pass needs is decided on the
host (`mask_kind`), the mask itself built on the device from the per-row padding (`allowed_keys`),
so a captured decode step builds it from device tensors alone. Grouped-query attention reshapes
the queries instead of expanding the keys (`grouped_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CAUSAL = "causal"  # only causality masks: SDPA's is_causal (top-left aligned, so from column 0)


def allowed_keys(pads: torch.Tensor, c0: int | torch.Tensor, queries: int, keys: int,
                 window: int | None) -> torch.Tensor:
    """Which cache columns [0, keys) each query column [c0, c0 + queries) of each row may attend
    to: [N, 1, queries, keys], boolean, on `pads`' device, built there from the per-row padding
    `pads` [N] (row b's tokens start at column pads[b]) and the first query column `c0` (an int, or
    a 0-d device tensor: a captured decode step's column). A padding query attends to itself only,
    so it stays finite (its output is never used); no column past a query's own is allowed, so a
    step may attend over more columns than it has filled."""
    device = pads.device
    q = (torch.arange(queries, device=device) + c0).view(1, queries, 1)
    k = torch.arange(keys, device=device).view(1, 1, keys)
    allowed = (k <= q) & ((k >= pads.view(-1, 1, 1)) | (k == q))
    if window is not None:
        allowed &= (q - k) < window
    return allowed.unsqueeze(1)


def attention_mask(pads: torch.Tensor, c0: int, c1: int, window: int | None) -> torch.Tensor | str | None:
    """Which cache columns [0, c1) each query column [c0, c1) of each row may attend to.

    Rows are left-padded: row b's tokens start at column pads[b] (a host tensor: what is decided
    here needs no device). None when nothing is masked (a decode step without padding), CAUSAL
    when only causality is (a prefill from column 0 without padding): SDPA then takes no mask,
    which lets it run its flash or memory-efficient kernels. Otherwise `allowed_keys` on pads'
    device."""
    kind = mask_kind(pads, c0, c1, window)
    return allowed_keys(pads, c0, c1 - c0, c1, window) if kind == MASKED else kind


MASKED = "masked"


def mask_kind(pads: torch.Tensor, c0: int, c1: int, window: int | None) -> str | None:
    """What `attention_mask` gives, decided on the host: None, CAUSAL or MASKED (a tensor)."""
    windowed = window is not None and c1 > window
    if not windowed and not bool(pads.any()):
        if c1 - c0 == 1:
            return None
        if c0 == 0:
            return CAUSAL
    return MASKED


def first_columns(pads: torch.Tensor, col: int | torch.Tensor, window: int | None) -> torch.Tensor:
    """For a decode step (one query column, `col`), the first cache column each row attends to:
    what `attention_mask` allows it is the columns from there to `col` (from its first token, or
    only itself for a padding query; no further back than the window). `col` may be a tensor of
    query columns (a chunk's, [N, S], with pads [N, 1]): each one's first column, the same rule."""
    first = torch.where(pads <= col, pads, col)
    return first if window is None else torch.maximum(first, torch.as_tensor(col - window + 1))


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one (0 where allowed, -inf elsewhere) in `dtype`."""
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with `group` query heads per KV head, K/V read in place.

    q [N, heads, S, d]; keys, values [N, kv_heads, L, d] (views of the cache: never copied or
    expanded to the query heads); mask [N, 1, S, L] additive, in q's dtype, or None. Query head h
    uses KV head h // group (as HF's repeat_kv): the queries are reshaped to [N, kv_heads,
    group * S, d], one SDPA "batch" per KV head, and the mask repeated over the group (for a
    decode step, S = 1, broadcast instead). Returns [N, heads, S, d]."""
    n, heads, s, d = q.shape
    kv = keys.shape[1]
    group = heads // kv
    if group == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    qg = q.reshape(n, kv, group * s, d)
    if mask is not None and s > 1:
        mask = mask.unsqueeze(2).expand(n, 1, group, s, mask.shape[-1]).reshape(n, 1, group * s, mask.shape[-1])
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask).view(n, heads, s, d)
