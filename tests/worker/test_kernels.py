"""The decode kernels (`shard_worker.model.kernels`) against `F.linear`: every level this CPU runs and
torch's own path, float32 / bfloat16 / int8 weights, 1-8 rows (and up to MAX_TOKENS in groups of 8),
shapes of real models and odd
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

from shard_worker.model import kernels
from shard_worker.model.quant import ACT_BLOCK, fake_quantize_activations, quantize, quantize_activations

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
def test_more_rows_than_a_group_give_each_groups_bits(level):
    """9 to MAX_TOKENS rows (a decode step's and a chunk's tokens in one pass) are multiplied in groups
    of MAX_ROWS while a block of W is in L2: each row gets the very bits of its group's own call
    (bfloat16's one-row path included: 9 rows end with a group of one), on 2 threads too."""
    torch.manual_seed(4)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for dtype, wdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                  (torch.bfloat16, torch.int8)):
                for n, k in [(384, 2048), (300, 100), (9, 33)]:
                    w = torch.randn(n, k)
                    w, scale = quantize(w) if wdtype == torch.int8 else (w.to(wdtype), None)
                    for rows in (9, 16, 23, kernels.MAX_TOKENS):
                        x = torch.randn(rows, k).to(dtype)
                        y = kernels.linear(x, w, scale, level=level)
                        groups = [kernels.linear(x[i:i + kernels.MAX_ROWS], w, scale, level=level)
                                  for i in range(0, rows, kernels.MAX_ROWS)]
                        assert torch.equal(y, torch.cat(groups)), (dtype, wdtype, n, k, rows)
    finally:
        torch.set_num_threads(before)


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
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 65):  # 9 and 40: ours in groups of 8; 65: torch's path
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
from shard_worker.model import kernels
from shard_worker.model.quant import fake_quantize_activations, quantize
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
    code = "from shard_worker.model import kernels; print(kernels.LEVEL)"
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
from shard_worker.model import kernels
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


# ---------------------------------------------------------------- the rest of a decode step
def test_decode_first_columns_are_what_the_attention_mask_allows():
    """`first_columns` (our decode attention's key ranges) against `attention_mask` (torch's), for
    padded rows, padding queries, and windows that bite or not."""
    from shard_worker.model.attention import attention_mask, first_columns

    pads = torch.tensor([0, 3, 7, 12])
    for col in (0, 2, 5, 9, 12, 20):
        for window in (None, 1, 4, 30):
            mask = attention_mask(pads, col, col + 1, window)
            allowed = torch.ones(4, 1, 1, col + 1, dtype=torch.bool) if mask is None else mask
            first = first_columns(pads, col, window)
            expected = torch.arange(col + 1) >= first.unsqueeze(1)
            assert torch.equal(allowed[:, 0, 0], expected), (col, window)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 4, 128), (4, 1, 16), (6, 6, 20), (8, 2, 64)])
def test_decode_attention_matches_softmax_attention(level, dtype, heads, kv_heads, head_dim):
    """`kernels.attend` against float64 attention over the same cache: rope on q and k, k and v
    written at the step's column (and nothing else touched), GQA, each row's own key range.
    The reference rounds k to the dtype (the cache holds it so) but not q (ours keeps it in
    float32 after the rope). Tolerance: float32, 1e-5 (values of magnitude ~1); bfloat16, the
    output's rounding."""
    torch.manual_seed(6)
    rows, max_len, col = 3, 40, 33
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, 1, width).to(dtype)
    angles = torch.rand(rows, 1, 1, head_dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    k_cache = torch.randn(rows + 1, kv_heads, max_len, head_dim).to(dtype)  # one more row: rows start at 1
    v_cache = torch.randn(rows + 1, kv_heads, max_len, head_dim).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    first = torch.tensor([0, 5, col])  # a whole row, a padded one, a padding query (itself only)
    out = kernels.attend(qkv, cos, sin, k_cache[1:], v_cache[1:], first, col, heads, kv_heads, level=level)
    assert out.dtype == dtype and out.shape == (rows, 1, heads * head_dim)

    q, k, v = qkv.double().view(rows, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    k_new = rope_reference(k, cos.double()[:, 0], sin.double()[:, 0]).to(dtype)
    assert torch.allclose(k_cache[1:, :, col].double(), k_new.double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache[1:, :, col], v.to(dtype))
    untouched = torch.ones(max_len, dtype=torch.bool)
    untouched[col] = False
    assert torch.equal(k_cache[:, :, untouched], k_before[:, :, untouched])
    assert torch.equal(v_cache[:, :, untouched], v_before[:, :, untouched]) and torch.equal(k_cache[0], k_before[0])

    q = rope_reference(q, cos.double()[:, 0], sin.double()[:, 0])
    group = heads // kv_heads
    for r in range(rows):
        keys = k_cache[1 + r, :, first[r]:col + 1].double().repeat_interleave(group, dim=0)
        values = v_cache[1 + r, :, first[r]:col + 1].double().repeat_interleave(group, dim=0)
        weights = torch.softmax(torch.einsum("hd,hcd->hc", q[r], keys) * head_dim**-0.5, dim=-1)
        expected = torch.einsum("hc,hcd->hd", weights, values).reshape(-1)
        err = (out[r, 0].double() - expected).abs()
        tol = 1e-5 if dtype == torch.float32 else 2.0**-8 * expected.abs() + 1e-5  # bfloat16: the output rounding
        assert bool((err <= tol).all()), float(err.max())


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
def test_decode_attention_of_long_contexts_split_over_threads(level):
    """4096 cached columns, rows over 2 threads: the same as one thread, bit for bit (each (row,
    KV head) is one thread's)."""
    torch.manual_seed(7)
    heads, kv_heads, hd, col = 8, 2, 64, 4095
    qkv = torch.randn(2, 1, (heads + 2 * kv_heads) * hd)
    cos, sin = torch.ones(2, 1, 1, hd), torch.zeros(2, 1, 1, hd)
    k, v = torch.randn(2, kv_heads, 4096, hd), torch.randn(2, kv_heads, 4096, hd)
    first = torch.tensor([0, 100])
    before = torch.get_num_threads()
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outs.append(kernels.attend(qkv, cos, sin, k, v, first, col, heads, kv_heads, level=level))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("level", kernels.LEVELS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_is_hfs(level, dtype):
    """HF's formula in torch: float32 within 1e-6; bfloat16 within one rounding (our 1 / sqrt and
    torch's rsqrt can differ in the last float32 bit, which a bfloat16 rounding can carry)."""
    torch.manual_seed(8)
    for rows, hidden in ((1, 2048), (3, 100), (8, 7)):
        x = (torch.randn(rows, 1, hidden) * 3).to(dtype)
        w = torch.randn(hidden).to(dtype)
        ours = kernels.rms_norm(x, w, 1e-6, level=level)
        theirs = F.rms_norm(x.float(), (hidden,), None, 1e-6).to(dtype) * w
        tol = 1e-6 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
