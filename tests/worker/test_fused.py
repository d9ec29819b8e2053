"""The fused decode layers (`shard_worker.model.fused`: a decoder layer's decode step in one C call)
compute what the Python layers compute, bit for bit: the hidden states after every layer and the
keys and values written into the KV cache, for float32, bfloat16 and int8 weights, biases (Qwen2),
sliding windows (Mistral), left-padded rows, and with two threads. TP=2 (through shared memory) is
checked end to end by tests/worker/test_offload.py, whose streamed layers run in Python and whose
resident ones run fused, with logits that must be equal.

And SwiGLU's product in C (`kernels.silu_mul`) against torch's F.silu(gate) * up."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from shard_worker.model import fused, kernels
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
