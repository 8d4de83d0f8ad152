"""Extreme valid shapes at every operator: size-1 dims everywhere, prime sizes, CANN's largest
softmax row (S2 = 4096), T = 1, D = 512, huge B*N with tiny S, zero-size tensors, and 64-bit index
arithmetic: views whose element offsets pass 2^31 (cheap: untouched memory is never committed) and one
output of more than 2^31 elements (4.4 GiB, about 7 s).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import attngrad
from attngrad import aclnn
from attngrad.kernels.exp_segsum_reference import exp_segsum_backward_reference, exp_segsum_reference, saturate
from attngrad.kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                               scaled_masked_softmax_reference)
from attngrad.precision import assert_close
from reliability_cases import (FA_DEFAULTS, OPS, SMS_BWD_FN, SMS_FWD_FN, fa_forward_check, fa_grad_check, fa_tensors,
                               make_outs, run_two_phase)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BIG = 2**31


def rand(shape, dtype, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype)


def check_sms(shape, mask_shape, dtype):
    x, mask, dy = rand(shape, dtype, 2.0), torch.rand(mask_shape) < 0.3, rand(shape, dtype)
    y = attngrad.scaled_masked_softmax(x, mask, 0.5)
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.5), dtype, use_mere=True)
    grad = attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.5)
    assert_close(grad, scaled_masked_softmax_backward_reference(dy, y, mask, 0.5), dtype, use_mere=True,
                 exact_zero=mask)


def check_seg(lead, t, dtype):
    x = rand((*lead, t), dtype, 0.5)
    out = attngrad.exp_segsum(x)
    assert_close(out, saturate(exp_segsum_reference(x), dtype), dtype, use_mere=True)
    dy = rand(out.shape, dtype)
    grad = attngrad.exp_segsum_backward(dy, out)
    assert_close(grad, saturate(exp_segsum_backward_reference(dy, out), dtype), dtype, use_mere=True)


def fa_args(layout, b, n1, n2, sq, skv, d, dv, dtype, saved=True):
    geo = {"layout": layout, "b": b, "n1": n1, "n2": n2, "sq": sq, "skv": skv, "d": d, "dv": dv}
    q, k, v, dy = fa_tensors(geo, dtype, random.Random(0))
    return {"query": q, "key": k, "value": v, "dy": dy, "head_num": n1, "input_layout": layout, **FA_DEFAULTS,
            "softmax_max": None, "softmax_sum": None, "attention_in": None, "softmax_in": None}


def check_fa(a):
    fwd = OPS["flash_attention_score"].callers["torch"](a, {})
    fa_forward_check(a, fwd)
    fa_grad_check(a, OPS["flash_attention_score_grad"].callers["torch"](a, {}))


# --- size-1 dims everywhere and prime sizes ---
@pytest.mark.parametrize("dtype", DTYPES)
def test_size_one_everywhere(dtype):
    check_sms((1, 1, 1, 1), (1, 1, 1, 1), dtype)
    check_seg((1, 1), 1, dtype)
    check_seg((1, 1, 1), 1, dtype)
    for layout in ("BSH", "SBH", "BSND", "BNSD"):
        check_fa(fa_args(layout, 1, 1, 1, 1, 1, 1, 1, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prime_sizes(dtype):
    check_sms((3, 5, 7, 13), (1, 5, 7, 13), dtype)
    check_seg((2, 3, 5), 31, dtype)
    check_fa(fa_args("BSH", 2, 3, 1, 13, 17, 7, 5, dtype))
    check_fa(fa_args("SBH", 1, 5, 5, 263, 257, 11, 11, dtype))  # more rows / keys than one tile


# --- the largest sizes CANN documents ---
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_last_dim_4096_both_layers(dtype):
    shape = (1, 2, 3, 4096)
    check_sms(shape, (1, 1, 3, 4096), dtype)
    x, mask = rand(shape, dtype, 2.0), torch.rand(1, 1, 3, 4096) < 0.5
    y = torch.zeros(shape, dtype=dtype)
    assert run_two_phase(SMS_FWD_FN, x, mask, 1.0, False, y) == aclnn.ACLNN_SUCCESS
    assert torch.equal(y, attngrad.scaled_masked_softmax(x, mask, 1.0))
    out = torch.zeros(shape, dtype=dtype)
    assert run_two_phase(SMS_BWD_FN, x, y, mask, 1.0, False, out) == aclnn.ACLNN_SUCCESS
    assert torch.equal(out, attngrad.scaled_masked_softmax_backward(x, y, mask, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_segsum_t_equals_one(dtype):
    x = rand((4, 3, 1), dtype)
    out = attngrad.exp_segsum(x)
    assert out.shape == (4, 3, 1, 1) and bool((out == 1).all())
    grad = attngrad.exp_segsum_backward(rand((4, 3, 1, 1), dtype), out)
    assert grad.shape == (4, 3, 1) and bool((grad == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_head_dim_512(dtype):
    a = fa_args("BNSD", 1, 2, 1, 9, 20, 512, 512, dtype)
    check_fa(a)
    outs = make_outs(OPS["flash_attention_score"], a)
    assert OPS["flash_attention_score"].callers["aclnn"](a, outs) == aclnn.ACLNN_SUCCESS
    fa_forward_check(a, outs)
    wide = fa_args("BNSD", 1, 1, 1, 2, 2, 513, 513, dtype)
    outs = make_outs(OPS["flash_attention_score"], wide)
    assert OPS["flash_attention_score"].callers["aclnn"](wide, outs) == aclnn.ACLNN_ERR_PARAM_INVALID
    assert "D axis" in aclnn.aclGetRecentErrMsg()
    check_fa(wide)  # the torch layer has no CANN limit on D


# --- many tiny problems ---
def test_huge_batch_times_heads_tiny_rows():
    check_sms((512, 64, 1, 2), (512, 1, 1, 2), torch.bfloat16)
    check_seg((256, 128), 2, torch.float16)
    check_fa(fa_args("BSND", 64, 64, 16, 1, 2, 4, 4, torch.float32))


# --- zero-size tensors: valid, empty (or zero-filled) results of the right shapes ---
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_zero_size_every_dim(dim):
    shape = [2, 3, 4, 5]
    shape[dim] = 0
    x = torch.randn(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    assert attngrad.scaled_masked_softmax(x, mask).shape == x.shape
    assert attngrad.scaled_masked_softmax_backward(x, x, mask).shape == x.shape
    assert attngrad.exp_segsum(x).shape == (*shape, shape[-1])
    grads = torch.randn(*shape, shape[-1])
    assert attngrad.exp_segsum_backward(grads, grads).shape == tuple(shape)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
@pytest.mark.parametrize("zero", ["b", "sq", "skv"])
def test_zero_size_flash_attention(layout, zero):
    """Empty problems: empty outputs, or (Skv = 0) out = 0, max = -FLT_MAX, sum = 0; grads zero-filled."""
    sizes = {"b": 2, "sq": 3, "skv": 4, zero: 0}
    a = fa_args(layout, sizes["b"], 2, 1, sizes["sq"], sizes["skv"], 4, 4, torch.float16)
    out, m, s = attngrad.flash_attention_score(a["query"], a["key"], a["value"], 2, layout)
    assert out.shape == a["dy"].shape and m.shape == (sizes["b"], 2, sizes["sq"], 8)
    assert bool((out == 0).all()) and bool((s == 0).all())
    dq, dk, dv, _ = attngrad.flash_attention_score_grad(a["query"], a["key"], a["value"], a["dy"], 2, layout)
    for got, like in ((dq, a["query"]), (dk, a["key"]), (dv, a["value"])):
        assert got.shape == like.shape and got.dtype == like.dtype and bool((got == 0).all())


# --- 64-bit index arithmetic ---
def far_view(shape, dtype, far_dim=0):
    """A view of ``shape`` whose stride on ``far_dim`` passes 2^31 elements, filled with random data.

    Its storage is ~2^31 elements but only the touched pages are ever committed.
    """
    strides = list(torch.empty(shape).stride())
    strides[far_dim] = BIG + 7
    extent = sum((s - 1) * st for s, st in zip(shape, strides)) + 1
    view = torch.empty(extent, dtype=dtype).as_strided(shape, strides)
    view.copy_(rand(shape, dtype))
    return view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_element_offsets_beyond_int32(dtype):
    """Kernels read inputs in place (any strides): offsets past 2^31 elements must index correctly."""
    x, dy = far_view((2, 1, 2, 8), dtype), far_view((2, 1, 2, 8), dtype)
    mask = torch.rand(1, 1, 2, 8) < 0.3
    y = attngrad.scaled_masked_softmax(x, mask, 0.5)
    assert_close(y, scaled_masked_softmax_reference(x.contiguous(), mask, 0.5), dtype, use_mere=True)
    grad = attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.5)
    assert_close(grad, scaled_masked_softmax_backward_reference(dy.contiguous(), y, mask, 0.5), dtype,
                 use_mere=True, exact_zero=mask)
    xs = far_view((2, 1, 1, 6), dtype)
    assert_close(attngrad.exp_segsum(xs), saturate(exp_segsum_reference(xs.contiguous()), dtype), dtype,
                 use_mere=True)
    go, gs = far_view((2, 1, 1, 6, 6), dtype), far_view((2, 1, 1, 6, 6), dtype)
    assert_close(attngrad.exp_segsum_backward(go, gs),
                 saturate(exp_segsum_backward_reference(go.contiguous(), gs.contiguous()), dtype), dtype)


def test_more_than_2_pow_31_elements():
    """ExpSegsum forward into a bf16 output of 3 * 27000^2 > 2^31 elements (4.4 GiB); the last rows of the
    last problem (element offsets near 2.19e9) are checked against the reference computed on just them."""
    t = 27000
    x = (torch.randn(1, 1, 3, t) * 0.01).to(torch.bfloat16)
    start = time.perf_counter()
    out = attngrad.exp_segsum(x)
    elapsed = time.perf_counter() - start
    assert out.numel() > BIG
    xs = x[0, 0, 2].double()
    for i in (t - 2, t - 1):
        sums = xs[1:i + 1].flip(0).cumsum(0).flip(0)  # sums[j] = x[j+1] + ... + x[i], j = 0..i-1
        golden = torch.cat([sums.exp(), torch.ones(1), torch.zeros(t - i - 1, dtype=torch.float64)])
        assert_close(out[0, 0, 2, i], golden, torch.bfloat16, use_mere=True)
    assert bool((out[0, 0, 0, 0, 1:] == 0).all()) and out[0, 0, 0, 0, 0] == 1
    print(f"exp_segsum over {out.numel()} elements: {elapsed:.1f} s")
