"""The fused decode layers (`shard_worker.model.fused`: a decoder layer's decode step in one C call)
compute what the Python layers compute, bit for bit: the hidden states after every layer and the
keys and values written into the KV cache, for float32, bfloat16 and int8 weights, biases (Qwen2),
sliding windows (Mistral), left-padded rows, and with two threads. TP=2 (through shared memory) is
checked end to end by tests/worker/test_offload.py, whose streamed layers run in Python and whose
resident ones run fused, with logits that must be equal.

Mixed steps too: a prompt chunk's tokens (each at its own position, crossing a KV block) fused on
their own, and beside a decode step's rows in one pass (`Stage.forward_parts`), against the Python
layers running the chunk and then the decode step; and random mixed passes as a continuous batch
makes them (parked rows and rows past the column among the decoding ones, several chunks, after
prefixes), bit for bit. A pass whose tables point outside the KV pool (or past their own rows and
columns) raises before any C call (`fused.problem`).

And SwiGLU's product in C (`kernels.silu_mul`) against torch's F.silu(gate) * up."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from shard_worker.model import fused, kernels, paging
from tests.support.checkpoints import write_checkpoint

pytestmark = pytest.mark.skipif(kernels.LEVEL is None, reason="the decode kernels' extension is not built")

# hidden and intermediate sizes that are not multiples of a vector, a window shorter than the run
SHAPE = dict(hidden_size=72, intermediate_size=100, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=128)
FAMILIES = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 5}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    family = request.param
    return write_checkpoint(tmp_path_factory.mktemp(family), family, seed=3, **SHAPE, **FAMILIES[family])


def _run(model_dir, dtype: torch.dtype, quantization: str, use_fused: bool, pads: list[int], steps: int = 6,
         units: list[tuple[int, int]] | None = None):
    """Prefill of the rows (left-padded by `pads`), then `steps` decode steps: the hidden states of
    every step, the KV cache, and how many layer steps ran fused."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.loader import load_stage
    from shard_worker.model.model import Stage
    from shard_worker.model.slices import Layout
    from shard_worker.model.step import KVCache, Rotary, Step
    from shard_worker.telemetry.accounting import Accounting

    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    cpu = torch.device("cpu")
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), Accounting()), dtype, cpu, quantization=quantization)
    load_stage(stage, model_dir)
    stage.fused.enabled = use_fused
    ran = 0
    real_run = stage.fused.run

    def counted(*args):
        nonlocal ran
        out = real_run(*args)
        ran += out is not None
        return out

    stage.fused.run = counted
    rows, prompt = len(pads), 7
    cache = KVCache(config.num_layers, rows, layout.kv_heads, prompt + steps, config.head_dim, dtype, cpu)
    rotary, pads_t = Rotary(config, prompt + steps, cpu), torch.tensor(pads)
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, SHAPE["vocab_size"], (rows, prompt), generator=generator)
    outs = [stage.forward(ids, Step.build(0, rows, 0, prompt, pads_t, rotary, stage.windows, dtype, cpu), cache)]
    for col in range(prompt, prompt + steps):
        ids = torch.randint(0, SHAPE["vocab_size"], (rows, 1), generator=generator)
        for r0, r1 in units or [(0, rows)]:  # rows in units, as pipeline stages take them
            step = Step.build(r0, r1, col, col + 1, pads_t, rotary, stage.windows, dtype, cpu)
            outs.append(stage.forward(ids[r0:r1], step, cache))
    return outs, cache, ran


def _stage(model_dir, dtype: torch.dtype, quantization: str, use_fused: bool):
    """A whole-model stage (TP=1) whose fused layer calls are counted (`stage.ran`)."""
    from shard_worker.comm.dist import Comm, Topology
    from shard_worker.model.config import ModelConfig
    from shard_worker.model.loader import load_stage
    from shard_worker.model.model import Stage
    from shard_worker.model.slices import Layout
    from shard_worker.telemetry.accounting import Accounting

    config = ModelConfig.from_dir(model_dir)
    layout = Layout(config, tp=1, tp_rank=0, layers=(0, config.num_layers), embeds=True, has_lm_head=True)
    stage = Stage(layout, Comm(Topology(rank=0, tp=1, pp=1), Accounting()), dtype, torch.device("cpu"),
                  quantization=quantization)
    load_stage(stage, model_dir)
    stage.fused.enabled = use_fused
    stage.ran = 0
    real_run = stage.fused.run

    def counted(*args):
        out = real_run(*args)
        stage.ran += out is not None
        return out

    stage.fused.run = counted
    return stage, config, layout


# a joiner's prompt in row 2, by chunks (the second crosses KV block 0 -> 1, 9 tokens: a group of the
# matrix products of one row) while rows 0 and 1 (left-padded) decode
CHUNKS = [(0, 10), (10, 19), (19, 27), (27, 29)]


def _mixed(model_dir, dtype: torch.dtype, quantization: str, use_fused: bool, together: bool, per_token: bool = True):
    """Rows 0-1 prefilled, then at each step a chunk of row 2's prompt (by position) and a decode
    step of rows 0-1: in one pass (`together`: `forward_parts`), else the chunk then the decode
    step. The hidden states of every pass, the KV cache and the fused layer calls. Without
    `per_token`, the chunks' steps are what torch's attention takes (the gathered context)."""
    from shard_worker.model.step import KVCache, Rotary, Step

    stage, config, layout = _stage(model_dir, dtype, quantization, use_fused)
    cpu, prompt = torch.device("cpu"), 7
    cache = KVCache(config.num_layers, 3, layout.kv_heads, 48, config.head_dim, dtype, cpu)
    rotary, pads, parked = Rotary(config, 48, cpu), torch.tensor([0, 3, 0]), torch.zeros(3, dtype=torch.int64)
    tables, starts = cache.contiguous, torch.zeros(3, dtype=torch.int64)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, prompt), generator=generator)
    joiner = torch.randint(0, SHAPE["vocab_size"], (1, CHUNKS[-1][1]), generator=generator)

    def step(r0, r1, c0, c1, rows_pads, per_token=False):
        return Step.build(r0, r1, c0, c1, rows_pads, rotary, stage.windows, dtype, cpu, tables=tables, starts=starts,
                          per_token=per_token)

    outs = [stage.forward(ids, step(0, 2, 0, prompt, pads), cache)]
    for i, (a, b) in enumerate(CHUNKS):
        col = prompt + i
        chunk = (joiner[:, a:b], step(2, 3, a, b, parked, per_token=per_token))
        decode = (torch.randint(0, SHAPE["vocab_size"], (2, 1), generator=generator), step(0, 2, col, col + 1, pads))
        if together:
            outs += stage.forward_parts([chunk, decode], cache)
        else:
            outs += [stage.forward(*chunk, cache), stage.forward(*decode, cache)]
    return outs, cache, stage.ran


@pytest.mark.parametrize("dtype,quantization", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                                (torch.bfloat16, "int8")])
def test_a_chunk_beside_decode_rows_fused_in_one_pass_computes_what_python_layers_do(model, dtype, quantization):
    python, python_cache, none = _mixed(model, dtype, quantization, False, together=False)
    ours, our_cache, ran = _mixed(model, dtype, quantization, True, together=True)
    alone, alone_cache, ran_alone = _mixed(model, dtype, quantization, True, together=False)
    layers = SHAPE["num_layers"]
    assert none == 0 and ran == len(CHUNKS) * layers and ran_alone == 2 * len(CHUNKS) * layers
    for i, (a, b, c) in enumerate(zip(python, ours, alone, strict=True)):
        assert torch.equal(a, b), f"pass {i}: hidden states differ (max {(a.float() - b.float()).abs().max()})"
        assert torch.equal(a, c), f"pass {i}: a chunk fused alone differs"
    for cache in (our_cache, alone_cache):
        assert torch.equal(python_cache.k, cache.k) and torch.equal(python_cache.v, cache.v)


def test_a_chunk_with_two_threads_computes_the_same(model):
    before = torch.get_num_threads()
    python, _, _ = _mixed(model, torch.bfloat16, "none", False, together=False)
    torch.set_num_threads(2)
    try:
        ours, _, ran = _mixed(model, torch.bfloat16, "none", True, together=True)
    finally:
        torch.set_num_threads(before)
    assert ran > 0 and all(torch.equal(a, b) for a, b in zip(python, ours, strict=True))


def test_a_pass_of_parts_without_fused_layers_runs_each_part_through_forward(model):
    python, _, _ = _mixed(model, torch.float32, "none", False, together=True)  # fused off: parts one by one
    reference, _, _ = _mixed(model, torch.float32, "none", False, together=False)
    assert all(torch.equal(a, b) for a, b in zip(python, reference, strict=True))


def test_a_chunks_attention_in_c_is_torchs_within_rounding(model):
    """The chunk's tokens attend causally over their cache up to their own positions, the keys of the
    chunk's earlier tokens included: what torch's attention over the gathered context gives."""
    ours, our_cache, _ = _mixed(model, torch.float32, "none", True, together=True)
    torchs, torch_cache, _ = _mixed(model, torch.float32, "none", False, together=False, per_token=False)
    for i, (a, b) in enumerate(zip(ours, torchs, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"pass {i}")
    torch.testing.assert_close(our_cache.k, torch_cache.k, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,quantization", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                                (torch.bfloat16, "int8"), (torch.float32, "int8")])
def test_fused_layers_compute_what_python_layers_do(model, dtype, quantization):
    pads = [0, 3, 1]
    python, python_cache, none = _run(model, dtype, quantization, False, pads)
    ours, our_cache, ran = _run(model, dtype, quantization, True, pads)
    assert none == 0 and ran == 6 * SHAPE["num_layers"]  # every decode step's every layer, fused
    for step, (a, b) in enumerate(zip(python, ours, strict=True)):
        assert torch.equal(a, b), f"step {step}: hidden states differ (max {(a.float() - b.float()).abs().max()})"
    assert torch.equal(python_cache.k, our_cache.k) and torch.equal(python_cache.v, our_cache.v)


def test_fused_layers_take_rows_from_any_row_of_the_cache(model):
    units = [(0, 1), (1, 3)]  # the second unit's rows start at row 1 of the KV cache
    python, python_cache, _ = _run(model, torch.bfloat16, "none", False, [2, 0, 1], units=units)
    ours, our_cache, ran = _run(model, torch.bfloat16, "none", True, [2, 0, 1], units=units)
    assert ran == 2 * 6 * SHAPE["num_layers"]
    assert all(torch.equal(a, b) for a, b in zip(python, ours, strict=True))
    assert torch.equal(python_cache.k, our_cache.k) and torch.equal(python_cache.v, our_cache.v)


def test_fused_layers_with_two_threads_compute_the_same(model):
    before = torch.get_num_threads()
    python, _, _ = _run(model, torch.bfloat16, "none", False, [0, 2])
    torch.set_num_threads(2)
    try:
        ours, _, ran = _run(model, torch.bfloat16, "none", True, [0, 2])
    finally:
        torch.set_num_threads(before)
    assert ran > 0 and all(torch.equal(a, b) for a, b in zip(python, ours, strict=True))


def test_a_layer_plan_with_a_wrong_size_or_bad_shapes_is_refused():
    assert ctypes.sizeof(fused.LayerPlan) == kernels._gemv.LAYER_PLAN_SIZE  # the mirror of csrc/layer.h
    with pytest.raises(ValueError, match="not the size of a LayerPlan"):
        kernels._gemv.layer_problem(b"\0" * 8)
    assert kernels._gemv.layer_problem(bytes(fused.LayerPlan())) is not None  # no weights: a problem, said
    assert "SHARD_FUSED_LAYERS" in fused.__doc__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 13), (2, 2816)])
def test_silu_mul_is_torchs_within_rounding(dtype, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0]).to(dtype)  # zeros and both tails
    ours = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    theirs = F.silu(gate) * up
    assert ours.shape == theirs.shape and ours.dtype == dtype
    # e^-|g| within 2 ulp of float32: one rounding of bfloat16 at most, float32's last bits
    tolerance = dict(rtol=2**-7, atol=1e-30) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(ours, theirs, **tolerance)
    if dtype == torch.bfloat16:
        assert (ours != theirs).float().mean() < 0.01  # almost every value the very same bits


def test_silu_mul_keeps_nan_and_leaves_other_paths_to_torch():
    gate_up = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    out = kernels.silu_mul(gate_up)
    assert out[0, 0].isnan() and out[0, 1] == F.silu(torch.tensor(1.0)) * 3.0
    assert kernels.silu_mul(gate_up, level=None) is None
    assert kernels.silu_mul(gate_up.half()) is None


def _random_pass(model_dir, dtype: torch.dtype, seed: int, together: bool):
    """A random mixed pass as a continuous batch makes one: 1-3 decode rows (left-padded, or with
    their padding past the column: a joiner whose one token came from its chunk) with the rows
    between them parked, and chunks of 1-2 other rows' prompts after a prefix of 0-25 positions
    (a prefix-cache hit's, or earlier chunks'), each crossing KV blocks or not. The prefixes are
    computed by the Python layers; then the pass, fused in one (`together`), else each part
    through the Python layers. The decoding rows' hidden states, the chunks', and the cache."""
    import random

    from shard_worker.engine.sequences import PARKED
    from shard_worker.model.step import KVCache, Rotary, Step

    rng = random.Random(seed)
    stage, config, layout = _stage(model_dir, dtype, "none", False)
    cpu, rows, length = torch.device("cpu"), 5, 80
    cache = KVCache(config.num_layers, rows, layout.kv_heads, length, config.head_dim, dtype, cpu)
    rotary, zero = Rotary(config, length, cpu), torch.zeros(rows, dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int, s: int) -> torch.Tensor:
        return torch.randint(0, SHAPE["vocab_size"], (n, s), generator=generator)

    def step(r0, r1, c0, c1, pads, per_token=False):
        return Step.build(r0, r1, c0, c1, pads, rotary, stage.windows, dtype, cpu, tables=cache.contiguous,
                          starts=zero, per_token=per_token)

    decoding = sorted(rng.sample(range(rows), rng.randint(1, 3)))
    chunked = [r for r in range(rows) if r not in decoding][:rng.randint(1, 2)]
    col = rng.randint(4, 30)
    pads = torch.full((rows,), PARKED, dtype=torch.int64)
    for r in decoding:
        pads[r] = rng.randint(0, col - 1) if rng.random() < 0.75 else col + 1
        stage.forward(ids(1, col), step(r, r + 1, 0, col, pads), cache)
    spans = {}
    for r in chunked:
        start = rng.randint(0, 25)
        if start:
            stage.forward(ids(1, start), step(r, r + 1, 0, start, zero), cache)
        spans[r] = (start, start + rng.randint(1, 20))
    lo, hi = decoding[0], decoding[-1] + 1
    parts = [(ids(1, b - a), step(r, r + 1, a, b, zero, per_token=True)) for r, (a, b) in spans.items()]
    parts.append((ids(hi - lo, 1), step(lo, hi, col, col + 1, pads)))
    stage.fused.enabled = together
    outs = stage.forward_parts(parts, cache) if together else [stage.forward(x, s, cache) for x, s in parts]
    return outs[:-1] + [outs[-1][[r - lo for r in decoding]]], cache, stage.ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(10))
def test_random_mixed_passes_fused_in_one_compute_what_python_layers_do(model, dtype, seed):
    """Random mixed passes (`_random_pass`), bit for bit: every part's hidden states (the decoding
    rows'), and every KV block but the TRASH one (its slots are written by every row that has
    nowhere else to write, in an order of no consequence)."""
    ours, our_cache, ran = _random_pass(model, dtype, seed, together=True)
    python, python_cache, _ = _random_pass(model, dtype, seed, together=False)
    assert ran == SHAPE["num_layers"]  # one fused pass: each layer once for every part
    for i, (a, b) in enumerate(zip(ours, python, strict=True)):
        assert torch.equal(a, b), f"part {i}: hidden states differ (max {(a.float() - b.float()).abs().max()})"
    kept = slice((paging.TRASH_BLOCK + 1) * paging.BLOCK_SIZE, None)
    assert torch.equal(our_cache.k[..., kept, :], python_cache.k[..., kept, :])
    assert torch.equal(our_cache.v[..., kept, :], python_cache.v[..., kept, :])


def test_tables_that_point_outside_the_pool_or_their_rows_raise_before_any_c_call(model):
    """The once-a-pass bounds check (`fused.problem`): a write or read slot outside the pool, a
    token's row of reads past the table, a column past the read width, a first column past its
    token's, tables of different lengths: each said, and a pass whose step has a write slot past
    the pool raises in `ready` (the C layer, which checks none of the slots, never sees it)."""
    import dataclasses

    from shard_worker.model.step import KVCache, Rotary, Step

    stage, config, layout = _stage(model, torch.float32, "none", True)
    cpu = torch.device("cpu")
    cache = KVCache(config.num_layers, 2, layout.kv_heads, 32, config.head_dim, torch.float32, cpu)
    rotary, zeros = Rotary(config, 32, cpu), torch.zeros(2, dtype=torch.int64)

    def decode() -> Step:
        return Step.build(0, 2, 5, 6, zeros, rotary, stage.windows, torch.float32, cpu, tables=cache.contiguous,
                          starts=zeros)

    x, slots = torch.zeros(2, 1, SHAPE["hidden_size"]), cache.k.shape[-2]
    assert stage.fused.ready(x, decode(), cache)
    good = decode()
    t = fused.tables([(2, 1, good, *cache.maps(good))])
    assert fused.problem(t, slots) is None
    width = t.reads.shape[1]
    bad = {"write slot outside the pool": dataclasses.replace(t, writes=t.writes + slots - 1),
           "read slot outside the pool": dataclasses.replace(t, reads=t.reads - int(t.reads.min()) - 1),
           "reads row 2 of 2 rows": dataclasses.replace(t, srow=t.srow + 1),
           "reads 6 wide": dataclasses.replace(t, cols=t.cols + 1, col=t.col + 1),
           "past its token's column": dataclasses.replace(t, firsts={w: f + 6 for w, f in t.firsts.items()}),
           "1 write slots": dataclasses.replace(t, writes=t.writes[:1])}
    assert width == 6
    for what, table in bad.items():
        assert what in (fused.problem(table, slots) or ""), what
    wrong = decode()
    wrong.writes = cache.maps(wrong)[1] + slots  # an engine bug: a slot past the pool
    with pytest.raises(ValueError, match="tables of this pass are wrong: a write slot outside the pool"):
        stage.fused.ready(x, wrong, cache)
    assert stage.ran == 0
