"""The decode kernels (`shard_worker.kernels`) against `F.linear`: every level this CPU runs and
torch's own path, float32 / bfloat16 / int8 weights, 1-8 rows, shapes of real models and odd
sizes (row tails of every length), rows split over 2 threads; and the fallback when the extension
is absent. Every level this CPU runs is tested by name (`level=`), so a machine with AVX-512
tests the AVX2 and portable paths too.

Tolerance: the float64 product plus a bound proportional to sum |x_i w_i| (the dot product's
condition): 1e-5 of it for float32 sums, and for bfloat16 outputs two roundings (2^-7 of the
value: torch's int8 prefill path rounds its GEMM's output, then the scaled result). `F.linear`
itself is checked against the same bound. int8 weights meet x quantized to int16 (one
power-of-two scale per block of ACT_BLOCK columns, `quant.quantize_activations`): against that
quantized x the bound is the same; against x itself it grows by the quantization's own bound,
sum over blocks of 2^-14 max_block |x| sum_block |w|."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shard_worker import kernels
from shard_worker.quant import ACT_BLOCK, fake_quantize_activations, quantize, quantize_activations

LEVELS = [*kernels.LEVELS, None]  # None: torch only
SHAPES = [  # (out, in): in-features of the bench model (hidden 2048, MLP 5632) and Llama-3-8B,
    (384, 2048), (64, 5632), (48, 14336), (96, 4096),  # and odd sizes for every row tail
    (1, 1), (7, 13), (33, 100), (250, 64), (5, 31), (3, 47), (17, 1000), (9, 33)]


def within_bound(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """`w64`: the weight as float64; a bias adds its magnitude to the condition."""
    b64 = None if bias is None else bias.double()
    exact = F.linear(x.double(), w64, b64)
    condition = F.linear(x.double().abs(), w64.abs(), None if b64 is None else b64.abs())
    # bfloat16: the product's rounding, and the bias's addition's (relative to x w, which |bias| bounds)
    rounding = 2.0**-7 * (exact.abs() + (0 if b64 is None else b64.abs())) if y.dtype == torch.bfloat16 else 0
    err = (y.double() - exact).abs()
    assert bool((err <= 1e-5 * condition + rounding + 1e-30).all()), float((err - 1e-5 * condition - rounding).max())


def check_float(level: str | None, dtype: torch.dtype, shapes: list[tuple[int, int]], rows_list) -> None:
    torch.manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k).to(dtype)
        w64, bias = w.double(), torch.randn(n).to(dtype)
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)
            y = kernels.linear(x, w, level=level)
            assert y.dtype == dtype and y.shape == (rows, n)
            within_bound(y, x, w64)
            within_bound(F.linear(x, w), x, w64)  # torch's own error is of this size too
            # (not y + bias to 1e-6: torch's F.linear with a bias rounds in another order on some CPUs)
            within_bound(kernels.linear(x, w, bias=bias, level=level), x, w64, bias)


@pytest.mark.parametrize("level", LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float_weights_match_f_linear(level, dtype):
    check_float(level, dtype, SHAPES, range(1, kernels.MAX_ROWS + 1))


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
def test_rows_split_over_threads(level):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            check_float(level, dtype, [(1024, 2048), (250, 1000)], (1, 3, 8))
    finally:
        torch.set_num_threads(before)


def quantization_bound(x: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """How far x W^T can move when x is quantized: sum over blocks of 2^-14 max_block |x| times
    sum_block |w| (each x value moves by at most 2^-14 of its block's largest magnitude)."""
    k = x.shape[-1]
    blocks = F.pad(x.double().abs(), (0, -k % ACT_BLOCK)).unflatten(-1, (-1, ACT_BLOCK))
    per_column = (2.0**-14 * blocks.amax(-1, keepdim=True)).expand_as(blocks).flatten(-2)[..., :k]
    return F.linear(per_column, w64.abs())


@pytest.mark.parametrize("level", LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_weights_match_f_linear_of_the_dequantized_weight(level, dtype):
    """Against the quantized x, within float rounding; against x itself, within the quantization's
    bound too. Shapes of real models, odd sizes, every row count of ours and prefill's."""
    torch.manual_seed(1)
    for n, k in [*SHAPES, (40, 129), (24, 255)]:
        q, scale = quantize(torch.randn(n, k))
        dequantized = (q.float() * scale.unsqueeze(1)).double()
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 40):  # 9 and 40: prefill, torch's path (dequantized chunks)
            x = (torch.randn(rows, k) * torch.rand(rows, k).pow(8) * 30).to(dtype)  # a wide range within blocks
            y = kernels.linear(x, q, scale, level=level)
            assert y.dtype == dtype and y.shape == (rows, n)
            within_bound(y, fake_quantize_activations(x), dequantized)
            exact = F.linear(x.double(), dequantized)
            rounding = 2.0**-7 * exact.abs() if dtype == torch.bfloat16 else 0
            limit = 1e-5 * F.linear(x.double().abs(), dequantized.abs()) + quantization_bound(x, dequantized)
            assert bool(((y.double() - exact).abs() <= limit + rounding + 1e-30).all())


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
def test_int8_sums_never_overflow(level):
    """Every weight +-127 and every x at its block's largest value (the int16 extremes), rows as
    long as Llama-3-70B's down projection: the integer block sums must not wrap."""
    k = 28672
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[1::2] = -127
    scale = torch.full((16,), 0.5)
    x = torch.full((2, k), 1.0 - 2.0**-24)  # the largest float32 below 1: its q is clamped to 32767
    x[1] = -1.0
    y = kernels.linear(x, q, scale, level=level)
    expected = F.linear(fake_quantize_activations(x).double(), q.double() * 0.5)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("level", LEVELS, ids=str)
def test_int8_outputs_touched_by_inf_or_nan_are_nan(level):
    """A non-finite x makes its row's outputs NaN (never a finite number that would be sampled)."""
    q, scale = quantize(torch.randn(32, 300))
    x = torch.randn(3, 300)
    x[0, 10], x[1, 250] = float("nan"), float("inf")
    y = kernels.linear(x, q, scale, level=level)
    assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())


