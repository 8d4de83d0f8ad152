"""Kernel-level checks of ScaledMaskedSoftmax's forward building blocks and of rows longer than one
software-pipelined block / unrolled vector chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from attngrad import scaled_masked_softmax
from attngrad.kernels.numeric import narrow, widen
from attngrad.kernels.scaled_masked_softmax import _rounded_product
from attngrad.kernels.scaled_masked_softmax_reference import scaled_masked_softmax_reference
from attngrad.precision import assert_close


@njit
def _products(x, scale):
    out = np.empty((2, x.size), dtype=np.float32)
    for i in range(x.size):
        out[0, i] = _rounded_product(x[i], scale, x)
        out[1, i] = widen(narrow(widen(x[i]) * scale, x))
    return out


@pytest.mark.parametrize("scale", [0.5, 0.1, 3.0, 1e-3, 300.0, -0.125])
def test_fp16_product_is_the_rounded_fp32_product_for_every_fp16(scale):
    # every float16 bit pattern (subnormals, inf, nan included): the float16 multiply equals x * scale
    # computed exactly in float32 and rounded to float16 once
    x = np.arange(-32768, 32768, dtype=np.int64).astype(np.int16)
    s = np.float32(torch.tensor(scale, dtype=torch.float16).item())
    fast, slow = _products(x, s)
    nan = np.isnan(slow)
    assert np.array_equal(np.isnan(fast), nan)
    assert np.array_equal(fast[~nan].view(np.int32), slow[~nan].view(np.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s1, s2", [(130, 4096), (67, 1031), (1, 65)])  # > one 64-row block, odd widths
def test_long_and_odd_rows_against_golden(dtype, s1, s2):
    g = torch.Generator().manual_seed(s2)
    x = torch.randn(1, 2, s1, s2, generator=g).to(dtype)
    mask = torch.rand(1, 1, s1, s2, generator=g) < 0.3
    y = scaled_masked_softmax(x, mask, 0.7)
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.7), dtype, use_mere=True)
    assert (y.masked_select(mask.expand_as(y)) == 0).all()
