"""A step's decoder layers, one C call each (`_gemv.decode_layer`).

The Python layers (`decoder.DecoderLayer`) call our kernels one by one: RMSNorm, the q/k/v product,
attention, the o product, its all-reduce, ... Each call does microseconds of work behind tens of
microseconds of Python and torch dispatch: about half a millisecond a layer, a fifth of a bfloat16
TP=2 rank's decode step on our 2-core machines (`perf`: libpython and libtorch 20% of its time).
Here a layer's fixed part -- its weights, norms, KV cache and the TP group's shared memory -- is
packed once into a plan (`LayerPlan`, the ctypes mirror of the C struct in csrc/layer.h), and each
step runs a layer in one call with the GIL released. The C layer calls the same kernels in the
same order with the same roundings as the Python layer, so both give the same bits
(tests/worker/test_fused.py).

It takes CPU steps of up to `kernels.MAX_TOKENS` tokens through resident layers in float32 or
bfloat16 (int8 weights too), at TP = 1 or with TP ranks that sum through shared memory: a decode
step's rows (one token each), a prompt chunk's tokens (a step built `per_token`: each token at its
own position, attending causally over its sequence's cache up to it; every token's K/V is written
before any attends), or both in one pass (`ready_parts`, `Stage.forward_parts`: the engine's
chunks of prompts that end later ride with the step's decode rows, `Runner.defer`). One pass reads
each weight from memory once for all its tokens: the products take them in groups of 8 rows (each
part's own, so each gets the bits its own call gives) while a block of the weight's rows is in L2,
and a chunk's tokens attend as one span (each cached column made float32 once for all of them).
What that bought (docs/benchmarks.md, "The step budget"; quiet runs of 2026-12-06, 21:16-21:26
UTC, load 1.2-1.9 on the 2-core machine): a step of 8 decodes with an 8-token chunk 2.1-2.3x one
without (was 3.05x; the goal, 2x, is not met: the chunk's products are compute, ~half a decode step
here), and a decode step of 63 rows 51.5 ms (84-128 ms in Python). Prefill (the first batch's, and
chunks past MAX_TOKENS), GPUs, streamed (offloaded) layers, TP over gloo and `SHARD_KERNEL=torch`
keep the Python layers, and `SHARD_FUSED_LAYERS=0` turns this off.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shard_contract.env import FUSED_LAYERS_ENV

from ..comm import shm
from ..comm.dist import Comm
from ..telemetry.accounting import Accounting
from . import kernels

ENV = FUSED_LAYERS_ENV


_I, _F, _P = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class LayerPlan(ctypes.Structure):
    """A decoder layer's fixed part as the C layer reads it: csrc/layer.h's LayerPlan, field for
    field (every field 8 bytes: no padding to disagree on; the C side checks the size)."""

    _fields_ = [("xtype", _I), ("wtype", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("eps", _F), ("in_norm", _P), ("post_norm", _P),
                *((f"{name}{part}", kind) for name in ("qkv", "o", "gate_up", "down")
                  for part, kind in (("_w", _P), ("_ldw", _I), ("_scale", _P), ("_bias", _P))),
                ("k_cache", _P), ("v_cache", _P), ("cache_rows", _I), ("cache_row", _I), ("cache_head", _I),
                ("cache_len", _I), ("shm_slots", _P), ("shm_slot_bytes", _I), ("shm_flags", _P),
                ("shm_flag_stride", _I), ("shm_size", _I), ("shm_rank", _I), ("shm_timeout", _F)]


class StepTables(Protocol):
    """What the fused layers read of a forward pass's context (`step.Step`)."""

    r0: int
    c0: int
    cos: torch.Tensor
    sin: torch.Tensor
    firsts: dict[int | None, torch.Tensor] | None
    cols: torch.Tensor | None


class Pools(Protocol):
    """What the fused layers read of a KV cache (`step.KVCache`): its pools, and a step's slots."""

    k: torch.Tensor
    v: torch.Tensor

    def maps(self, step: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Tables:
    """A pass's tokens as the C layer reads them (`LayerStep` in csrc/layer.h): one part or several
    (a decode step's rows, then a chunk's tokens), one token a row of x. `reads` [rows, width]: each
    part's rows' read slots (padded with the ZERO block's first slot, never attended); `srow` each
    token's row of them; `ends` the matrix products' groups: each part's own (`split_groups`)."""

    tokens: int
    col: int
    cos: torch.Tensor
    sin: torch.Tensor
    firsts: dict[int | None, torch.Tensor]
    cols: torch.Tensor
    reads: torch.Tensor
    srow: torch.Tensor
    writes: torch.Tensor
    ends: torch.Tensor


def split_groups(tokens: int, at: int = 0) -> list[int]:
    """Where the groups of `tokens` rows end (from row `at`), as csrc/matmul.c's split_groups: a
    part's rows multiplied by MAX_ROWS, as its own call of `kernels.linear` would."""
    return [at + e for e in range(kernels.MAX_ROWS, tokens, kernels.MAX_ROWS)] + [at + tokens]


def tables(parts: list[tuple[int, int, StepTables, torch.Tensor, torch.Tensor]]) -> Tables:
    """The tables of a pass of `parts`: (rows, tokens a row, step, reads, writes) each."""
    width = max(reads.shape[1] for _, _, _, reads, _ in parts)
    reads_all, srow, cols, ends, cos, sin = [], [], [], [], [], []
    firsts: dict[int | None, list[torch.Tensor]] = {}
    row = token = 0
    for rows, s, step, reads, _ in parts:
        assert step.firsts is not None
        reads_all.append(torch.nn.functional.pad(reads.to(torch.int64), (0, width - reads.shape[1]), value=0))
        srow.append(torch.arange(row, row + rows, dtype=torch.int64).repeat_interleave(s))
        cols.append(step.cols.reshape(-1) if step.cols is not None
                    else torch.full((rows * s,), step.c0, dtype=torch.int64))
        ends += split_groups(rows * s, token)
        cos.append(step.cos.reshape(rows * s, -1))
        sin.append(step.sin.reshape(rows * s, -1))
        for w, f in step.firsts.items():
            firsts.setdefault(w, []).append(f.reshape(-1).to(torch.int64))
        row, token = row + rows, token + rows * s
    col = torch.cat(cols).to(torch.int64).contiguous()
    return Tables(token, int(col.max()), torch.cat(cos).contiguous(), torch.cat(sin).contiguous(),
                  {w: torch.cat(f).contiguous() for w, f in firsts.items()}, col, torch.cat(reads_all).contiguous(),
                  torch.cat(srow), torch.cat([w.reshape(-1).to(torch.int64) for *_, w in parts]).contiguous(),
                  torch.tensor(ends, dtype=torch.int64))


def problem(t: Tables, slots: int) -> str | None:
    """What is wrong with a pass's tables for a pool of `slots` KV slots, or None. The C layer checks
    each token's columns against `col` and the read width, but reads and writes a pool slot and a
    row of `reads` where the tables say: an engine bug there would read or write outside the pool,
    silently. Checked once a pass (not a layer), over the tables just built: O(their size)."""
    n = t.tokens
    rows, width = t.reads.shape
    if not (t.cols.numel() == t.srow.numel() == t.writes.numel() == t.cos.shape[0] == t.sin.shape[0] == n
            and all(f.numel() == n for f in t.firsts.values())):
        return (f"{n} tokens, but {t.cols.numel()} columns, {t.srow.numel()} rows of reads, {t.writes.numel()} "
                f"write slots, {t.cos.shape[0]} ropes, first columns {[f.numel() for f in t.firsts.values()]}")
    for name, table in (("read", t.reads), ("write", t.writes)):
        lo, hi = torch.aminmax(table)
        if lo < 0 or hi >= slots:
            return f"a {name} slot outside the pool of {slots} slots ({int(lo)} to {int(hi)})"
    lo, hi = torch.aminmax(t.srow)
    if lo < 0 or hi >= rows:
        return f"a token reads row {int(lo) if lo < 0 else int(hi)} of {rows} rows of read slots"
    lo, hi = torch.aminmax(t.cols)
    if lo < 0 or hi >= width or hi != t.col:
        return f"token columns {int(lo)} to {int(hi)} (the pass's column {t.col}) for reads {width} wide"
    for window, first in t.firsts.items():
        if bool(((first < 0) | (first > t.cols)).any()):
            return f"a first column (window {window}) below 0 or past its token's column"
    return None


if kernels._gemv is not None and ctypes.sizeof(LayerPlan) != kernels._gemv.LAYER_PLAN_SIZE:
    raise ImportError(f"fused.LayerPlan ({ctypes.sizeof(LayerPlan)} bytes) does not mirror the C LayerPlan "
                      f"({kernels._gemv.LAYER_PLAN_SIZE}): rebuild shard_worker._gemv")


class FusedDecode:
    """The fused layers of one stage: `ready` says whether a forward pass (or `ready_parts`: a
    pass of several parts) can use them, `run` takes one layer. Plans are built on first use, for
    the KV cache they were built with."""

    def __init__(self, comm: Comm | None):
        tp = comm.topo.tp if comm is not None else 1
        # the TP ranks' shared memory (None: TP = 1), and where its rounds are counted
        self._group = comm.shm if comm is not None and tp > 1 else None
        self._acct: Accounting | None = comm.acct if comm is not None else None
        level = kernels.LEVEL
        self.enabled = (level is not None and os.environ.get(ENV, "1") != "0"
                        and (tp == 1 or self._group is not None))
        self._level = kernels.LEVELS.index(level) if level is not None and self.enabled else -1
        self._plans: dict[int, tuple[bytes | None, tuple[object, ...]]] = {}  # slot -> (plan, what it points at)
        self._cache: Pools | None = None
        self._tables: Tables | None = None  # the pass `ready` prepared, as the C layer reads it

    def ready(self, x: torch.Tensor, step: StepTables, cache: Pools) -> bool:
        """Whether this forward pass's layers can run fused (then `run` takes the resident ones)."""
        return self.ready_parts([(x, step)], cache)

    def ready_parts(self, parts: list[tuple[torch.Tensor, StepTables]], cache: Pools) -> bool:
        """Whether a pass of `parts` (x [rows, tokens, hidden] and its step each: a decode step's
        rows, a chunk's tokens), concatenated one token a row, can run fused."""
        if kernels.in_torch_only() or not self.enabled:  # a step that must stay in torch (captured, compiled, tested)
            return False
        tokens = sum(x.shape[0] * x.shape[1] for x, _ in parts)
        if not 1 <= tokens <= kernels.MAX_TOKENS or cache.k.dtype not in kernels._XTYPES:
            return False
        for x, step in parts:
            if not (step.firsts is not None and x.device.type == "cpu" and x.dtype == cache.k.dtype
                    and x.dim() == 3 and (x.shape[1] == 1 or step.cols is not None)):
                return False
        x0 = parts[0][0]
        if self._group is not None and tokens * x0.shape[-1] * x0.element_size() > shm.SLOT_BYTES:
            return False
        if cache is not self._cache:
            self._plans, self._cache = {}, cache
        maps = [cache.maps(step) for _, step in parts]
        if any(reads.device.type != "cpu" for reads, _ in maps):
            return False
        t = tables([(x.shape[0], x.shape[1], step, reads, writes)
                    for (x, step), (reads, writes) in zip(parts, maps, strict=True)])
        wrong = problem(t, cache.k.shape[-2])  # the pool [layers, kv_heads, slots, head_dim]
        if wrong is not None:
            raise ValueError(f"the fused layers' tables of this pass are wrong: {wrong}")
        self._tables = t
        return True

    def covers(self, layers: list[Any], dtype: torch.dtype) -> bool:
        """Whether every one of `layers` runs fused (after `ready`): a pass of several parts has
        no Python layer to fall back on for one of them."""
        cache = self._cache
        return cache is not None and all(self._plan(layer, slot, dtype, cache) is not None
                                         for slot, layer in enumerate(layers))

    def run(self, layer: Any, slot: int, x: torch.Tensor) -> torch.Tensor | None:
        """x [tokens, ..., hidden] (this pass's own copy, contiguous) through `layer` in place; None
        where the layer cannot run fused (the caller runs it in Python). Only after `ready`."""
        cache, t = self._cache, self._tables
        if cache is None or t is None:
            raise RuntimeError("FusedDecode.run before ready")
        plan = self._plan(layer, slot, x.dtype, cache)
        if plan is None:
            return None
        group = self._group
        rounds = group.round if group is not None else 0
        missed, seconds = kernels.native().decode_layer(
            plan, x.data_ptr(), t.tokens, t.col, t.cols.data_ptr(), t.firsts[layer.attn.window].data_ptr(),
            t.cos.data_ptr(), t.sin.data_ptr(), 0, t.reads.data_ptr(), t.reads.shape[1], t.srow.data_ptr(),
            t.writes.data_ptr(), t.ends.data_ptr(), t.ends.numel(), torch.get_num_threads(), self._level, rounds)
        if group is not None:
            group.round += 2
            if missed >= 0:
                raise TimeoutError(f"TP rank {missed} did not reach collective round {group.round} "
                                   f"within {group.timeout:.0f}s")
            if self._acct is not None:
                self._acct.communicated("all_reduce", 2 * x.numel() * x.element_size(), seconds)
        return x

    def _plan(self, layer: Any, slot: int, dtype: torch.dtype, cache: Pools) -> bytes | None:
        projections = (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)
        weights = tuple(p.weight for p in projections)
        known = self._plans.get(slot)
        if known is not None and all(a is b for a, b in zip(known[1], weights, strict=False)):
            return known[0]
        plan = None if layer.streamed else self._pack(layer, slot, projections, dtype, cache)
        self._plans[slot] = (plan, weights)
        return plan

    def _pack(self, layer: Any, slot: int, projections: tuple[Any, ...], dtype: torch.dtype,
              cache: Pools) -> bytes | None:
        wtypes = {p.weight.dtype for p in projections if isinstance(p.weight, torch.Tensor)}
        if len(wtypes) != 1 or not all(isinstance(p.weight, torch.Tensor) and p.weight.device.type == "cpu"
                                       and p.weight.stride(1) == 1 for p in projections):
            return None
        wtype = wtypes.pop()
        if wtype not in (dtype, torch.int8) or layer.input_norm.weight.dtype != dtype \
                or layer.input_norm.eps != layer.post_norm.eps:
            return None
        attn, group = layer.attn, self._group
        fields = {"xtype": kernels._XTYPES[dtype], "wtype": kernels._WTYPES[wtype], "hidden": attn.o.shape[0],
                  "heads": attn.heads, "kv_heads": attn.kv_heads, "head_dim": attn.head_dim,
                  "inter": layer.mlp.gate_up.shape[0] // 2, "eps": layer.input_norm.eps,
                  "in_norm": layer.input_norm.weight.data_ptr(),
                  "post_norm": layer.post_norm.weight.data_ptr()}
        for name, p in zip(("qkv", "o", "gate_up", "down"), projections, strict=False):
            fields.update({f"{name}_w": p.weight.data_ptr(), f"{name}_ldw": p.weight.stride(0),
                           f"{name}_scale": p.scale.data_ptr() if p.scale is not None else 0,
                           f"{name}_bias": p.bias.data_ptr() if p.bias is not None else 0})
        k, v = cache.k[slot], cache.v[slot]  # the layer's pool [kv_heads, slots, head_dim], read through the slots
        if k.stride() != v.stride() or k.stride()[1:] != (attn.head_dim, 1):
            return None
        fields.update({"k_cache": k.data_ptr(), "v_cache": v.data_ptr(), "cache_rows": k.shape[1],
                       "cache_row": k.stride(1), "cache_head": k.stride(0), "cache_len": 0})
        if group is not None:
            fields.update({"shm_slots": group.slots.data_ptr(), "shm_flags": group.flags.data_ptr(),
                           "shm_size": group.size, "shm_rank": group.rank, "shm_timeout": group.timeout})
        else:
            fields.update({"shm_slots": 0, "shm_flags": 0, "shm_size": 1, "shm_rank": 0, "shm_timeout": 0.0})
        fields.update({"shm_slot_bytes": shm.SLOT_BYTES, "shm_flag_stride": shm.FLAG_STRIDE})
        plan = bytes(LayerPlan(**fields))
        return None if kernels.native().layer_problem(plan) is not None else plan
