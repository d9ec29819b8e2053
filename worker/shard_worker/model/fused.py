"""A decode step's decoder layers, one C call each (`_gemv.decode_layer`).

The Python layers (`decoder.DecoderLayer`) call our kernels one by one: RMSNorm, the q/k/v product,
attention, the o product, its all-reduce, ... Each call does microseconds of work behind tens of
microseconds of Python and torch dispatch: about half a millisecond a layer, a fifth of a bfloat16
TP=2 rank's decode step on our 2-core machines (`perf`: libpython and libtorch 20% of its time).
Here a layer's fixed part -- its weights, norms, KV cache and the TP group's shared memory -- is
packed once into a plan (`LayerPlan`, the ctypes mirror of the C struct in csrc/layer.h), and each
decode step runs a layer in one call with the GIL released. The C layer calls the same kernels in the
same order with the same roundings as the Python layer, so both give the same bits
(tests/worker/test_fused.py).

It takes CPU decode steps (1-8 rows of one token) through resident layers in float32 or bfloat16
(int8 weights too), at TP = 1 or with TP ranks that sum through shared memory. Prefill, GPUs,
streamed (offloaded) layers, TP over gloo and `SHARD_KERNEL=torch` keep the Python layers, and
`SHARD_FUSED_LAYERS=0` turns this off.
"""

from __future__ import annotations

import ctypes
import os
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


class Pools(Protocol):
    """What the fused layers read of a KV cache (`step.KVCache`): its pools, and a step's slots."""

    k: torch.Tensor
    v: torch.Tensor

    def maps(self, step: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


# A step's tables as the C layer reads them: cos, sin, first columns per window, read and write slots.
_Tables = tuple[torch.Tensor, torch.Tensor, dict[int | None, torch.Tensor], torch.Tensor, torch.Tensor]


if kernels._gemv is not None and ctypes.sizeof(LayerPlan) != kernels._gemv.LAYER_PLAN_SIZE:
    raise ImportError(f"fused.LayerPlan ({ctypes.sizeof(LayerPlan)} bytes) does not mirror the C LayerPlan "
                      f"({kernels._gemv.LAYER_PLAN_SIZE}): rebuild shard_worker._gemv")


class FusedDecode:
    """The fused layers of one stage: `ready` says whether a forward pass can use them, `run`
    takes one layer. Plans are built on first use, for the KV cache they were built with."""

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
        self._step: StepTables | None = None  # the step `ready` prepared, and its tables as the C layer reads them
        self._tables: _Tables | None = None

    def ready(self, x: torch.Tensor, step: StepTables, cache: Pools) -> bool:
        """Whether this forward pass's layers can run fused (then `run` takes the resident ones)."""
        if kernels.in_torch_only():  # a step that must stay in torch (captured, compiled, tested)
            return False
        firsts = step.firsts
        if not (self.enabled and firsts is not None and x.device.type == "cpu" and x.dtype in kernels._XTYPES
                and x.dim() == 3 and x.shape[1] == 1 and 1 <= x.shape[0] <= kernels.MAX_ROWS
                and cache.k.dtype == x.dtype):
            return False
        if self._group is not None and not self._group.fits(x):
            return False
        if cache is not self._cache:
            self._plans, self._cache = {}, cache
        self._step = step
        reads, writes = cache.maps(step)
        if reads.device.type != "cpu":
            return False
        self._tables = (step.cos.contiguous(), step.sin.contiguous(),
                        {w: f.to(torch.int64).contiguous() for w, f in firsts.items()},
                        reads.to(torch.int64).contiguous(), writes.to(torch.int64).contiguous())
        return True

    def run(self, layer: Any, slot: int, x: torch.Tensor) -> torch.Tensor | None:
        """x [n, 1, hidden] (this pass's own copy) through `layer` in place; None where the layer
        cannot run fused (the caller runs it in Python). Only after `ready` said yes."""
        step, cache, tables = self._step, self._cache, self._tables
        if step is None or cache is None or tables is None:
            raise RuntimeError("FusedDecode.run before ready")
        plan = self._plan(layer, slot, x.dtype, cache)
        if plan is None:
            return None
        cos, sin, firsts, reads, writes = tables
        group = self._group
        rounds = group.round if group is not None else 0
        missed, seconds = kernels.native().decode_layer(
            plan, x.data_ptr(), x.shape[0], step.c0, firsts[layer.attn.window].data_ptr(), cos.data_ptr(),
            sin.data_ptr(), step.r0, reads.data_ptr(), reads.shape[1], writes.data_ptr(), torch.get_num_threads(),
            self._level, rounds)
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
