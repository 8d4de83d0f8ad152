"""Kernel-level checks of ScaledMaskedSoftmax's forward building blocks and of rows longer than one
software-pipelined block / unrolled vector chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from attngrad import scaled_masked_softmax
from attngrad.kernels.numeric import FASTMATH, FLOAT16_GRID_LIMIT, HAS_AVX512_FP16
from attngrad.kernels.gemm_paths import SCALING_ENV
from attngrad.kernels.scaled_masked_softmax import (CONVERTED_SCALING, FLOAT32_SCALING, GRID_SCALING, _scaled_logit,
                                                   scaled_masked_softmax_backward, scaled_masked_softmax_forward,
                                                   scaling_of)
from attngrad.kernels.tensor_view import kernel_view
from attngrad.kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                             scaled_masked_softmax_reference)
from attngrad.precision import assert_close


@njit(fastmath=FASTMATH)
def _products(x, scale, scaling):
    out = np.empty(x.size, dtype=np.float32)
    for i in range(x.size):
        out[i] = _scaled_logit(x[i], scale, scaling)
    return out


def _rounded_products(x, scale):
    """x * scale in float64 (exact for float16 x and scale) rounded once to float16 by numpy, as float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.view(np.float16).astype(np.float64) * np.float64(scale)).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("scale", [0.5, 0.1, 3.0, 1e-3, 300.0, -0.125])
def test_fp16_product_is_the_rounded_fp32_product_for_every_fp16(scale):
    # every float16 bit pattern (subnormals, inf, nan included): the kernel's float16 product equals x * scale
    # computed exactly in float32 and rounded to float16 once, except where that overflows and the kernel rounds
    # by numeric.float16_grid: the product stays finite there, and the kernel checks each row's max for it
    x = np.arange(-32768, 32768, dtype=np.int64).astype(np.int16)
    s = np.float32(torch.tensor(scale, dtype=torch.float16).item())
    fast, slow = _products(x, s, GRID_SCALING), _rounded_products(x, s)
    nan = np.isnan(slow)
    overflow = np.isinf(slow) & np.isfinite(torch.from_numpy(x).view(torch.float16).float().numpy())
    assert overflow.any() == (abs(scale) > 1)
    on_grid = not HAS_AVX512_FP16  # AVX512-FP16: one float16 multiply for either scaling
    exact = ~nan & ~overflow if on_grid else ~nan
    assert np.array_equal(np.isnan(fast), nan)
    # + 0 turns -0.0 into +0.0: the grid's zeros may carry either sign (no softmax sees the difference)
    assert np.array_equal((fast[exact] + 0).view(np.int32), (slow[exact] + 0).view(np.int32))
    if on_grid:
        assert np.isfinite(fast[overflow]).all() and (np.abs(fast[overflow]) >= FLOAT16_GRID_LIMIT).all()
    # the conversions (also for rows whose max says a grid product may have overflowed): every value, overflow to
    # inf included
    exact_form = _products(x, s, CONVERTED_SCALING)
    assert np.array_equal(np.isnan(exact_form), nan)
    assert np.array_equal((exact_form[~nan] + 0).view(np.int32), (slow[~nan] + 0).view(np.int32))


@pytest.mark.parametrize("forced, marker", [("grid", GRID_SCALING), ("conversions", CONVERTED_SCALING)])
def test_scaling_of_takes_the_chosen_rounding(forced, marker, monkeypatch):
    monkeypatch.setenv(SCALING_ENV, forced)
    assert scaling_of(False) is FLOAT32_SCALING  # float32 scaling: every dtype but the npu mode's float16
    # with AVX512-FP16 either marker runs the one float16 multiply (the conversions' marker)
    assert scaling_of(True) is (CONVERTED_SCALING if HAS_AVX512_FP16 else marker)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s1, s2", [(130, 4096), (67, 1031), (1, 65)])  # > one 64-row block, odd widths
def test_long_and_odd_rows_against_golden(dtype, s1, s2):
    g = torch.Generator().manual_seed(s2)
    x = torch.randn(1, 2, s1, s2, generator=g).to(dtype)
    mask = torch.rand(1, 1, s1, s2, generator=g) < 0.3
    y = scaled_masked_softmax(x, mask, 0.7)
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.7), dtype, use_mere=True)
    assert (y.masked_select(mask.expand_as(y)) == 0).all()


def _outputs(shape, dtype, layout):
    """Output tensors of ``shape``: contiguous, rows at an odd pitch (unaligned row starts), or a strided last dim."""
    if layout == "contiguous":
        return torch.empty(shape, dtype=dtype)
    if layout == "odd_pitch":
        return torch.empty(*shape[:-1], shape[-1] + 3, dtype=dtype)[..., 1:1 + shape[-1]]
    return torch.empty(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "odd_pitch", "strided"])
def test_streamed_outputs_equal_cached_ones(dtype, layout):
    # the non-temporal (streamed) writes of large outputs give the same bits as plain stores, whatever the
    # alignment of the output rows (67 rows: more than one 64-row task; width 301: an unaligned tail)
    g = torch.Generator().manual_seed(1)
    shape = (2, 2, 67, 301)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    mask = kernel_view(torch.rand(2, 1, 67, 301, generator=g) < 0.3)
    scale = np.float32(0.5)
    results = []
    for stream in (False, True):
        y, dx = _outputs(shape, dtype, layout), _outputs(shape, dtype, layout)
        scaled_masked_softmax_forward(kernel_view(x), mask, scale, scaling_of(dtype == torch.float16), stream,
                                      kernel_view(y))
        scaled_masked_softmax_backward(kernel_view(dy), kernel_view(y), mask, scale, stream, kernel_view(dx))
        results.append((y, dx))
    (y0, dx0), (y1, dx1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    bool_mask = torch.from_numpy(mask).bool()
    assert_close(y1, scaled_masked_softmax_reference(x, bool_mask, 0.5), dtype, use_mere=True)
    assert_close(dx1, scaled_masked_softmax_backward_reference(dy, y1, bool_mask, 0.5), dtype, use_mere=True)


@pytest.mark.parametrize("s1", [3, 67])  # first/last rows of a block and pipelined rows
def test_bfloat16_rows_with_subnormal_outputs_round_exactly(s1):
    # A bf16 row is rounded by the CPU's conversion (which flushes float32 subnormals to zero) only when none of
    # its outputs is subnormal: outputs near 1e-39 must come out as the bf16 subnormals nearest the golden.
    g = torch.Generator().manual_seed(s1)
    x = torch.randn(1, 2, s1, 131, generator=g).clamp(-3.0, 2.0)
    tiny_rows = torch.arange(s1) % 2 == 0
    x[:, :, tiny_rows, :8] = 3.0  # the max, 8 times: a row sum above 8
    x[:, :, tiny_rows, 10:14] = torch.tensor([-83.0, -83.5, -84.0, -84.5])  # exp(z - 3) normal, / sum subnormal
    x = x.to(torch.bfloat16)
    mask = torch.zeros(1, 1, s1, 131, dtype=torch.bool)
    mask[..., 100] = True
    y = scaled_masked_softmax(x, mask, 1.0)
    golden = scaled_masked_softmax_reference(x, mask, 1.0)
    subnormal = (golden > 0) & (golden < 2.0**-126)
    assert subnormal.sum() == 4 * 2 * ((s1 + 1) // 2)
    assert (y[subnormal] > 0).all()
    assert ((y.double() - golden).abs()[subnormal] <= 2.0**-133).all()  # within one bf16 subnormal step
    assert_close(y, golden, torch.bfloat16, use_mere=True)
