"""Attention that reads the paged KV cache in place (`shard_worker.model.paged`): FlexAttention over
the rows' block tables, the torch path's (a CUDA rank's, and a CPU rank's in a compiled step).

Checked against the gather it replaces (each row's context indexed out of the pool by its read
map, `paging.slot_maps`, then SDPA under `attention.allowed_keys`): shuffled block tables, blocks
shared by two rows (the prefix cache), left padding, padding queries, sliding windows, grouped
queries, decode steps and later chunks. Most cases run flex_attention's reference path (no
compile: it scores every row against the whole pool, so it proves the mask, quickly); the
compiled kernel, the one that reads in place, is checked once a kind, with NaN everywhere the
rows do not read: it skips the blocks the mask does not list. Through a model, the torch path
with the pool read in place gives the gather path's logits (float32 tight, bfloat16 loose), in
a compiled decode step too; the engine matches HF with it (test_decode_graphs.py, the slow ones).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from shard_contract.env import PAGED_ATTENTION_ENV
from shard_worker.model import paged, recompiles
from shard_worker.model.attention import additive, allowed_keys, grouped_attention
from shard_worker.model.paging import BLOCK_SIZE, TRASH_BLOCK, slot_maps

POOL = 24  # blocks (the reserved two included)


@pytest.fixture
def reference_kernel(monkeypatch):
    """flex_attention uncompiled: its reference path, the same mask and semantics, no compile."""
    monkeypatch.setitem(paged._compiled, "cpu", flex_attention)


def case(seed: int, rows: int, heads: int, kv_heads: int, dtype=torch.float32, dim: int = 8):
    """A pool of random keys and values, and shuffled tables whose first two blocks rows 0 and 1
    share (a cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, POOL * BLOCK_SIZE, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, POOL * BLOCK_SIZE, dim, generator=gen).to(dtype)
    order = (torch.randperm(POOL - 2, generator=gen) + 2).tolist()
    shared, rest = order[:2], order[2:]
    tables = torch.full((rows, 5), TRASH_BLOCK, dtype=torch.int64)
    for r in range(rows):
        blocks = (shared if r < 2 else []) + [rest.pop() for _ in range(2 if r < 2 else 4)]
        tables[r, :len(blocks)] = torch.tensor(blocks)
    return k, v, tables, gen


def gathered(q, k, v, tables, pads, c0, c1, window):
    """What the torch path computed before: each row's columns gathered, then masked SDPA."""
    reads, _ = slot_maps(tables, pads, torch.zeros_like(pads), c0, c1)
    keys, values = k[:, reads].transpose(0, 1), v[:, reads].transpose(0, 1)
    mask = additive(allowed_keys(pads, c0, c1 - c0, c1, window), q.dtype)
    return grouped_attention(q, keys, values, mask)


def paged_out(q, k, v, tables, pads, c0, c1, window):
    positions = torch.arange(c0, c1).expand(len(pads), c1 - c0) - pads.unsqueeze(1)
    lo, hi = paged.bounds(positions, window)
    return paged.attend(q, k, v, paged.paged_mask(tables, lo, hi, POOL))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("c0,c1", [(40, 41), (9, 10), (30, 37), (16, 33)])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_in_place_is_the_gather(reference_kernel, heads, kv_heads, c0, c1, window):
    """Rows left-padded by 0, 3 and 7 columns (row 2's first queries of a later chunk at 9 are
    padding: they read nothing, and their outputs are unused, so only real queries compare)."""
    pads = torch.tensor([0, 3, 7])
    k, v, tables, gen = case(heads + c0 + (window or 0), 3, heads, kv_heads)
    q = torch.randn(3, heads, c1 - c0, 8, generator=gen)
    got = paged_out(q, k, v, tables, pads, c0, c1, window)
    want = gathered(q, k, v, tables, pads, c0, c1, window)
    real = (torch.arange(c0, c1).unsqueeze(0) >= pads.unsqueeze(1)).view(3, 1, -1, 1).expand_as(got)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert torch.all(got[~real] == 0)  # a padding query reads nothing


def test_a_torch_that_cannot_skip_the_q_blocks_gives_the_same_mask(reference_kernel, monkeypatch):
    """Where BlockMask.from_kv_blocks has no compute_q_blocks (older torch), the mask computes
    them, and reads what it reads here."""
    assert paged.SKIP_Q_BLOCKS == {"compute_q_blocks": False}  # this torch skips them
    pads = torch.tensor([0, 3, 7])
    k, v, tables, gen = case(5, 3, 4, 2)
    q = torch.randn(3, 4, 7, 8, generator=gen)
    want = paged_out(q, k, v, tables, pads, 30, 37, 5)
    monkeypatch.setattr(paged, "SKIP_Q_BLOCKS", {})
    positions = torch.arange(30, 37).expand(3, 7) - pads.unsqueeze(1)
    mask = paged.paged_mask(tables, *paged.bounds(positions, 5), POOL)
    assert mask.q_num_blocks is not None
    torch.testing.assert_close(paged.attend(q, k, v, mask), want, rtol=0, atol=0)


