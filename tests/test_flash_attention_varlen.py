"""Varlen (TND) FlashAttentionScore / FlashAttentionScoreGrad against the float64 reference, batch by batch.

The golden of batch b is the plain float64 reference on that batch alone ([1, N1, Sq_b, D] views of the
packed tensors); rows beyond the totals must be exactly 0. Every batch must also equal, bit for bit, the
same problem run alone through the BNSD path (the varlen layer adds no arithmetic of its own).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import attngrad
from attngrad import aclnn, npu
from attngrad.kernels import flash_attention, gemm_paths
from attngrad.kernels.flash_attention_plan import AttentionPlan, varlen_sparse_bands
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                         flash_attention_forward_reference)
from attngrad.ops import flash_attention_varlen as varlen
from attngrad.ops.flash_attention_core import split_kwargs
from attngrad.precision import assert_close

from helpers import acl, same_up_to_gemm_order, varlen_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
Q_LENS, KV_LENS = [19, 0, 33, 7], [25, 0, 33, 30]
TOKENS = 2147483647


def cumulative(lengths):
    return list(itertools.accumulate(lengths))


def batch_rows(q_lens, kv_lens):
    cq, ck = [0] + cumulative(q_lens), [0] + cumulative(kv_lens)
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(q_lens))]


def bnsd(t, r0, r1):
    return t[r0:r1].permute(1, 0, 2).unsqueeze(0)


def tnd(t):
    return t[0].permute(1, 0, 2)


def true_tnd_stats(stats, layout, q_lens, n1):
    """[T1, N1] element 0 in true TND order from stats [T1, N1, 8] in ``layout`` data order."""
    if layout == "TND":
        return stats[..., 0]
    flat, out = stats[..., 0].reshape(-1), torch.zeros(stats.shape[:2])
    for q0, q1, _, _ in batch_rows(q_lens, q_lens):
        out[q0:q1] = flat[q0 * n1:q1 * n1].view(n1, q1 - q0).T
    return out


def golden(q, k, v, dy, out, smax, ssum, q_lens, kv_lens, scale):
    """Float64 packed (out, max, sum, dq, dk, dv); the grad uses the given out and [T1, N1] stats."""
    plan = AttentionPlan(scale=scale)
    g_out = torch.zeros(out.shape, dtype=torch.float64)
    g_max, g_sum = torch.zeros(smax.shape, dtype=torch.float64), torch.zeros(smax.shape, dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for q0, q1, k0, k1 in batch_rows(q_lens, kv_lens):
        if q1 == q0:
            continue
        bq, bk, bv = bnsd(q, q0, q1), bnsd(k, k0, k1), bnsd(v, k0, k1)
        o, m, s = flash_attention_forward_reference(bq, bk, bv, plan)
        g_out[q0:q1], g_max[q0:q1], g_sum[q0:q1] = tnd(o), m[0].T, s[0].T
        gq, gk, gv = flash_attention_backward_reference(bq, bk, bv, bnsd(dy, q0, q1), bnsd(out, q0, q1),
                                                        smax[q0:q1].T[None], ssum[q0:q1].T[None], plan)
        for grad, got, (r0, r1) in zip(grads, (gq, gk, gv), ((q0, q1), (k0, k1), (k0, k1))):
            grad[r0:r1] = tnd(got)
    return g_out, g_max, g_sum, *grads


def run_both(q, k, v, dy, n1, q_lens, kv_lens, scale, layout="", **kw):
    seq = dict(actual_seq_qlen=cumulative(q_lens), actual_seq_kvlen=cumulative(kv_lens), scale_value=scale,
               softmax_layout=layout, **kw)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, n1, "TND", **seq)
    dq, dk, dv, dpse = attngrad.flash_attention_score_grad(q, k, v, dy, n1, "TND", softmax_max=smax,
                                                           softmax_sum=ssum, attention_in=out, **seq)
    assert (dpse is None) == (kw.get("pse") is None or kw.get("pse_type", 1) in (2, 3))
    return out, smax, ssum, dq, dk, dv


def check_golden(q, k, v, dy, n1, q_lens, kv_lens, scale, layout=""):
    out, smax, ssum, dq, dk, dv = run_both(q, k, v, dy, n1, q_lens, kv_lens, scale, layout)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == q.dtype
    assert (out.shape, dq.shape, dk.shape, dv.shape) == (dy.shape, q.shape, k.shape, v.shape)
    assert smax.shape == ssum.shape == (q.shape[0], n1, 8) and smax.dtype == torch.float32
    assert torch.equal(smax, smax[..., :1].expand_as(smax))
    m, s = true_tnd_stats(smax, layout, q_lens, n1), true_tnd_stats(ssum, layout, q_lens, n1)
    want = golden(q, k, v, dy, out, m, s, q_lens, kv_lens, scale)
    used_q, used_kv = sum(q_lens), sum(kv_lens)
    for got, ref, used in zip((out, m, s, dq, dk, dv), want, (used_q,) * 4 + (used_kv,) * 2):
        assert_close(got[:used], ref[:used], q.dtype if got.dtype == q.dtype else torch.float32)
        assert not got[used:].any()                       # rows beyond the totals: exactly 0
    return out, smax, ssum, dq, dk, dv


@pytest.mark.parametrize("layout", ["", "TND"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
def test_golden_tnd(layout, dtype, heads):
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, *heads, 16, 8, dtype)
    check_golden(q, k, v, dy, heads[0], Q_LENS, KV_LENS, 0.25, layout)


@pytest.mark.parametrize("layout", ["", "TND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_golden_tnd_on_widened_tiles(layout, dtype, monkeypatch):
    """The GEMM path of CPUs that multiply 16-bit tiles faster widened: the TND rows are widened into BNSD copies."""
    monkeypatch.setenv(gemm_paths.ENV, gemm_paths.WIDENED)
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 8, dtype)
    check_golden(q, k, v, dy, 4, Q_LENS, KV_LENS, 0.25, layout)


@pytest.mark.parametrize("dtype, path", [(torch.float32, None), (torch.bfloat16, gemm_paths.WIDENED)])
def test_golden_tnd_with_streamed_copies(dtype, path, monkeypatch):
    """Every copy, transposed copy and packing written around the caches (non-temporal stores), as a batch too
    large for them is, against the float64 reference; float32, and bf16 widened into float32 copies."""
    if path is not None:
        monkeypatch.setenv(gemm_paths.ENV, path)
    monkeypatch.setattr(flash_attention, "streams", lambda nbytes: True)
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 32, 32, dtype)
    check_golden(q, k, v, dy, 4, Q_LENS, KV_LENS, 0.25, "TND")


@pytest.mark.parametrize("dtype, path, stream", [(d, None, False) for d in DTYPES]
                         + [(d, gemm_paths.WIDENED, False) for d in (torch.float16, torch.bfloat16)]
                         + [(torch.float32, None, True), (torch.bfloat16, gemm_paths.WIDENED, True)])
def test_each_batch_equals_bnsd_alone(dtype, path, stream, monkeypatch):
    """Batch b of the varlen call == the same problem through the BNSD path (bit for bit where the GEMMs'
    order does not depend on the operands' placement, :func:`helpers.same_up_to_gemm_order`), on this machine's
    GEMM path and on widened tiles; with ``stream`` the kernels' copies and packings are written as those too
    large for the caches are (non-temporal stores)."""
    if path is not None:
        monkeypatch.setenv(gemm_paths.ENV, path)
    if stream:
        monkeypatch.setattr(flash_attention, "streams", lambda nbytes: True)
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 32, 32, dtype, seed=3)
    out, smax, ssum, dq, dk, dv = run_both(q, k, v, dy, 4, Q_LENS, KV_LENS, 0.2, "TND")
    for q0, q1, k0, k1 in batch_rows(Q_LENS, KV_LENS):
        if q1 == q0:
            assert not dk[k0:k1].any() and not dv[k0:k1].any()
            continue
        bq, bk, bv, bdy = (bnsd(t, *r).contiguous() for t, r in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)),
                                                                  (dy, (q0, q1))))
        o, m, s = attngrad.flash_attention_score(bq, bk, bv, 4, "BNSD", scale_value=0.2)
        assert same_up_to_gemm_order(out[q0:q1], tnd(o), dtype)
        assert same_up_to_gemm_order(smax[q0:q1], m[0].permute(1, 0, 2), dtype)
        assert same_up_to_gemm_order(ssum[q0:q1], s[0].permute(1, 0, 2), dtype)
        grads = attngrad.flash_attention_score_grad(bq, bk, bv, bdy, 4, "BNSD", scale_value=0.2, softmax_max=m,
                                                    softmax_sum=s, attention_in=o)
        for got, want in zip((dq[q0:q1], dk[k0:k1], dv[k0:k1]), grads):
            assert same_up_to_gemm_order(got, tnd(want), dtype)


def test_long_and_single_rows():
    """Sequences longer than a kernel tile (256) next to one-row ones; Skv = 1 batch."""
    q_lens, kv_lens = [300, 1, 5], [270, 40, 1]
    q, k, v, dy = varlen_inputs(q_lens, kv_lens, 2, 1, 16, 16, torch.float32, seed=5)
    out, smax, ssum, dq, dk, dv = run_both(q, k, v, dy, 2, q_lens, kv_lens, 0.25)
    want = golden(q, k, v, dy, out, true_tnd_stats(smax, "", q_lens, 2), true_tnd_stats(ssum, "", q_lens, 2),
                  q_lens, kv_lens, 0.25)
    assert_close(out, want[0])
    assert_close(dq[:301], want[3][:301])                 # the Skv = 1 batch has dq = 0 exactly in math
    assert dq[301:].abs().max() < 1e-5
    assert_close(dv, want[5])


def test_padding_rows_and_tail_rule():
    """T beyond the totals: allowed when the arrays end with 0 (disabled batch), or when only one T exceeds."""
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 2, 2, 16, 16, torch.float32, seed=1, extra=(5, 3))
    seq = dict(actual_seq_qlen=cumulative(Q_LENS) + [0], actual_seq_kvlen=cumulative(KV_LENS) + [0])
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 2, "TND", scale_value=0.3, **seq)
    dq, dk, dv, _ = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "TND", scale_value=0.3, softmax_max=smax,
                                                        softmax_sum=ssum, attention_in=out, **seq)
    assert not out[59:].any() and not smax[59:].any() and not dq[59:].any() and not dk[88:].any()
    trimmed = run_both(q[:59], k[:88], v[:88], dy[:59], 2, Q_LENS, KV_LENS, 0.3)
    for got, want in zip((out, smax, ssum, dq, dk, dv), trimmed):
        assert torch.equal(got[:want.shape[0]], want)
    only_q = dict(actual_seq_qlen=cumulative(Q_LENS), actual_seq_kvlen=cumulative(KV_LENS))
    out2, _, _ = attngrad.flash_attention_score(q, k[:88], v[:88], 2, "TND", scale_value=0.3, **only_q)
    assert torch.equal(out2, out)
    with pytest.raises(attngrad.AclnnError, match="must end with 0") as exc:
        attngrad.flash_attention_score(q, k, v, 2, "TND", **only_q)
    assert exc.value.status == 161002


def test_all_batches_disabled_zero_fill():
    q, k, v, dy = varlen_inputs([3], [4], 2, 1, 8, 8, torch.bfloat16)
    seq = dict(actual_seq_qlen=[0, 0], actual_seq_kvlen=[0, 0])
    out, smax, _ = attngrad.flash_attention_score(q, k, v, 2, "TND", **seq)
    grads = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "TND", **seq)[:3]
    assert not out.any() and not smax.any() and not any(g.any() for g in grads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_layouts_and_recompute(dtype):
    """Both data orders describe the same numbers; the grad reads each correctly and equals its recompute."""
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 16, dtype, seed=2)
    seq = dict(actual_seq_qlen=torch.tensor(cumulative(Q_LENS)), actual_seq_kvlen=torch.tensor(cumulative(KV_LENS)))
    results = {lay: run_both(q, k, v, dy, 4, Q_LENS, KV_LENS, 0.25, lay) for lay in ("", "TND")}
    assert torch.equal(true_tnd_stats(results[""][1], "", Q_LENS, 4), results["TND"][1][..., 0])
    assert not torch.equal(results[""][1], results["TND"][1])       # different data orders
    recomputed = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "TND", scale_value=0.25, **seq)[:3]
    for lay in ("", "TND"):
        for got, want in zip(results[lay][3:], recomputed):
            assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["", "TND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_through_flash_attention_score(layout, dtype):
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 8, dtype, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, smax, _ = attngrad.flash_attention_score(*leaves, 4, "TND", actual_seq_qlen=cumulative(Q_LENS),
                                                  actual_seq_kvlen=cumulative(KV_LENS), scale_value=0.25,
                                                  softmax_layout=layout)
    assert not smax.requires_grad
    out.backward(dy)
    explicit = run_both(q, k, v, dy, 4, Q_LENS, KV_LENS, 0.25, layout)
    assert torch.equal(out.detach(), explicit[0]) and torch.equal(smax, explicit[1])
    for leaf, want in zip(leaves, explicit[3:]):
        assert torch.equal(leaf.grad, want)


def test_non_contiguous_inputs():
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 2, 2, 16, 16, torch.float16, seed=6)
    strided = [torch.stack([t, torch.zeros_like(t)], -1)[..., 0] for t in (q, k, v, dy)]
    assert not strided[0].is_contiguous()
    for got, want in zip(run_both(*strided, 2, Q_LENS, KV_LENS, 0.25), run_both(q, k, v, dy, 2, Q_LENS, KV_LENS,
                                                                              0.25)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------- masks, pse, dropout
CAUSAL = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
PREFIX_MASK = torch.cat([CAUSAL, torch.cat([torch.zeros(1024, 1024), torch.ones(1024, 1024)], 1).bool()])
CAUSAL4, PREFIX_MASK4 = CAUSAL[None, None], PREFIX_MASK[None, None]   # [1, 1, ., .] forms for the BNSD calls


def check_batches_equal_bnsd(q, k, v, dy, n1, q_lens, kv_lens, tnd_kw, batch_kw):
    """Every batch of the TND call (forward and grad) == the BNSD call with ``batch_kw(b, sq, skv)``
    (:func:`helpers.same_up_to_gemm_order`)."""
    out, smax, ssum, dq, dk, dv = run_both(q, k, v, dy, n1, q_lens, kv_lens, 0.3, "TND", **tnd_kw)
    for b, (q0, q1, k0, k1) in enumerate(batch_rows(q_lens, kv_lens)):
        if q1 == q0:
            continue
        bq, bk, bv, bdy = (bnsd(t, *r).contiguous() for t, r in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)),
                                                                  (dy, (q0, q1))))
        kw = dict(scale_value=0.3) | batch_kw(b, q1 - q0, k1 - k0)
        o, m, s = attngrad.flash_attention_score(bq, bk, bv, n1, "BNSD", **kw)
        assert same_up_to_gemm_order(out[q0:q1], tnd(o), q.dtype)
        assert same_up_to_gemm_order(smax[q0:q1], m[0].permute(1, 0, 2), q.dtype)
        grads = attngrad.flash_attention_score_grad(bq, bk, bv, bdy, n1, "BNSD", softmax_max=m, softmax_sum=s,
                                                    attention_in=o, **kw)
        for got, want in zip((dq[q0:q1], dk[k0:k1], dv[k0:k1]), grads):
            assert same_up_to_gemm_order(got, tnd(want), q.dtype)
    return out, dq


SS_MASK = torch.rand(33, 33, generator=torch.Generator().manual_seed(7)) < 0.3


@pytest.mark.parametrize("mode,tnd_kw,batch_kw", [
    (0, dict(atten_mask=SS_MASK), lambda b, sq, skv: dict(atten_mask=SS_MASK[:sq, :skv].contiguous())),
    (1, dict(atten_mask=SS_MASK[None, None]), lambda b, sq, skv: dict(atten_mask=SS_MASK[:sq, :skv].contiguous())),
    (2, dict(atten_mask=CAUSAL), lambda b, sq, skv: dict(atten_mask=CAUSAL4)),
    (3, dict(atten_mask=CAUSAL), lambda b, sq, skv: dict(atten_mask=CAUSAL4)),
    (4, dict(atten_mask=CAUSAL, pre_tokens=5, next_tokens=2),
     lambda b, sq, skv: dict(atten_mask=CAUSAL4, pre_tokens=5, next_tokens=2)),
    (6, dict(atten_mask=PREFIX_MASK, prefix=[10, 0, 5, 25]),
     lambda b, sq, skv: dict(atten_mask=PREFIX_MASK4, prefix=[[10, 0, 5, 25][b]])),
    (7, dict(atten_mask=CAUSAL, pre_tokens=40, next_tokens=-3),      # band batch: the last non-empty (3)
     lambda b, sq, skv: dict(atten_mask=CAUSAL4, pre_tokens=40, next_tokens=-3, sparse_mode=4 if b == 3 else 3)),
    (8, dict(atten_mask=CAUSAL, pre_tokens=30, next_tokens=-2),      # band batch: the first non-empty (0)
     lambda b, sq, skv: dict(atten_mask=CAUSAL4, pre_tokens=30, next_tokens=-2, sparse_mode=4 if b == 0 else 2)),
])
def test_sparse_modes_per_batch(mode, tnd_kw, batch_kw):
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 16, torch.bfloat16, seed=11)
    check_batches_equal_bnsd(q, k, v, dy, 4, Q_LENS, KV_LENS, dict(sparse_mode=mode) | tnd_kw,
                             lambda b, sq, skv: dict(sparse_mode=mode) | batch_kw(b, sq, skv))


@pytest.mark.parametrize("pre,nxt", [(2, 0), (TOKENS, 0), (0, 1)])
def test_band_on_batches_without_rows_or_keys(pre, nxt):
    """Sparse mode 4 tokens that select no key of an Sq_b x 0 or a 0 x Skv_b batch are legal: an empty batch
    has nothing to select (its rows are 0), as in BNSD, where Sq or Skv 0 also takes any tokens."""
    q_lens, kv_lens = [9, 3, 0, 5], [7, 0, 6, 5]
    q, k, v, dy = varlen_inputs(q_lens, kv_lens, 2, 2, 16, 16, torch.float32, seed=3)
    kw = dict(sparse_mode=4, atten_mask=CAUSAL, pre_tokens=pre, next_tokens=nxt)
    out, _ = check_batches_equal_bnsd(q, k, v, dy, 2, q_lens, kv_lens, kw, lambda b, sq, skv: kw | {
        "atten_mask": CAUSAL4})
    assert torch.equal(out[9:12], torch.zeros_like(out[9:12]))


@pytest.mark.parametrize("mode", [7, 8])
def test_split_modes_follow_the_plan_rule(mode):
    """The per-batch plans of modes 7/8 carry the bands of the plan module's rule ``varlen_sparse_bands``."""
    q, k, v, _ = varlen_inputs(Q_LENS, KV_LENS, 2, 2, 8, 8, torch.float32)
    problem = varlen.check_forward(q, k, v, *split_kwargs(2, "TND", actual_seq_qlen=cumulative(Q_LENS),
                                                          actual_seq_kvlen=cumulative(KV_LENS), atten_mask=CAUSAL,
                                                          sparse_mode=mode, pre_tokens=40, next_tokens=-2))
    want = varlen_sparse_bands(mode, 40, -2, Q_LENS, KV_LENS)
    assert [(p.pre_tokens, p.next_tokens) for p in problem.plans] == want


def test_causal_golden_and_no_mask_means_full():
    """Mode 3 against the float64 reference with a right-down causal band per batch; without attenMask the
    sparse mode has no effect (docs/cann-semantics.md, 'Masks and sparse modes')."""
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 2, 1, 16, 16, torch.float32, seed=12)
    out, *_ = run_both(q, k, v, dy, 2, Q_LENS, KV_LENS, 0.3, "TND", atten_mask=CAUSAL, sparse_mode=3)
    for q0, q1, k0, k1 in batch_rows(Q_LENS, KV_LENS):
        if q1 > q0:
            plan = AttentionPlan(scale=0.3, next_tokens=(k1 - k0) - (q1 - q0))
            want = flash_attention_forward_reference(bnsd(q, q0, q1), bnsd(k, k0, k1), bnsd(v, k0, k1), plan)[0]
            assert_close(out[q0:q1], tnd(want))
    full = run_both(q, k, v, dy, 2, Q_LENS, KV_LENS, 0.3, "TND")
    for got, want in zip(run_both(q, k, v, dy, 2, Q_LENS, KV_LENS, 0.3, "TND", sparse_mode=3), full):
        assert torch.equal(got, want)


def _blocks(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("form", ["BNSS", "BN1S"])
def test_pse_flattened_forms(pse_type, form):
    q_lens, kv_lens = [19, 33, 7], [25, 33, 30]
    q, k, v, dy = varlen_inputs(q_lens, kv_lens, 4, 2, 16, 16, torch.float16, seed=13)
    shapes = [(4, sq if form == "BNSS" else 1, skv) for sq, skv in zip(q_lens, kv_lens)]
    blocks = _blocks(shapes, torch.float16, 14)
    flat = torch.cat([b.reshape(-1) for b in blocks])
    check_batches_equal_bnsd(q, k, v, dy, 4, q_lens, kv_lens, dict(pse=flat, pse_type=pse_type),
                             lambda b, sq, skv: dict(pse=blocks[b][None], pse_type=pse_type))
    seq = dict(actual_seq_qlen=cumulative(q_lens), actual_seq_kvlen=cumulative(kv_lens), pse_type=pse_type)
    dpse = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "TND", pse=flat, **seq)[3]
    want = []
    for (q0, q1, k0, k1), block in zip(batch_rows(q_lens, kv_lens), blocks):
        args = (bnsd(t, *r).contiguous() for t, r in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)), (dy, (q0, q1))))
        want.append(attngrad.flash_attention_score_grad(*args, 4, "BNSD", pse=block[None], pse_type=pse_type)[3])
    assert dpse.shape == flat.shape and torch.equal(dpse, torch.cat([w.reshape(-1) for w in want]))


@pytest.mark.parametrize("pse_type,form", [(0, "BNSS"), (1, "BN1S")])
def test_autograd_with_respect_to_pse(pse_type, form):
    """Varlen autograd returns dpse like the dense path: against autograd of a float64 torch composition."""
    q_lens, kv_lens, n1, scale = [5, 9], [7, 9], 4, 0.3
    q, k, v, dy = varlen_inputs(q_lens, kv_lens, n1, 2, 8, 8, torch.float32, seed=21, extra=(2, 0))
    rows = [sq if form == "BNSS" else 1 for sq in q_lens]
    pse = torch.cat([b.reshape(-1) for b in _blocks([(n1, r, skv) for r, skv in zip(rows, kv_lens)],
                                                    torch.float32, 22)])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pse)]
    out = attngrad.flash_attention_score(*leaves[:3], n1, "TND", pse=leaves[3], pse_type=pse_type,
                                         scale_value=scale, actual_seq_qlen=cumulative(q_lens),
                                         actual_seq_kvlen=cumulative(kv_lens))[0]
    out.backward(dy)
    golden = [t.double().requires_grad_() for t in (q, k, v, pse)]
    want = torch.autograd.grad(_torch_varlen(*golden, q_lens, kv_lens, rows, pse_type, scale), golden, dy.double())
    for leaf, w in zip(leaves, want):
        assert_close(leaf.grad, w, torch.float32)


def _torch_varlen(q, k, v, pse, q_lens, kv_lens, pse_rows, pse_type, scale):
    """Plain torch composition of TND attention with a flattened float pse ([N1, rows_b, Skv_b] per batch)."""
    n1, start, parts = q.shape[1], 0, []
    for (q0, q1, k0, k1), rows in zip(batch_rows(q_lens, kv_lens), pse_rows):
        bq, bk, bv = bnsd(q, q0, q1), bnsd(k, k0, k1), bnsd(v, k0, k1)
        bk, bv = (t.repeat_interleave(n1 // k.shape[1], 1) for t in (bk, bv))
        bias = pse[start:start + n1 * rows * (k1 - k0)].view(1, n1, rows, k1 - k0)
        start += bias.numel()
        qk = bq @ bk.transpose(-1, -2)
        scores = (qk + bias) * scale if pse_type == 1 else qk * scale + bias
        parts.append(tnd(torch.softmax(scores, -1) @ bv))
    tail = torch.zeros(q.shape[0] - sum(q_lens), n1, v.shape[2], dtype=q.dtype)
    return torch.cat([*parts, tail])


@pytest.mark.parametrize("pse_type,per_batch", [(2, False), (3, True)])
def test_pse_generated_alibi_slopes(pse_type, per_batch):
    lens = [19, 33, 7]
    q, k, v, dy = varlen_inputs(lens, lens, 4, 2, 16, 16, torch.float32, seed=15)
    slopes = torch.rand(3, 4) if per_batch else torch.rand(4)
    kw = dict(pse_type=pse_type, q_start_idx=[3], kv_start_idx=[1])
    check_batches_equal_bnsd(q, k, v, dy, 4, lens, lens, dict(pse=slopes) | kw,
                             lambda b, sq, skv: dict(pse=slopes[b:b + 1] if per_batch else slopes) | kw)


def test_pse_alibi_compressed_window():
    """[1, N1, 1024, maxSkv]: batch b reads rows 1024 - Sq_b.. and columns maxSkv - Skv_b..
    (docs/cann-semantics.md, 'Varlen (TND)')."""
    lens = [19, 33, 7]
    q, k, v, dy = varlen_inputs(lens, lens, 2, 2, 16, 16, torch.float32, seed=16)
    pse = torch.randn(1, 2, 1024, 33)
    kw = dict(atten_mask=CAUSAL4, sparse_mode=3)
    check_batches_equal_bnsd(q, k, v, dy, 2, lens, lens, dict(pse=pse) | kw,
                             lambda b, sq, skv: dict(pse=pse[:, :, 1024 - sq:, 33 - skv:].contiguous()) | kw)


@pytest.mark.parametrize("q_lens,kv_lens,kw,param", [
    (Q_LENS, KV_LENS, dict(pse=torch.zeros(4 * 88)), "pse"),                       # zero-length batch
    ([19, 33], [25, 33], dict(pse=torch.zeros(4 * 58), sparse_mode=7, atten_mask=CAUSAL), "pse"),
    ([19, 33], [25, 33], dict(pse=torch.zeros(4 * 57)), "pse"),                     # no TND form
    ([19, 33], [25, 33], dict(pse=torch.zeros(1, 4, 1024, 33)), "pse"),             # compressed needs Sq == Skv
    ([19, 33], [19, 33], dict(pse=torch.zeros(4), pse_type=2, sparse_mode=8, atten_mask=CAUSAL,
                              q_start_idx=[2]), "qStartIdx"),
    ([19, 33], [25, 33], dict(keep_prob=0.5, drop_mask=torch.zeros(100, dtype=torch.uint8)), "dropMask"),
    ([19, 33], [25, 33], dict(atten_mask=torch.zeros(19, 33, dtype=torch.bool)), "attenMask"),
    ([19, 33], [25, 33], dict(atten_mask=CAUSAL[:33, :33], sparse_mode=3), "attenMask"),
])
def test_invalid_tnd_options(q_lens, kv_lens, kw, param):
    q, k, v, _ = varlen_inputs(q_lens, kv_lens, 4, 4, 8, 8, torch.float32)
    with pytest.raises(attngrad.AclnnError) as exc:
        attngrad.flash_attention_score(q, k, v, 4, "TND", actual_seq_qlen=cumulative(q_lens),
                                       actual_seq_kvlen=cumulative(kv_lens), **kw)
    assert (exc.value.status, exc.value.param) == (161002, param), str(exc.value)


def test_dropout_bit_blocks_per_batch():
    """Batch b reads the bits from N1 * sum_{b'<b} Sq_b' Skv_b' on (offsets not byte-aligned)."""
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 3, 1, 16, 16, torch.float32, seed=17)
    total = 3 * sum(a * b for a, b in zip(Q_LENS, KV_LENS))
    drop = torch.randint(0, 256, ((total + 7) // 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    bits = np.unpackbits(drop.numpy(), bitorder="little")
    starts = [0, *itertools.accumulate(3 * a * b for a, b in zip(Q_LENS, KV_LENS))]

    def batch_kw(b, sq, skv):
        own = np.packbits(bits[starts[b]:starts[b] + 3 * sq * skv], bitorder="little")
        return dict(keep_prob=0.75, drop_mask=torch.from_numpy(own))
    assert starts[3] % 8 != 0
    out, _ = check_batches_equal_bnsd(q, k, v, dy, 3, Q_LENS, KV_LENS, dict(keep_prob=0.75, drop_mask=drop),
                                      batch_kw)
    plain = run_both(q, k, v, dy, 3, Q_LENS, KV_LENS, 0.3, "TND")[0]
    assert not torch.equal(out, plain)


# ------------------------------------------------------------------------------------------ validation
def _seq_error(qlen, kvlen, t=(59, 88), **kw):
    q, k, v, _ = varlen_inputs([t[0]], [t[1]], 2, 2, 8, 8, torch.float32)
    with pytest.raises(attngrad.AclnnError) as exc:
        attngrad.flash_attention_score(q, k, v, 2, "TND", actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, **kw)
    return exc.value


@pytest.mark.parametrize("qlen,kvlen,status,param", [
    (None, [88], 161001, "actualSeqQLen"),
    ([59], None, 161001, "actualSeqKvLen"),
    ([], [], 161002, "actualSeqQLen"),
    ([19, 59], [88], 161002, "actualSeqKvLen"),           # counts differ
    ([19, 10, 59], [25, 50, 88], 161002, "actualSeqQLen"),  # not cumulative (decreasing)
    ([-1, 59], [25, 88], 161002, "actualSeqQLen"),        # negative length
    ([19, 60], [25, 88], 161002, "query"),                # total beyond T1
    ([19, 59], [25, 89], 161002, "key"),                  # total beyond T2
    ([19, 58], [25, 87], 161002, "actualSeqQLen"),        # both T exceed the totals, no trailing 0
    ([19.0, 59], [25, 88], 161002, "actualSeqQLen"),      # not integers
    (torch.tensor([19.0, 59.0]), [25, 88], 161002, "actualSeqQLen"),
])
def test_invalid_sequence_lengths(qlen, kvlen, status, param):
    err = _seq_error(qlen, kvlen)
    assert (err.status, err.param) == (status, param), str(err)


@pytest.mark.parametrize("kw,param", [
    (dict(softmax_layout="BSND"), "softmaxLayout"),
    (dict(sparse_mode=5), "sparseMode"),
    (dict(sparse_mode=9), "sparseMode"),
    (dict(pse_type=4), "pseType"),
])
def test_invalid_attributes(kw, param):
    err = _seq_error([19, 59], [25, 88], **kw)
    assert (err.status, err.param) == (161002, param), str(err)


def test_invalid_shapes():
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 8, torch.float32)
    seq = dict(actual_seq_qlen=cumulative(Q_LENS), actual_seq_kvlen=cumulative(KV_LENS))
    cases = [((q[None], k, v), "query"), ((q, k, v[:, :1]), "value"), ((q, k[..., :8], v), "key"),
             ((q.half(), k, v), "key")]
    for args, param in cases:
        with pytest.raises(attngrad.AclnnError) as exc:
            attngrad.flash_attention_score(*args, 4, "TND", **seq)
        assert (exc.value.status, exc.value.param) == (161002, param), str(exc.value)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 4, "TND", **seq)
    for kw, param in ((dict(softmax_max=smax[:-1]), "softmaxMax"), (dict(softmax_sum=ssum.double()), "softmaxSum"),
                      (dict(attention_in=out[..., :4]), "attentionIn")):
        given = dict(softmax_max=smax, softmax_sum=ssum, attention_in=out) | kw
        with pytest.raises(attngrad.AclnnError) as exc:
            attngrad.flash_attention_score_grad(q, k, v, dy, 4, "TND", **seq, **given)
        assert (exc.value.status, exc.value.param) == (161002, param), str(exc.value)
    with pytest.raises(attngrad.AclnnError) as exc:
        attngrad.flash_attention_score_grad(q, k, v, dy, 4, "TND", softmax_max=smax, **seq)
    assert exc.value.status == 161001


# ----------------------------------------------------------------------------------------- interfaces


@pytest.mark.parametrize("v2", [False, True])
def test_aclnn_varlen_forward_then_grad(v2):
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 16, torch.bfloat16, seed=8, extra=(2, 2))
    cq, ck = aclnn.aclCreateIntArray(cumulative(Q_LENS) + [0], 5), aclnn.aclCreateIntArray(cumulative(KV_LENS) + [0], 5)
    out, smax, ssum = torch.zeros_like(dy), torch.zeros(q.shape[0], 4, 8), torch.zeros(q.shape[0], 4, 8)
    head = (acl(q), acl(k), acl(v), None, None, None, None, None, cq, ck)
    attrs = (0.25, 1.0, TOKENS, TOKENS, 4, "TND", 0, 0)
    outs = (acl(smax), acl(ssum), None, acl(out))
    if v2:
        ret, ws, ex = aclnn.aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize(*head, None, None, *attrs, 1, *outs)
        run = aclnn.aclnnFlashAttentionVarLenScoreV2
    else:
        ret, ws, ex = aclnn.aclnnFlashAttentionVarLenScoreGetWorkspaceSize(*head, *attrs, *outs)
        run = aclnn.aclnnFlashAttentionVarLenScore
    assert (ret, ws) == (0, 0), aclnn.aclGetRecentErrMsg()
    assert run(None, ws, ex, None) == 0
    seq = dict(actual_seq_qlen=cumulative(Q_LENS) + [0], actual_seq_kvlen=cumulative(KV_LENS) + [0],
               scale_value=0.25)
    ref = attngrad.flash_attention_score(q, k, v, 4, "TND", **seq)
    assert all(torch.equal(a, b) for a, b in zip((out, smax, ssum), ref))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    head = (acl(q), acl(k), acl(v), acl(dy), None, None, None, None, acl(smax), acl(ssum), None, acl(out),
            None, cq, ck)
    grads_out = (acl(dq), acl(dk), acl(dv), None)
    if v2:
        ret, ws, ex = aclnn.aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize(*head, None, None, *attrs, 1,
                                                                                    *grads_out)
        run = aclnn.aclnnFlashAttentionUnpaddingScoreGradV2
    else:
        ret, ws, ex = aclnn.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(*head, *attrs, *grads_out)
        run = aclnn.aclnnFlashAttentionUnpaddingScoreGrad
    assert ret == 0, aclnn.aclGetRecentErrMsg()
    assert run(None, ws, ex, None) == 0
    ref_grads = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "TND", softmax_max=smax, softmax_sum=ssum,
                                                    attention_in=out, **seq)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), ref_grads[:3]))


def test_aclnn_varlen_statuses():
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 2, 2, 8, 8, torch.float32)
    cq, ck = aclnn.aclCreateIntArray(cumulative(Q_LENS), 4), aclnn.aclCreateIntArray(cumulative(KV_LENS), 4)
    out, smax, ssum = torch.zeros_like(dy), torch.zeros(q.shape[0], 2, 8), torch.zeros(q.shape[0], 2, 8)

    def forward(layout="TND", qlen=cq, stats=smax):
        return aclnn.aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
            acl(q), acl(k), acl(v), None, None, None, None, None, qlen, ck, 1.0, 1.0, TOKENS, TOKENS, 2, layout,
            0, 0, acl(stats), acl(ssum), None, acl(out))[0]
    assert forward() == 0
    assert forward(layout="BSND") == 161002
    assert forward(qlen=None) == 161001
    assert forward(qlen=aclnn.aclCreateIntArray([19, 19, 52], 3)) == 161002
    assert forward(stats=torch.zeros(q.shape[0], 2, 4)) == 161002
    assert forward(stats=None) == 161001
    grad = aclnn.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize
    common = (acl(q), acl(k), acl(v), acl(dy), None, None, None, None)
    tail = (None, cq, ck, 1.0, 1.0, TOKENS, TOKENS, 2, "TND", 0, 0)
    assert grad(*common, None, None, None, None, *tail, acl(q.clone()), acl(k.clone()), acl(v.clone()),
                None)[0] == 161001                                          # stats and attentionIn required
    empty = torch.zeros(0)
    assert grad(*common, acl(smax), acl(ssum), None, acl(out), *tail, acl(empty), acl(empty), acl(empty),
                None)[0] == 0                                               # all outputs empty: success


def test_npu_tnd_paths():
    q, k, v, dy = varlen_inputs(Q_LENS, KV_LENS, 4, 2, 16, 16, torch.float16, seed=9)
    cq, ck = cumulative(Q_LENS), cumulative(KV_LENS)
    out, smax, ssum, softmax_out, seed, offset, numels = npu.npu_fusion_attention(
        q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=cq, actual_seq_kvlen=ck, softmax_layout="TND")
    assert numels == 4 * sum(a * b for a, b in zip(Q_LENS, KV_LENS)) and softmax_out.numel() == 0
    ref = attngrad.flash_attention_score(q, k, v, 4, "TND", scale_value=0.25, actual_seq_qlen=cq,
                                         actual_seq_kvlen=ck, softmax_layout="TND")
    assert all(torch.equal(a, b) for a, b in zip((out, smax, ssum), ref))
    for grad_fn, extra in ((npu.npu_fusion_attention_grad, 1), (npu.npu_fusion_attention_grad_v2, 3)):
        res = grad_fn(q, k, v, dy, 4, "TND", softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.25,
                      actual_seq_qlen=cq, actual_seq_kvlen=ck, softmax_layout="TND")
        assert len(res) == 4 + extra
        want = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "TND", softmax_max=smax, softmax_sum=ssum,
                                                   attention_in=out, scale_value=0.25, actual_seq_qlen=cq,
                                                   actual_seq_kvlen=ck, softmax_layout="TND")
        assert all(torch.equal(a, b) for a, b in zip(res[:3], want[:3]))


def test_example_runs(capsys):
    from attngrad.examples import flash_attention_varlen
    assert flash_attention_varlen.main() == 0
    assert "dq" in capsys.readouterr().out