def test_activation_quantization_is_exact_where_bfloat16_allows_and_bounded_elsewhere():
    torch.manual_seed(4)
    x = torch.randn(3, 1000) * torch.exp(torch.randn(3, 1000) * 4)  # magnitudes over many octaves
    values, scales = quantize_activations(x)
    assert values.dtype == torch.int16 and values.shape == (3, 1024) and scales.shape == (3, 8)
    assert int(values.abs().max()) <= 32767 and not bool(values[:, 1000:].any())
    largest = F.pad(x.abs(), (0, 24)).unflatten(-1, (-1, ACT_BLOCK)).amax(-1)
    assert bool(((scales.log2().round() == scales.log2())).all())  # powers of two
    assert bool(((largest / scales >= 2**14) & (largest / scales < 2**15)).all())  # 15 bits for the largest
    per_column = largest.repeat_interleave(ACT_BLOCK, dim=-1)[:, :1000]
    assert bool(((fake_quantize_activations(x) - x).abs() <= 2.0**-14 * per_column).all())
    # a bfloat16 x comes back exactly where it lies within 2^7 of its block's largest magnitude,
    # and in bfloat16 anyway (so torch's path computes with the very values our kernels do)
    xb = x.bfloat16()
    back = fake_quantize_activations(xb)
    assert back.dtype == torch.bfloat16
    near = xb.float().abs() >= per_column * 2.0**-7 * (1 + 2.0**-7)
    assert bool(near.any()) and bool((back[near] == xb[near]).all())
    assert torch.equal(quantize_activations(back)[0], quantize_activations(xb)[0])


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_our_activation_quantization_is_torchs_bit_for_bit(level, dtype):
    """`_gemv.quantize` (what each level's kernels use) against `quant.quantize_activations`: odd
    lengths, strided rows, zero blocks, subnormals, inf and NaN."""
    torch.manual_seed(5)
    for k in (1, 5, 15, 16, 17, 127, 128, 129, 300, 2048, 5632):
        x = (torch.randn(3, k + 3) * torch.exp(torch.randn(3, k + 3) * 3)).to(dtype)[:, 1:k + 1]  # ldx > k
        x[2, :min(k, 130)] = 0
        if k >= 300:
            x[0, 150], x[1, 140], x[1, 5] = float("inf"), float("nan"), 1e-40
        values, scales = quantize_activations(x)
        ours, our_scales = torch.full_like(values, 77), torch.empty_like(scales)
        kernels._gemv.quantize(kernels._XTYPES[dtype], x.data_ptr(), ours.data_ptr(), our_scales.data_ptr(), k, 3,
                               x.stride(0), kernels.LEVELS.index(level))
        assert torch.equal(ours, values), k
        assert torch.equal(our_scales.nan_to_num(-1), scales.nan_to_num(-1)), k


