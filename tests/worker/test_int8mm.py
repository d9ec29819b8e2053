"""int8 weight-only products through torch (`int8mm`): the compiled fused product -- what a GPU's
decode step runs -- computes what the reference dequantizing path computes, up to the rounding
of its order of summation, compiled here by inductor for the CPU (the same graph inductor
compiles for CUDA); and every path quantizes x as our C kernels do."""

from __future__ import annotations

import pytest
import torch

from shard_worker.model import int8mm
from shard_worker.model.quant import fake_quantize_activations, quantize


def case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4  # rows of different scales
    q, scale = quantize(w)
    x = (torch.randn(rows, k, generator=g) * torch.rand(1, k, generator=g).pow(4) * 8).to(dtype)  # wide range
    return x, q, scale


@pytest.mark.slow  # inductor compiles a C++ kernel per case (tens of seconds on a busy machine)
@pytest.mark.parametrize("rows,n,k,dtype", [(1, 96, 200, torch.float32), (8, 130, 384, torch.bfloat16)])
def test_compiled_fused_product_is_the_reference_dequant_path(rows, n, k, dtype):
    x, q, scale = case(rows, n, k, dtype)
    reference = int8mm.dequant(fake_quantize_activations(x), q, scale)
    fused = int8mm.compiled()(x, q, scale)
    assert fused.dtype == reference.dtype == dtype and fused.shape == (rows, n)
    exact = (fake_quantize_activations(x).double() @ (q.double() * scale.double().unsqueeze(1)).T)
    if dtype == torch.float32:  # two float32 sums in different orders
        torch.testing.assert_close(fused, reference, rtol=2e-5, atol=1e-5 * float(exact.abs().max()))
    else:  # the reference rounds its GEMM's output to bfloat16 before scaling, the fused one only once
        ulp = 2.0**-7
        assert ((fused.double() - exact).abs() <= ulp / 2 * exact.abs() + 1e-6).all()
        assert ((fused.double() - reference.double()).abs() <= 2 * ulp * exact.abs() + 1e-6).all()
    # and not the float weight: the quantization shows
    assert not torch.equal(fused, (x.float() @ (q.float() * scale.unsqueeze(1)).T).to(dtype)) or rows == 1


def test_the_eager_fused_function_is_the_reference_too():
    x, q, scale = case(2, 40, 300, torch.float32, seed=1)
    torch.testing.assert_close(int8mm.fused(x, q, scale), int8mm.dequant(fake_quantize_activations(x), q, scale),
                               rtol=2e-5, atol=1e-5)


def test_a_cpu_and_prefill_take_the_reference_whatever_the_mode():
    x, q, scale = case(12, 32, 128, torch.float32, seed=2)
    bias = torch.randn(32)
    expected = int8mm.dequant(fake_quantize_activations(x), q, scale) + bias
    for mode in int8mm.MODES:
        assert torch.equal(int8mm.linear(x.view(3, 4, 128), q, scale, bias, mode=mode), expected.view(3, 4, 32))
        assert torch.equal(int8mm.linear(x[:2], q, scale, None, mode=mode),
                           int8mm.dequant(fake_quantize_activations(x[:2]), q, scale))


def test_an_unknown_cuda_mode_is_refused(monkeypatch):
    monkeypatch.setenv(int8mm.ENV, "fast")
    with pytest.raises(RuntimeError, match="SHARD_INT8_CUDA='fast'"):
        int8mm.cuda_mode()


def test_int8pack_answers_in_the_activations_dtype(monkeypatch):
    """torch's CUDA _weight_int8pack_mm returned float32 whatever x's dtype (some versions): the
    product comes back in x's, as the other paths' does (a stub stands in for that kernel here)."""
    x, q, scale = case(2, 24, 128, torch.bfloat16, seed=3)

    def cuda_like(x2, weight, scales):
        return x2.float() @ (weight.float() * scales.unsqueeze(1)).T  # float32, as that kernel answered

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", cuda_like)
    y = int8mm.int8pack(x, q, scale)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 24)
    torch.testing.assert_close(y, cuda_like(fake_quantize_activations(x), q, scale).to(torch.bfloat16))
