"""FlashAttentionScore / FlashAttentionScoreGrad against the float64 reference (README, 'How precision is judged').

Goldens are computed by the plain float64 reference from the same dtype-rounded inputs. fp16/bf16 are
compared plainly against that golden (no round_to emulation): the norm-relative thresholds hold with margin.
The grad golden takes the operator's own forward outputs (attention_in, softmax max/sum), as CANN's grad does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attngrad
from attngrad import aclnn, npu
from attngrad.kernels.flash_attention_plan import MASKED_LOGIT, AttentionPlan
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                         flash_attention_forward_reference)
from attngrad.ops.flash_attention import from_bnsd, to_bnsd
from attngrad.precision import assert_close

from helpers import acl, attention_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["BSH", "SBH", "BSND", "BNSD"]
HEADS = [(4, 2), (3, 3), (4, 1)]


def golden(layout, n1, q, k, v, dy, out, smax, ssum, scale):
    """Float64 (out, dq, dk, dv) in ``layout``; the grad uses the given out and stats (element 0 of 8)."""
    bq = to_bnsd(q, layout, n1)
    d = bq.shape[-1]
    n2 = k.shape[2] // d if layout in ("BSH", "SBH") else (k.shape[1] if layout == "BNSD" else k.shape[2])
    bk, bv = to_bnsd(k, layout, n2), to_bnsd(v, layout, n2)
    plan = AttentionPlan(scale=scale)
    g_out, g_max, g_sum = flash_attention_forward_reference(bq, bk, bv, plan)
    grads = flash_attention_backward_reference(bq, bk, bv, to_bnsd(dy, layout, n1), to_bnsd(out, layout, n1),
                                               smax[..., 0], ssum[..., 0], plan)
    return (from_bnsd(g_out, layout), g_max, g_sum, *(from_bnsd(x, layout) for x in grads))


def check_all(layout, n1, q, k, v, dy, scale):
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, n1, layout, scale_value=scale)
    dq, dk, dv, dpse = attngrad.flash_attention_score_grad(q, k, v, dy, n1, layout, scale_value=scale,
                                                           softmax_max=smax, softmax_sum=ssum, attention_in=out)
    assert dpse is None
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == q.dtype
    assert (out.shape, dq.shape, dk.shape, dv.shape) == (dy.shape, q.shape, k.shape, v.shape)
    assert smax.dtype == ssum.dtype == torch.float32 and smax.shape[-1] == 8
    assert torch.equal(smax, smax[..., :1].expand_as(smax)) and torch.equal(ssum, ssum[..., :1].expand_as(ssum))
    g_out, g_max, g_sum, g_dq, g_dk, g_dv = golden(layout, n1, q, k, v, dy, out, smax, ssum, scale)
    assert_close(out, g_out)
    assert_close(smax[..., 0], g_max, torch.float32)
    assert_close(ssum[..., 0], g_sum, torch.float32)
    for got, want in ((dq, g_dq), (dk, g_dk), (dv, g_dv)):
        assert_close(got, want)
    return out, smax, ssum, dq, dk, dv


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_golden_layouts_dtypes_gqa(layout, dtype, heads):
    n1, n2 = heads
    q, k, v, dy = attention_inputs(layout, 2, n1, n2, 37, 130, 16, 8, dtype)   # Dv < D, Sq != Skv, odd sizes
    check_all(layout, n1, q, k, v, dy, 0.25)


# Skv = 1 is left out here: dq and dk are then exactly 0 mathematically (dS = P * (dP - Dr) with P = 1), so a
# norm-relative comparison measures only rounding noise; test_single_key covers it with an absolute bound.
@pytest.mark.parametrize("sq,skv", [(1, 5), (1, 130), (130, 37), (64, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_sequence_lengths(sq, skv, dtype):
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, sq, skv, 32, 32, dtype, seed=sq + skv)
    check_all("BNSD", 2, q, k, v, dy, 32 ** -0.5)


def test_single_key():
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, 3, 1, 8, 8, torch.float32, seed=6)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 2, "BNSD")
    assert_close(out, v.double().expand(1, 2, 3, 8))
    dq, dk, dv, _ = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD")
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5
    assert_close(dv, dy.double().sum((1, 2), keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    b, n1, n2, sq, skv, d, dv = 2, 4, 2, 19, 23, 16, 16
    big = attention_inputs("BSND", b, n1, n2 * 2, sq * 2, skv, d * 2, dv * 2, dtype, seed=3)
    q = big[0][:, ::2, :, :d]                   # strided S and D
    k = big[1][:, :, ::2, d:]                   # every other head, offset D
    v = big[2][:, :, 1::2, ::2]                 # stride-2 last dim
    dy = big[3][:, ::2, :, :dv]
    assert not any(t.is_contiguous() for t in (q, k, v, dy))
    results = check_all("BSND", n1, q, k, v, dy, 0.3)
    contiguous = check_all("BSND", n1, *(t.contiguous() for t in (q, k, v, dy)), 0.3)
    for a, b_ in zip(results, contiguous):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_recomputed_statistics_match_explicit(layout, dtype):
    q, k, v, dy = attention_inputs(layout, 2, 4, 2, 33, 45, 16, 16, dtype, seed=5)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 4, layout, scale_value=0.2)
    explicit = attngrad.flash_attention_score_grad(q, k, v, dy, 4, layout, scale_value=0.2, softmax_max=smax,
                                                   softmax_sum=ssum, attention_in=out)
    recomputed = attngrad.flash_attention_score_grad(q, k, v, dy, 4, layout, scale_value=0.2)
    for a, b in zip(explicit[:3], recomputed[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_matches_golden(layout, dtype):
    q, k, v, dy = attention_inputs(layout, 1, 4, 2, 21, 30, 16, 8, dtype, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, smax, ssum = attngrad.flash_attention_score(*leaves, 4, layout, scale_value=0.25)
    assert out.requires_grad and not smax.requires_grad
    out.backward(dy)
    g = golden(layout, 4, q, k, v, dy, out.detach(), smax, ssum, 0.25)
    for leaf, want in zip(leaves, g[3:]):
        assert leaf.grad.dtype == dtype
        assert_close(leaf.grad, want)
    explicit = attngrad.flash_attention_score_grad(q, k, v, dy, 4, layout, scale_value=0.25, softmax_max=smax,
                                                   softmax_sum=ssum, attention_in=out.detach())
    for leaf, e in zip(leaves, explicit):
        assert torch.equal(leaf.grad, e)


def test_backward_uses_given_statistics():
    """CANN's grad trusts softmax_max/sum/attention_in (docs/cann-semantics.md, 'Softmax statistics'): other
    stats change the result."""
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 2, 16, 16, 8, 8, torch.float32, seed=9)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 2, "BNSD")
    doubled = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax,
                                                  softmax_sum=ssum * 2, attention_in=out)
    g = golden("BNSD", 2, q, k, v, dy, out, smax, ssum * 2, 1.0)
    for got, want in zip(doubled[:3], g[3:]):
        assert_close(got, want)
    normal = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                                 attention_in=out)
    assert not torch.allclose(normal[2], doubled[2])


def test_empty_inputs_zero_fill():
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, 5, 0, 8, 8, torch.float16)     # Skv = 0
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 2, "BNSD")
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((smax == MASKED_LOGIT).all()) and bool((ssum == 0).all())
    dq, dk, dv, _ = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD")
    assert dq.shape == q.shape and torch.equal(dq, torch.zeros_like(dq)) and dk.numel() == dv.numel() == 0
    q, k, v, dy = attention_inputs("BSH", 0, 2, 2, 4, 4, 8, 8, torch.float32)      # B = 0
    assert attngrad.flash_attention_score(q, k, v, 2, "BSH")[0].shape == (0, 4, 16)
    assert attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BSH")[0].shape == (0, 4, 16)


def test_cann_no_mask_means_full_attention():
    """Without attenMask CANN ignores sparseMode and the tokens; prefix only matters for modes 5/6."""
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 2, 9, 9, 8, 8, torch.float32, seed=2)
    base = attngrad.flash_attention_score(q, k, v, 2, "BNSD")[0]
    other = attngrad.flash_attention_score(q, k, v, 2, "BNSD", sparse_mode=3, pre_tokens=1, next_tokens=0,
                                           prefix=[0], q_start_idx=[0], kv_start_idx=[0])[0]
    assert torch.equal(base, other)


def test_npu_names_and_tuples():
    q, k, v, dy = attention_inputs("BSND", 2, 4, 2, 12, 20, 16, 16, torch.float32, seed=4)
    fwd = npu.npu_fusion_attention(q, k, v, 4, "BSND", scale=0.25, pre_tockens=65536, next_tockens=65536)
    assert len(fwd) == 7
    out, smax, ssum, softmax_out, seed, offset, numels = fwd
    assert softmax_out.numel() == 0 and (seed, offset, numels) == (0, 0, 2 * 4 * 12 * 20)
    ref = attngrad.flash_attention_score(q, k, v, 4, "BSND", scale_value=0.25)
    assert all(torch.equal(a, b) for a, b in zip((out, smax, ssum), ref))
    grads = npu.npu_fusion_attention_grad(q, k, v, dy, 4, "BSND", softmax_max=smax, softmax_sum=ssum,
                                          attention_in=out, scale_value=0.25)
    assert len(grads) == 5 and grads[3].numel() == 0 and grads[4].numel() == 0
    ref_grads = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "BSND", softmax_max=smax, softmax_sum=ssum,
                                                    attention_in=out, scale_value=0.25)
    assert all(torch.equal(a, b) for a, b in zip(grads[:3], ref_grads[:3]))
    assert len(npu.npu_fusion_attention_v2(q, k, v, 4, "BSND", scale=0.25, pse_type=1)) == 7
    grads2 = npu.npu_fusion_attention_grad_v2(q, k, v, dy, 4, "BSND", softmax_max=smax, softmax_sum=ssum,
                                              attention_in=out, scale_value=0.25)
    assert len(grads2) == 7 and all(torch.equal(a, b) for a, b in zip(grads2[:3], ref_grads[:3]))
    sink = torch.linspace(-1, 1, 4)
    fwd_sink = npu.npu_fusion_attention(q, k, v, 4, "BSND", scale=0.25, sink=sink)
    assert all(torch.equal(a, b) for a, b in zip(fwd_sink[:3], attngrad.flash_attention_score(
        q, k, v, 4, "BSND", scale_value=0.25, sink=sink)))
    dsink = npu.npu_fusion_attention_grad(q, k, v, dy, 4, "BSND", scale_value=0.25, sink=sink)[4]
    assert dsink.shape == (4,) and dsink.dtype == torch.float32


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_aclnn_forward_then_grad(v2, dtype):
    q, k, v, dy = attention_inputs("SBH", 2, 4, 1, 17, 26, 16, 16, dtype, seed=8)
    out = torch.zeros_like(dy)
    smax = torch.zeros(2, 4, 17, 8)
    ssum = torch.zeros(2, 4, 17, 8)
    tokens = 2147483647
    if v2:
        ret, ws, ex = aclnn.aclnnFlashAttentionScoreV2GetWorkspaceSize(
            acl(q), acl(k), acl(v), None, None, None, None, None, None, None, 0.25, 1.0, tokens, tokens, 4,
            "SBH", 0, 0, 1, acl(smax), acl(ssum), None, acl(out))
        run = aclnn.aclnnFlashAttentionScoreV2
    else:
        ret, ws, ex = aclnn.aclnnFlashAttentionScoreGetWorkspaceSize(
            acl(q), acl(k), acl(v), None, None, None, None, None, 0.25, 1.0, tokens, tokens, 4, "SBH", 0, 0,
            acl(smax), acl(ssum), None, acl(out))
        run = aclnn.aclnnFlashAttentionScore
    assert (ret, ws) == (0, 0), aclnn.aclGetRecentErrMsg()
    assert run(None, ws, ex, None) == 0
    ref = attngrad.flash_attention_score(q, k, v, 4, "SBH", scale_value=0.25)
    assert all(torch.equal(a, b) for a, b in zip((out, smax, ssum), ref))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    common = (acl(q), acl(k), acl(v), acl(dy), None, None, None, None, acl(smax), acl(ssum), None,
              acl(out), None)
    if v2:
        ret, ws, ex = aclnn.aclnnFlashAttentionScoreGradV2GetWorkspaceSize(
            *common, None, None, 0.25, 1.0, tokens, tokens, 4, "SBH", 0, 0, 1, acl(dq), acl(dk), acl(dv), None)
        run = aclnn.aclnnFlashAttentionScoreGradV2
    else:
        ret, ws, ex = aclnn.aclnnFlashAttentionScoreGradGetWorkspaceSize(
            *common, 0.25, 1.0, tokens, tokens, 4, "SBH", 0, 0, acl(dq), acl(dk), acl(dv), None)
        run = aclnn.aclnnFlashAttentionScoreGrad
    assert ret == 0, aclnn.aclGetRecentErrMsg()
    assert run(None, ws, ex, None) == 0
    ref_grads = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "SBH", scale_value=0.25, softmax_max=smax,
                                                    softmax_sum=ssum, attention_in=out)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), ref_grads[:3]))


def test_reference_matches_torch_autograd():
    """The float64 reference itself against autograd of plain attention (GQA, Dv < D)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    scale = float(np.float32(0.3))
    p = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * scale, -1)
    out = p @ v.repeat_interleave(2, 1)
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dy)
    plan = AttentionPlan(scale=0.3)
    r_out, r_max, r_sum = flash_attention_forward_reference(q.detach(), k.detach(), v.detach(), plan)
    torch.testing.assert_close(r_out, out.detach())
    grads = flash_attention_backward_reference(q.detach(), k.detach(), v.detach(), dy, r_out, r_max, r_sum, plan)
    for got, leaf in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, leaf.grad)


def test_reference_masking_band_and_invalid_rows():
    """Reference semantics the other tests rely on: -FLT_MAX fill, left-up band, invalid rows, dropout bits."""
    q = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 1] = True                                             # row 1 fully masked
    out, m, s = flash_attention_forward_reference(q, k, v, AttentionPlan(scale=1.0, atten_mask=mask))
    assert m[0, 0, 1] == MASKED_LOGIT and s[0, 0, 1] == 4
    torch.testing.assert_close(out[0, 0, 1], v[0, 0].mean(0))        # uniform attention (normal mode)
    out, m, s = flash_attention_forward_reference(q, k, v, AttentionPlan(scale=1.0, atten_mask=mask,
                                                                         invalid_rows=True))
    assert bool((out[0, 0, 1] == 0).all()) and s[0, 0, 1] > 3e38
    causal = AttentionPlan(scale=1.0, pre_tokens=2147483647, next_tokens=0)
    out, _, _ = flash_attention_forward_reference(q, k, v, causal)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])            # row 0 sees key 0 only
    keep_all = torch.full((2,), 255, dtype=torch.uint8)              # 16 bits, all kept
    dropped = flash_attention_forward_reference(q, k, v, AttentionPlan(scale=1.0, keep_prob=0.5,
                                                                       drop_mask=keep_all))[0]
    plain = flash_attention_forward_reference(q, k, v, AttentionPlan(scale=1.0))[0]
    torch.testing.assert_close(dropped, plain / np.float32(0.5))


@pytest.mark.parametrize("name", ["flash_attention_score_grad", "flash_attention_forward_grad"])
def test_examples_run(name, capsys):
    import importlib
    module = importlib.import_module(f"attngrad.examples.{name}")
    assert module.main() == 0
    printed = capsys.readouterr().out
    assert "result[0]" in printed or "first values" in printed
