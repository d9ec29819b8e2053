"""The decode kernels (`shard_worker.kernels`) against `F.linear`: every level this CPU runs and
torch's own path, float32 / bfloat16 / int8 weights, 1-8 rows, shapes of real models and odd
sizes (row tails of every length), rows split over 2 threads; and the fallback when the extension
is absent.

Tolerance: the float64 product plus a bound proportional to sum |x_i w_i| (the dot product's
condition): 1e-5 of it for float32 sums, and for bfloat16 outputs two roundings (2^-7 of the
value: torch's int8 prefill path rounds its GEMM's output, then the scaled result). `F.linear`
itself is checked against the same bound."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shard_worker import kernels
from shard_worker.quant import quantize

LEVELS = [*kernels.LEVELS, None]  # None: torch only
SHAPES = [  # (out, in): in-features of the bench model (hidden 2048, MLP 5632) and Llama-3-8B,
    (384, 2048), (64, 5632), (48, 14336), (96, 4096),  # and odd sizes for every row tail
    (1, 1), (7, 13), (33, 100), (250, 64), (5, 31), (3, 47), (17, 1000), (9, 33)]


def within_bound(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """`w64`: the weight as float64."""
    b64 = None if bias is None else bias.double()
    exact = F.linear(x.double(), w64, b64)
    condition = F.linear(x.double().abs(), w64.abs(), None if b64 is None else b64.abs())
    rounding = 2.0**-7 * exact.abs() if y.dtype == torch.bfloat16 else 0
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
            with_bias = kernels.linear(x, w, bias=bias, level=level)
            if level is None:  # torch's addmm sums in another order than its mm (oneDNN on AMD EPYC)
                within_bound(with_bias, x, w64, bias)
            else:  # ours adds the bias to the product
                torch.testing.assert_close(with_bias, y + bias, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                           atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


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


@pytest.mark.parametrize("level", LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_weights_match_f_linear_of_the_dequantized_weight(level, dtype):
    torch.manual_seed(1)
    for n, k in SHAPES:
        q, scale = quantize(torch.randn(n, k))
        dequantized = (q.float() * scale.unsqueeze(1)).double()
        for rows in (1, 2, 5, 8, 9, 40):  # 9 and 40: prefill, torch's path (dequantized chunks)
            x = torch.randn(rows, k).to(dtype)
            y = kernels.linear(x, q, scale, level=level)
            assert y.dtype == dtype and y.shape == (rows, n)
            within_bound(y, x, dequantized)


def test_activations_of_any_layout():
    """A 3-D input, and one whose rows are not contiguous (a slice of a batch)."""
    w = torch.randn(40, 70)
    x = torch.randn(2, 3, 70)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    strided = torch.randn(4, 140)[:, ::2]
    torch.testing.assert_close(kernels.linear(strided, w), F.linear(strided, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weights_read_in_place_give_the_same_bits(level, dtype):
    """What a streamed layer computes on in place gives exactly the outputs of a resident layer,
    decode and prefill: a column slice of a wider matrix (rows further apart than their width,
    at an address that is not 64-byte aligned) as its contiguous copy, and row blocks that lie
    apart in memory (q, k and v of three checkpoint tensors) as the same blocks of one matrix."""
    torch.manual_seed(3)
    for n, k in [(384, 2048), (33, 100), (7, 13), (64, 5632)]:
        wide = torch.randn(n, 3 * k + 5).to(dtype)
        column_slice = wide[:, k + 1:2 * k + 1]  # starts 4 or 2 bytes past a 64-byte line
        assert column_slice.data_ptr() % 64 != 0 and column_slice.stride(0) != k
        whole = column_slice.contiguous()
        sizes = [n // 3, n // 2 - n // 3, n - n // 2]
        apart = tuple(torch.cat([b, torch.zeros(1, k, dtype=dtype)])[:-1] for b in whole.split(sizes))
        bias = torch.randn(n).to(dtype)
        for rows in (1, 3, 8, 9, 40):
            x = torch.randn(rows, k).to(dtype)
            assert torch.equal(kernels.linear(x, column_slice, level=level),
                               kernels.linear(x, whole, level=level)), (n, k, rows)
            resident = kernels.linear(x, whole, bias=bias, level=level, blocks=tuple(sizes))
            assert torch.equal(kernels.linear(x, apart, bias=bias, level=level), resident), (n, k, rows)
            assert torch.equal(kernels.linear(x, tuple(whole.split(sizes)), bias=bias, level=level), resident)


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
from shard_worker.quant import quantize
assert kernels.LEVELS == [] and kernels.LEVEL is None and "not built" in kernels.describe()
x, w = torch.randn(1, 50), torch.randn(30, 50)
torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w))
q, s = quantize(w)
torch.testing.assert_close(kernels.linear(x, q, s), F.linear(x, q.float() * s[:, None]), rtol=1e-5, atol=1e-5)
xb = x.bfloat16()
expected = F.linear(xb.float(), q.float() * s[:, None])
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
