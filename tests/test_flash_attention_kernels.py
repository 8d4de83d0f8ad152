"""The fused FlashAttention kernels against the float64 reference (BNSD, every dtype, GQA, odd sizes)."""

from __future__ import annotations

import math

import numba
import pytest
import torch

from attngrad.kernels.flash_attention import (backward_chunks, flash_attention_backward,
                                              flash_attention_forward)
from attngrad.kernels.flash_attention_plan import FLT_MAX, MASKED_LOGIT, AttentionPlan
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                        flash_attention_forward_reference)
from attngrad.kernels.gemm import _gemm_for_test
from attngrad.kernels.tensor_view import kernel_view
from attngrad.precision import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(b, n1, n2, sq, skv, d, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n1, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, n2, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, n2, skv, dv, generator=gen).to(dtype)
    dy = torch.randn(b, n1, sq, dv, generator=gen).to(dtype)
    return q, k, v, dy


def _check_forward(q, k, v, plan):
    out, smax, ssum = flash_attention_forward(q, k, v, plan)
    ref_out, ref_max, ref_sum = flash_attention_forward_reference(q, k, v, plan)
    assert out.dtype == q.dtype and smax.dtype == ssum.dtype == torch.float32
    assert_close(out, ref_out, q.dtype)
    assert_close(smax, ref_max, torch.float32)
    assert_close(ssum, ref_sum, torch.float32)


def _golden_stats(q, k, v, plan):
    """out / max / sum from the reference, in the types the backward receives."""
    out, smax, ssum = flash_attention_forward_reference(q, k, v, plan)
    return out.to(q.dtype), smax.float(), ssum.float()


def _check_backward(q, k, v, dy, plan):
    stats = _golden_stats(q, k, v, plan)
    grads = flash_attention_backward(q, k, v, dy, *stats, plan)
    golden = flash_attention_backward_reference(q, k, v, dy, *stats, plan)
    for got, want, like in zip(grads, golden, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert_close(got, want, q.dtype)
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n1,n2", [(4, 2), (3, 3), (4, 1)])
def test_odd_sizes_gqa_and_dv(dtype, n1, n2):
    q, k, v, dy = _inputs(2, n1, n2, 300, 270, 40, 24, dtype)
    plan = AttentionPlan(scale=1 / math.sqrt(40))
    _check_forward(q, k, v, plan)
    _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_query_row(dtype):
    q, k, v, dy = _inputs(1, 2, 1, 1, 77, 16, 16, dtype)
    plan = AttentionPlan(scale=0.3)
    _check_forward(q, k, v, plan)
    _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    base = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(1, 2, 2, 65, 90, 32, 32, dtype)]
    q, k, v, dy = base[0], base[1], base[2], base[3]
    v = torch.cat([v, v], -1)[..., ::2]  # stride 2 on the last dim
    assert not q.is_contiguous() and not v.is_contiguous()
    plan = AttentionPlan(scale=0.2)
    _check_forward(q, k, v, plan)
    _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_head_is_split_and_deterministic(dtype):
    """B*N1 == 1: the backward splits the keys in chunks; same bits twice and with 1 or 2 threads."""
    q, k, v, dy = _inputs(1, 1, 1, 520, 1100, 64, 64, dtype)
    assert backward_chunks(1, 1100) > 1
    plan = AttentionPlan(scale=0.125)
    first = _check_backward(q, k, v, dy, plan)
    stats = _golden_stats(q, k, v, plan)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single = flash_attention_backward(q, k, v, dy, *stats, plan)
        single_fwd = flash_attention_forward(q, k, v, plan)
    finally:
        numba.set_num_threads(threads)
    again = flash_attention_backward(q, k, v, dy, *stats, plan)
    for a, b, c in zip(first, single[:3], again[:3]):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(flash_attention_forward(q, k, v, plan), single_fwd):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pre,nxt", [(2**31 - 1, 0), (40, 3), (2**31 - 1, -5)])
def test_band_and_mask(dtype, pre, nxt):
    """Left-up band (causal, sliding window, negative next) plus a broadcast [1, N1, Sq, Skv] mask."""
    q, k, v, dy = _inputs(2, 2, 1, 300, 280, 32, 32, dtype)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(1, 2, 300, 280, generator=gen) < 0.2
    for plan in (AttentionPlan(scale=0.2, pre_tokens=pre, next_tokens=nxt),
                 AttentionPlan(scale=0.2, pre_tokens=pre, next_tokens=nxt, atten_mask=mask)):
        _check_forward(q, k, v, plan)
        _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("invalid_rows", [False, True])
def test_fully_masked_rows(dtype, invalid_rows):
    """Rows without any visible key: uniform P (sum = Skv) or invalid-row mode; never nan in the grad."""
    q, k, v, dy = _inputs(1, 2, 2, 270, 300, 32, 32, dtype)
    mask = torch.zeros(1, 1, 270, 300, dtype=torch.bool)
    mask[..., 5, :] = True
    mask[..., 260:, :] = True
    plan = AttentionPlan(scale=0.2, atten_mask=mask, next_tokens=0, invalid_rows=invalid_rows)
    _check_forward(q, k, v, plan)
    _, smax, ssum = flash_attention_forward(q, k, v, plan)
    assert (smax[..., 5] == MASKED_LOGIT).all()
    assert (ssum[..., 5] == (FLT_MAX if invalid_rows else 300)).all()
    grads = _check_backward(q, k, v, dy, plan)
    assert all(not g.float().isnan().any() for g in grads[:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_precision_gemm_keeps_fp32_output(dtype):
    a = torch.randn(70, 33).to(dtype)
    b = torch.randn(50, 33).to(dtype)
    c = torch.zeros(70, 50)
    _gemm_for_test(kernel_view(a), kernel_view(b), c.numpy(), True)
    assert_close(c, a.double() @ b.double().T, torch.float32)