def test_bounds_and_tails():
    lo, hi = paged.bounds(torch.tensor([[-1, 0, 7]]), 3)
    assert lo.tolist() == [[0, 0, 5]] and hi.tolist() == [[-1, 0, 7]]
    lo, hi = paged.bounds(torch.tensor([[2, 5]]), None, floor=torch.tensor([4]))  # columns, padding past
    assert lo.tolist() == [[4, 4]] and hi.tolist() == [[-1, 5]]
    tails = paged.tail_slots(torch.tensor([[16 * 5 + 13], [16 * 3 + 15], [16 * 7]]))
    trash = TRASH_BLOCK * BLOCK_SIZE
    assert tails[0].tolist() == [16 * 5 + 14, 16 * 5 + 15] + [trash] * 13
    assert tails[1].tolist() == [trash] * 15
    assert tails[2].tolist() == list(range(16 * 7 + 1, 16 * 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernel_reads_only_the_rows_blocks(dtype):
    """inductor's kernel (the C++ template here, Triton on CUDA: the same mask) with every slot no
    row reads set to NaN, the last blocks' tails included: a kernel that read a block the mask
    does not list, or a key past a row's own, would answer NaN. A decode step and a later chunk."""
    torch._dynamo.reset()
    heads, kv_heads = 8, 2
    pads = torch.tensor([0, 3, 7])
    for c0, c1 in ((40, 41), (30, 37)):
        k, v, tables, gen = case(7, 3, heads, kv_heads, dtype, dim=16)
        q = torch.randn(3, heads, c1 - c0, 16, generator=gen).to(dtype)
        want = gathered(q.float(), k.float(), v.float(), tables, pads, c0, c1, None)
        reads, _ = slot_maps(tables, pads, torch.zeros_like(pads), 0, c1)
        read = torch.zeros(k.shape[1], dtype=torch.bool)
        read[reads[reads >= 2 * BLOCK_SIZE]] = True
        k[:, ~read], v[:, ~read] = float("nan"), float("nan")
        tails = paged.tail_slots(reads[:, -1:]).reshape(-1)  # what the rows' writes zeroed
        k[:, tails], v[:, tails] = 0.0, 0.0
        got = paged_out(q, k, v, tables, pads, c0, c1, None)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_cuda_kernel_tiles_divide_the_masks_blocks(monkeypatch):
    """On CUDA the Triton template's key tile must divide the mask's 16-position KV blocks and its
    query tile the 128-query blocks, or inductor refuses the lowering: the tile `kernel_options`
    asks for, over every default forward config inductor has for an Ampere or Hopper card (its
    tables read with the card's capability stubbed; without the options, BLOCK_N is 32-128)."""
    options = paged.kernel_options(torch.device("cuda"))
    assert options is not None and options["FORCE_USE_FLEX_ATTENTION"] is True
    assert BLOCK_SIZE % options["BLOCK_N"] == 0 and options["BLOCK_N"] >= 16  # tl.dot takes 16 at least
    assert paged.kernel_options(torch.device("cpu")) is None and paged.kernel_options(torch.device("meta")) is None
    heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    tiles = set()
    for capability in ((8, 0), (9, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_, c=capability: c)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for head_dim in (16, 64, 128, 256):
                for conf in heuristics.CUDAConfigHeuristic().get_flex_attn_fwd_configs(head_dim, dtype):
                    tiles.add((options.get("BLOCK_M", conf.block_m), options.get("BLOCK_N", conf.block_n)))
    assert tiles and all(paged.Q_BLOCK % m == 0 and BLOCK_SIZE % n == 0 for m, n in tiles), tiles


def test_a_gpu_ranks_kernel_may_take_more_variants_than_dynamos_default(monkeypatch):
    """Past dynamo's recompile limit a fullgraph=True kernel raises: a CUDA rank's (built here,
    not run) raises the limit; a CPU rank's leaves it."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.delitem(paged._compiled, "cpu", raising=False)
    monkeypatch.delitem(paged._compiled, "cuda", raising=False)
    # config.patch, not monkeypatch: monkeypatch's undo deletes an attribute it found outside the
    # module's __dict__, and dynamo's config lives there
    before = dynamo_config.recompile_limit
    with dynamo_config.patch(recompile_limit=8):
        paged._kernel(torch.device("cpu"))
        assert dynamo_config.recompile_limit == 8
        paged._kernel(torch.device("cuda"))
        assert dynamo_config.recompile_limit >= recompiles.LIMIT
    assert dynamo_config.recompile_limit == before


def test_the_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(PAGED_ATTENTION_ENV, raising=False)
    monkeypatch.setattr(paged.kernels, "LEVEL", "avx2")
    assert not paged.in_place(cpu) and paged.in_place(torch.device("cuda"))
    monkeypatch.setattr(paged.kernels, "LEVEL", None)  # no C kernels: torch's path reads in place
    assert paged.in_place(cpu)
    monkeypatch.setenv(PAGED_ATTENTION_ENV, "flex")
    assert paged.in_place(cpu)
    monkeypatch.setenv(PAGED_ATTENTION_ENV, "gather")
    assert not paged.in_place(torch.device("cuda"))
    monkeypatch.setenv(PAGED_ATTENTION_ENV, "always")
    with pytest.raises(ValueError, match=PAGED_ATTENTION_ENV):
        paged.in_place(cpu)


# ---------------------------------------------------------------- through the model
def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows left-padded by 0, 3 and 1; row 1's first 16 positions are row 0's (its first
    block is row 0's, from the prefix cache: it computes from position 16 on)."""
    ids = torch.randint(0, vocab, (3, 40), generator=torch.Generator().manual_seed(3))
    pads = torch.tensor([0, 3, 1])
    ids[1, 3:19] = ids[0, :16]
    return ids, pads, torch.tensor([0, 16, 0])


def passes(stage, ids, pads, starts, tables, mode, monkeypatch) -> list[torch.Tensor]:
    """Prefill [0, 20), a later chunk [20, 27), decode steps 27..31 with the torch path reading the
    pool by `mode`: each pass's last-column logits."""
    from shard_worker.model.kernels import torch_only
    from shard_worker.model.step import KVCache, Rotary, Step

    monkeypatch.setenv(PAGED_ATTENTION_ENV, mode)
    c = stage.config
    cache = KVCache(c.num_layers, 3, stage.layout.kv_heads, 48, c.head_dim, stage.dtype, stage.device, tokens=POOL * 16)
    rotary = Rotary(c, 48, stage.device)
    out = []
    spans = [(0, 20), (20, 27)] + [(col, col + 1) for col in range(27, 32)]
    with torch.inference_mode(), torch_only():
        for c0, c1 in spans:
            step = Step.build(0, 3, c0, c1, pads, rotary, stage.windows, stage.dtype, stage.device, tables=tables,
                              starts=starts)
            out.append(stage.logits(stage.forward(ids[:, c0:c1], step, cache)[:, -1]).float())
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "llama-mqa"])
def test_the_model_reads_in_place_what_it_gathered(checkpoint, monkeypatch, reference_kernel, family):
    """A stage on torch's path with shuffled block tables, a shared prefix block, a later chunk
    and decode steps: in float32 the same logits reading the pool in place as gathering it; in
    bfloat16 as near the float32 logits as the gather's are (flex accumulates in float32)."""
    from .test_decode_graphs import load

    _, _, tables, _ = case(11, 3, 1, 1)
    tables[1, 0] = tables[0, 0]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        stage = load(checkpoint(family), dtype=dtype)
        ids, pads, starts = prompts(stage.config.vocab_size)
        runs[dtype] = {mode: passes(stage, ids, pads, starts, tables, mode, monkeypatch) for mode in ("gather", "flex")}
    exact = runs[torch.float32]["gather"]
    for got, want in zip(runs[torch.float32]["flex"], exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for flex, gather, want in zip(runs[torch.bfloat16]["flex"], runs[torch.bfloat16]["gather"], exact, strict=True):
        assert (flex - want).abs().max() <= 2 * (gather - want).abs().max() + 1e-2


def test_the_captured_step_in_place_does_no_host_synchronisation(checkpoint, monkeypatch):
    """A replayed decode step reading the pool in place: its block masks (built eagerly at each
    step, inside a CUDA graph's capture) and everything around the kernel read no host value and
    build no host tensor, on the CPU and on the meta device; the kernel itself (compiled on its own:
    a Triton launch on CUDA) stands in as a stub that checks what it is given: the pool itself, a
    view, never a copy."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.engine.graphs import decode_forward
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.model import Stage
    from shard_worker.model.slices import Layout
    from shard_worker.model.step import KVCache, Rotary
    from shard_worker.telemetry.accounting import Accounting

    from .test_decode_graphs import NoHostSync

    monkeypatch.setenv(PAGED_ATTENTION_ENV, "flex")
    for device in ("cpu", "meta"):
        calls = []

        def kernel(q, k, v, block_mask, enable_gqa, kernel_options):
            calls.append(k.untyped_storage().data_ptr() == pools[0].untyped_storage().data_ptr())
            assert kernel_options is None  # a CUDA rank's alone (`paged.kernel_options`)
            return torch.zeros_like(q)

        monkeypatch.setitem(paged._compiled, device, kernel)
        config = ModelConfig.from_dir(checkpoint("mistral"))
        layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
        dev = torch.device(device)
        stage = Stage(layout, Comm(Topology(0, 1, 1), Accounting()), torch.float32, dev)
        cache = KVCache(config.num_layers, 4, layout.kv_heads, 32, config.head_dim, torch.float32, dev)
        pools = [cache.k, cache.v]
        ids, column = torch.zeros(4, 1, dtype=torch.int64, device=dev), torch.full((1,), 20, device=dev)
        pads, tables = torch.tensor([0, 3, 1, 0], device=dev), cache.contiguous.to(dev)
        rotary = Rotary(config, 32, dev)
        with torch.inference_mode(), NoHostSync(device):
            logits = decode_forward(stage, cache, rotary, ids, column, pads, tables, 4, 32)
        assert logits.shape == (4, config.vocab_size)
        assert calls == [True] * config.num_layers
