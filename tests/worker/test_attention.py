"""Attention without copies (`attention.grouped_attention`, `attention.allowed_keys`): grouped-query
attention by reshaping the queries, the K/V cache read in place, masks built on the device from
per-row padding.

Checked against the reference it replaced (K/V expanded to the query heads, a boolean mask from
`attention_mask`), and, with a dispatch mode that sees every aten operation, that nothing but
views, the cache write and the attention kernel itself touches the cache's memory: the keys and
values are never copied, expanded or gathered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shard_worker.model.attention import additive, allowed_keys, attention_mask, grouped_attention


def reference(q, keys, values, allowed):
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("c0,s", [(9, 1), (5, 4), (0, 6)])
@pytest.mark.parametrize("window", [None, 3])
def test_grouped_attention_is_the_expanded_reference(heads, kv_heads, c0, s, window):
    gen = torch.Generator().manual_seed(heads * 100 + c0 * 10 + s)
    n, d, max_len = 3, 16, 16
    pads = torch.tensor([0, 2, 7])
    c1 = c0 + s
    q = torch.randn(n, heads, s, d, generator=gen, dtype=torch.float64)
    cache_k = torch.randn(n, kv_heads, max_len, d, generator=gen, dtype=torch.float64)
    cache_v = torch.randn(n, kv_heads, max_len, d, generator=gen, dtype=torch.float64)
    keys, values = cache_k[:, :, :c1], cache_v[:, :, :c1]  # views of the cache, as KVCache.update gives
    allowed = attention_mask(pads, c0, c1, window)
    assert isinstance(allowed, torch.Tensor)
    got = grouped_attention(q, keys, values, additive(allowed, q.dtype))
    torch.testing.assert_close(got, reference(q, keys, values, allowed), rtol=1e-10, atol=1e-10)


def test_a_step_may_attend_over_more_columns_than_it_filled():
    """A captured decode step reads a fixed number of columns: those past its own are masked, so
    the result is the eager step's over exactly its columns (the unread tail is finite)."""
    gen = torch.Generator().manual_seed(5)
    n, heads, kv, d, col, length = 2, 4, 2, 8, 6, 12
    pads = torch.tensor([0, 4])
    q = torch.randn(n, heads, 1, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, kv, length, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, kv, length, d, generator=gen, dtype=torch.float64)
    long = grouped_attention(q, k, v, additive(allowed_keys(pads, torch.tensor([col]), 1, length, None), q.dtype))
    short = grouped_attention(q, k[:, :, :col + 1], v[:, :, :col + 1],
                              additive(allowed_keys(pads, col, 1, col + 1, None), q.dtype))
    torch.testing.assert_close(long, short, rtol=1e-12, atol=1e-12)


# Operations that may take the cache's memory as an input: views, the write of the step's own
# keys and values (and the zeroing of the rest of its block: paged.tail_slots), and the fused
# attention kernels (which read K/V in place; SDPA's math fallback, which would broadcast them into
# copies, is not among them).
IN_PLACE = {"scaled_dot_product_attention:fused",
            "view", "_unsafe_view", "slice", "select", "as_strided", "alias", "detach", "transpose", "unsqueeze",
            "expand", "index_copy_", "index_fill_", "copy_", "zero_", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_efficient_attention_forward", "_flash_attention_forward"}


class CacheReads(TorchDispatchMode):
    """Records the aten operations that read the storage of `watched` tensors (and of their
    views), and every tensor they produce, so a test sees whether the K/V were ever copied."""

    def __init__(self, *watched: torch.Tensor):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.readers: list[str] = []
        self.gathered: list[torch.Tensor] = []  # what the index reads produced, as attention sees it

    def _aliases(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        flat = [x for a in flat for x in (a if isinstance(a, (list, tuple)) else (a,))]
        out = func(*args, **kwargs)
        if any(self._aliases(a) for a in flat):
            name = func.overloadpacket.__name__
            if name == "scaled_dot_product_attention":  # not decomposed here: which kernel it runs
                math = torch._fused_sdp_choice(*args, **kwargs) == torch.nn.attention.SDPBackend.MATH
                name += ":math" if math else ":fused"
            self.readers.append(name)
            if name == "index":
                self.gathered.append(out.transpose(0, 1))  # [kv_heads, rows, columns, head_dim] as update returns it
            outs = out if isinstance(out, (list, tuple)) else (out,)
            for o in outs:  # a view stays watched: what reads it reads the cache
                if isinstance(o, torch.Tensor) and func.overloadpacket.__name__ in IN_PLACE - {"copy_", "index_copy_"}:
                    self.storages.add(o.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "later-chunk"])
def test_the_model_attention_reads_the_cache_once_by_its_slots(checkpoint, decode):
    """A padded decode step and a prefill chunk after the first, through a real layer with 2 query
    heads per KV head, on torch's path: the paged pool is read once per layer for K and once for V,
    by the slots of the rows' block tables (an index: torch has no paged read in place; the CPU
    decode kernel reads the pool in place, test_paging.py), into [rows, kv_heads, columns,
    head_dim], never expanded to the query heads; every other operation that touches the pool is
    a view or the write of the step's own keys and values."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.kernels import torch_only
    from shard_worker.model.loader import load_stage
    from shard_worker.model.model import Stage
    from shard_worker.model.slices import Layout
    from shard_worker.model.step import KVCache, Rotary, Step
    from shard_worker.telemetry.accounting import Accounting

    model_dir = checkpoint("llama")  # 4 heads, 2 KV heads
    config, cpu = ModelConfig.from_dir(model_dir), torch.device("cpu")
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), Accounting()), torch.float32, cpu)
    load_stage(stage, model_dir)
    pads, max_len = torch.tensor([0, 3]), 16
    cache = KVCache(config.num_layers, 2, layout.kv_heads, max_len, config.head_dim, torch.float32, cpu)
    rotary = Rotary(config, max_len, cpu)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), torch_only():
        stage.forward(ids[:, :5], Step.build(0, 2, 0, 5, pads, rotary, stage.windows, torch.float32, cpu), cache)
        c0, c1 = (5, 6) if decode else (5, 8)
        step = Step.build(0, 2, c0, c1, pads, rotary, stage.windows, torch.float32, cpu)
        assert isinstance(step.masks[None], torch.Tensor)  # padded: the masked path
        with CacheReads(cache.k, cache.v) as reads:
            stage.forward(ids[:, c0:c1], step, cache)
    assert set(reads.readers) <= IN_PLACE | {"index"}, f"the cache was read by {sorted(set(reads.readers) - IN_PLACE)}"
    assert reads.readers.count("index") == 2 * config.num_layers, reads.readers
    assert [tuple(t.shape) for t in reads.gathered] == [(2, layout.kv_heads, c1, config.head_dim)] * (
        2 * config.num_layers)