def test_activations_of_any_layout():
    """A 3-D input, and one whose rows are not contiguous (a slice of a batch)."""
    w = torch.randn(40, 70)
    x = torch.randn(2, 3, 70)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    strided = torch.randn(4, 140)[:, ::2]
    torch.testing.assert_close(kernels.linear(strided, w), F.linear(strided, w), rtol=1e-5, atol=1e-5)


def test_quantization_round_trip_error_is_half_a_step():
    """Each weight comes back within half a quantization step (scale / 2) of its value; the
    largest magnitude of a row maps to +-127 exactly; all-zero rows stay zero."""
    torch.manual_seed(2)
    w = torch.cat([torch.randn(20, 300) * torch.rand(20, 1) * 10, torch.zeros(1, 300),
                   torch.distributions.StudentT(2.0).sample((5, 300))])
    q, scale = quantize(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and int(q.abs().max()) <= 127
    error = (q.float() * scale.unsqueeze(1) - w).abs()
    assert bool((error <= scale.unsqueeze(1) / 2 * (1 + 1e-6)).all())
    assert bool((q[:20].abs().amax(dim=1) == 127).all()) and not bool(q[20].any())
    # relative to the row's largest weight the error is at most 1/254
    assert float((error.amax(dim=1) / w.abs().amax(dim=1).clamp(min=1e-30)).max()) <= 1 / 254 + 1e-6


def test_without_the_extension_torch_computes_everything():
    """A build without a C compiler has no `_gemv`: the module still works, through torch."""
    code = """
import sys
sys.modules["shard_worker._gemv"] = None  # as if it were never built
import torch, torch.nn.functional as F
from shard_worker import kernels
from shard_worker.quant import fake_quantize_activations, quantize
assert kernels.LEVELS == [] and kernels.LEVEL is None and "not built" in kernels.describe()
x, w = torch.randn(1, 50), torch.randn(30, 50)
torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w))
q, s = quantize(w)
expected = F.linear(fake_quantize_activations(x), q.float() * s[:, None])  # int8: x quantized as ours does
torch.testing.assert_close(kernels.linear(x, q, s), expected, rtol=1e-5, atol=1e-5)
xb = x.bfloat16()
expected = F.linear(fake_quantize_activations(xb).float(), q.float() * s[:, None])
torch.testing.assert_close(kernels.linear(xb, q, s).float(), expected, rtol=2e-2, atol=2e-2)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("setting,expected", [("torch", None), ("portable", "portable"), ("bogus", "error")])
def test_shard_kernel_picks_the_path(setting, expected):
    code = "from shard_worker import kernels; print(kernels.LEVEL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "SHARD_KERNEL": setting})
    if not kernels.LEVELS:
        pytest.skip("the extension is not built here")
    if expected == "error":
        assert out.returncode != 0 and "SHARD_KERNEL='bogus'" in out.stderr
    else:
        assert out.returncode == 0 and out.stdout.strip() == str(expected), out.stderr


def test_a_forked_child_starts_its_own_threads():
    """A child forked after the parent's rows were split over 2 threads has none of the parent's
    worker threads: its own split must not wait for them (it would hang)."""
    if not kernels.LEVELS:
        pytest.skip("the extension is not built here")
    code = """
import os, torch
from shard_worker import kernels
torch.set_num_threads(2)
w, x = torch.randn(4096, 1024), torch.randn(1, 1024)
kernels.linear(x, w)
pid = os.fork()
if pid == 0:
    torch.testing.assert_close(kernels.linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    os._exit(0)
print(os.waitpid(pid, 0)[1])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr
