"""FlashAttentionScore(Grad) with MLA rope parts (query_rope / key_rope) and an attention sink, against float64.

Rope: the golden is the float64 reference on the concatenated ``[q, q_rope]`` / ``[k, k_rope]`` (a shared k_rope
head repeated over the kv heads; its gradient is the sum over them). Sink: float64 torch autograd of the softmax
over ``[scores, sink]`` with the sink column dropped (dropout applied to the score columns only).
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad import AclnnError, npu
from attngrad.kernels.dropout import generate_drop_mask
from attngrad.kernels.gemm import BRGEMM_DTYPES
from attngrad.kernels.flash_attention_plan import AttentionPlan
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                         flash_attention_forward_reference, keep_mask, logits)
from attngrad.ops.flash_attention import from_bnsd, to_bnsd
from attngrad.precision import assert_close

from helpers import random_tensors

B, N1, N2, SQ, SKV, D, DR = 2, 4, 2, 37, 45, 16, 8
CAUSAL = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _bnsd_inputs(dtype, seed, dr=DR, kr_heads=N2):
    shapes = ((B, N1, SQ, D), (B, N2, SKV, D), (B, N2, SKV, D), (B, N1, SQ, D), (B, N1, SQ, dr), (B, kr_heads, SKV, dr))
    return random_tensors(shapes, dtype, seed)


def _sink_golden(q, k, v, dy, sink, plan):
    """Float64 (out, max, sum, dq, dk, dv, dsink) by autograd of softmax over [S, sink] without the sink column."""
    q, k, v, sink = (t.detach().double().requires_grad_() for t in (q, k, v, sink))
    s = logits(q, k, plan)
    full = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(full, -1)[..., :-1]
    factor = keep_mask(plan, tuple(s.shape))
    out = (p if factor is None else p * factor) @ v.repeat_interleave(N1 // N2, 1)
    out.backward(dy.double())
    m = full.amax(-1)
    return out.detach(), m.detach(), torch.exp(full - m.unsqueeze(-1)).sum(-1).detach(), q.grad, k.grad, v.grad, \
        sink.grad


@pytest.mark.parametrize("layout,dtype,mask", [("BNSD", torch.float32, "causal"), ("BSH", torch.float16, None),
                                               ("SBH", torch.bfloat16, "band"), ("BSND", torch.bfloat16, "causal")])
def test_sink_matches_autograd(layout, dtype, mask):
    q, k, v, dy, _, _ = _bnsd_inputs(dtype, seed=3)
    sink = torch.randn(N1, generator=torch.Generator().manual_seed(4)) * 2
    kw = dict(scale_value=0.3)
    plan_kw = {}
    if mask == "causal":
        kw.update(atten_mask=CAUSAL, sparse_mode=3)      # right-down causal: Skv - Sq extra keys
        plan_kw = dict(next_tokens=SKV - SQ)
    elif mask == "band":
        kw.update(atten_mask=CAUSAL, sparse_mode=4, pre_tokens=5, next_tokens=0)
        plan_kw = dict(pre_tokens=5 + SQ - SKV, next_tokens=SKV - SQ)
    golden = _sink_golden(q, k, v, dy, sink, AttentionPlan(scale=0.3, **plan_kw))
    args = [from_bnsd(t, layout).requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_()
    out, smax, ssum = attngrad.flash_attention_score(*args, N1, layout, sink=sink_leaf, **kw)
    out.backward(from_bnsd(dy, layout))
    assert_close(to_bnsd(out, layout, N1), golden[0], dtype)
    assert_close(smax[..., 0], golden[1], torch.float32)
    assert_close(ssum[..., 0], golden[2], torch.float32)
    for leaf, want, heads in zip(args, golden[3:6], (N1, N2, N2)):
        assert_close(to_bnsd(leaf.grad, layout, heads), want, dtype)
    assert_close(sink_leaf.grad, golden[6], dtype)
    grads = attngrad.flash_attention_score_grad(*(t.detach() for t in args), from_bnsd(dy, layout), N1, layout,
                                                sink=sink, softmax_max=smax, softmax_sum=ssum,
                                                attention_in=out.detach(), **kw)
    assert len(grads) == 7 and grads[3] is None and grads[4] is None and grads[5] is None
    assert torch.equal(grads[6], sink_leaf.grad) and torch.equal(grads[0], args[0].grad)


def test_sink_with_dropout_uses_the_dropped_dp():
    """keep_prob < 1: dsink = -sum Psink * sum_j P dP', dP' = dP * M / keep_prob (the exact gradient)."""
    q, k, v, dy, _, _ = _bnsd_inputs(torch.float32, seed=5)
    sink = torch.randn(N1, generator=torch.Generator().manual_seed(6))
    drop = generate_drop_mask(3, 0, B * N1 * SQ * SKV, 0.8)
    golden = _sink_golden(q, k, v, dy, sink, AttentionPlan(scale=0.25, keep_prob=0.8, drop_mask=drop))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, _, _ = attngrad.flash_attention_score(*leaves[:3], N1, "BNSD", sink=leaves[3], scale_value=0.25,
                                               keep_prob=0.8, drop_mask=drop)
    out.backward(dy)
    assert_close(out, golden[0])
    for leaf, want in zip(leaves, golden[3:]):
        assert_close(leaf.grad, want)


def test_sink_tnd_matches_per_batch():
    """TND: every batch as its own BNSD problem; dsink is the sum over the batches."""
    lens_q, lens_kv = (5, 0, 19), (7, 3, 19)
    dtype = torch.bfloat16
    q, k, v, dy = random_tensors(((24, N1, D), (29, N2, D), (29, N2, D), (24, N1, D)), dtype, seed=9)
    sink = torch.randn(N1)
    cq, ckv = [5, 5, 24], [7, 10, 29]
    kw = dict(scale_value=0.25, actual_seq_qlen=cq, actual_seq_kvlen=ckv, atten_mask=CAUSAL, sparse_mode=3)
    out, smax, _ = attngrad.flash_attention_score(q, k, v, N1, "TND", sink=sink, **kw)
    dq, dk, dv, _, _, _, dsink = attngrad.flash_attention_score_grad(q, k, v, dy, N1, "TND", sink=sink, **kw)
    want_dsink = torch.zeros(N1, dtype=torch.float64)
    q0 = k0 = 0
    for sq, skv in zip(lens_q, lens_kv):
        if sq:
            bq, bk, bv, bdy = (t[r0:r0 + s].permute(1, 0, 2)[None] for t, r0, s in
                               ((q, q0, sq), (k, k0, skv), (v, k0, skv), (dy, q0, sq)))
            g = _sink_golden(bq, bk, bv, bdy, sink, AttentionPlan(scale=0.25, next_tokens=skv - sq))
            assert_close(out[q0:q0 + sq], g[0][0].permute(1, 0, 2), dtype)
            assert_close(dq[q0:q0 + sq], g[3][0].permute(1, 0, 2), dtype)
            assert_close(dk[k0:k0 + skv], g[4][0].permute(1, 0, 2), dtype)
            assert_close(dv[k0:k0 + skv], g[5][0].permute(1, 0, 2), dtype)
            want_dsink += g[6]
        q0, k0 = q0 + sq, k0 + skv
    assert_close(dsink, want_dsink, dtype)
    assert smax.shape == (24, N1, 8)


def _rope_golden(q, k, qr, kr, v, plan):
    """The concatenated ``[q, q_rope]``, ``[k, k_rope]`` (a single k_rope head repeated over the N2 heads) and
    the float64 forward (out, max, sum) on them."""
    qc, kc = torch.cat([q, qr], -1), torch.cat([k, kr.expand(-1, N2, -1, -1)], -1)
    return qc, kc, flash_attention_forward_reference(qc, kc, v, plan)


@pytest.mark.parametrize("layout,dtype,kr_heads", [("BNSD", torch.float32, N2), ("BSND", torch.bfloat16, 1),
                                                   ("BSH", torch.float16, N2), ("SBH", torch.bfloat16, 1)])
def test_rope_matches_concatenated(layout, dtype, kr_heads):
    q, k, v, dy, qr, kr = _bnsd_inputs(dtype, seed=11, kr_heads=kr_heads)
    kw = dict(scale_value=(D + DR) ** -0.5, atten_mask=CAUSAL, sparse_mode=3)
    plan = AttentionPlan(scale=(D + DR) ** -0.5, next_tokens=SKV - SQ)
    lay = [from_bnsd(t, layout) for t in (q, k, v, dy, qr, kr)]
    out, smax, ssum = attngrad.flash_attention_score(*lay[:3], N1, layout, query_rope=lay[4], key_rope=lay[5], **kw)
    qc, kc, (g_out, g_max, g_sum) = _rope_golden(q, k, qr, kr, v, plan)
    assert_close(to_bnsd(out, layout, N1), g_out, dtype)
    assert_close(smax[..., 0], g_max, torch.float32)
    assert_close(ssum[..., 0], g_sum, torch.float32)
    dq, dk, dv, dpse, dqr, dkr, dsink = attngrad.flash_attention_score_grad(
        *lay[:4], N1, layout, query_rope=lay[4], key_rope=lay[5], softmax_max=smax, softmax_sum=ssum,
        attention_in=out, **kw)
    assert dpse is None and dsink is None and dqr.shape == lay[4].shape and dkr.shape == lay[5].shape
    g_dq, g_dk, g_dv = flash_attention_backward_reference(qc, kc, v, dy, to_bnsd(out, layout, N1), smax[..., 0],
                                                          ssum[..., 0], plan)
    g_dkr = g_dk[..., D:].sum(1, keepdim=True) if kr_heads == 1 else g_dk[..., D:]
    for got, want, heads in ((dq, g_dq[..., :D], N1), (dk, g_dk[..., :D], N2), (dv, g_dv, N2),
                             (dqr, g_dq[..., D:], N1), (dkr, g_dkr, kr_heads)):
        assert_close(to_bnsd(got, layout, heads), want, dtype)


@pytest.mark.parametrize("dtype,dr", [(torch.bfloat16, 8), (torch.bfloat16, 7), (torch.float32, 7)])
def test_rope_even_key_blocks_matches_concatenated(dtype, dr):
    """An even key count, so that where torch's brgemm serves bfloat16 the backward runs on it: its ``[K | K_rope]``
    rows go in VNNI pairs, so an odd Dr must take MKL instead; BNSD, no mask."""
    q, k, v, dy = random_tensors(((1, N1, SQ, D), (1, N2, 64, D), (1, N2, 64, D), (1, N1, SQ, D)), dtype, 12)
    qr, kr = random_tensors(((1, N1, SQ, dr), (1, N2, 64, dr)), dtype, 13)
    scale = (D + dr) ** -0.5
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, N1, "BNSD", query_rope=qr, key_rope=kr,
                                                     scale_value=scale)
    plan = AttentionPlan(scale=scale)
    qc, kc, (g_out, g_max, g_sum) = _rope_golden(q, k, qr, kr, v, plan)
    assert_close(out, g_out, dtype)
    assert_close(smax[..., 0], g_max, torch.float32)
    assert_close(ssum[..., 0], g_sum, torch.float32)
    dq, dk, dv, _, dqr, dkr, _ = attngrad.flash_attention_score_grad(
        q, k, v, dy, N1, "BNSD", query_rope=qr, key_rope=kr, softmax_max=smax, softmax_sum=ssum, attention_in=out,
        scale_value=scale)
    g_dq, g_dk, g_dv = flash_attention_backward_reference(qc, kc, v, dy, out, smax[..., 0], ssum[..., 0], plan)
    for got, want in ((dq, g_dq[..., :D]), (dk, g_dk[..., :D]), (dv, g_dv), (dqr, g_dq[..., D:]), (dkr, g_dk[..., D:])):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sq,skv,mode", [(300, 300, 2), (520, 700, 0), (1000, 1000, 3)])
def test_rope_forward_is_the_concatenated_product(sq, skv, mode, dtype):
    """An even Dr and even key blocks, against the float64 golden on the concatenated tensors; where torch's brgemm
    serves the dtype each score tile is also one product of the task's ``[Q | Q_rope]`` rows and the packed
    ``[K | K_rope]^T`` (causal edge tiles too), so the forward has the bits of attngrad's own forward on the
    concatenated tensors."""
    q, qr = random_tensors(((1, N1, sq, 128), (1, N1, sq, 64)), dtype, 14)
    k, v, kr = random_tensors(((1, N2, skv, 128), (1, N2, skv, 128), (1, N2, skv, 64)), dtype, 15)
    kw = dict(scale_value=0.1, **(dict(atten_mask=CAUSAL, sparse_mode=mode) if mode else {}))
    fused = attngrad.flash_attention_score(q, k, v, N1, "BNSD", query_rope=qr, key_rope=kr, **kw)
    qc, kc, golden = _rope_golden(q, k, qr, kr, v, AttentionPlan(scale=0.1, **(dict(next_tokens=0) if mode else {})))
    for i, (got, want) in enumerate(zip(fused, golden)):  # out, then the stats (8 equal columns)
        assert_close(got if i == 0 else got[..., 0], want, got.dtype)
    if dtype in BRGEMM_DTYPES:
        joined = attngrad.flash_attention_score(qc, kc, v, N1, "BNSD", **kw)
        for got, want in zip(fused[:3], joined[:3]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_band_left_edge_cut_with_rope_and_dropout(dtype):
    """A band over several key blocks (pre 300, next 40, Skv 1100: forward blocks of 512, backward blocks of 256
    keys), so that tiles start past their block's first key on every block, with rope (even Dr: the brgemm's
    ``[Q | Q_rope] [K | K_rope]^T`` product where it serves the dtype) and dropout, against float64 on the
    concatenated tensors."""
    s, n1, n2 = 1100, 2, 1
    q, dy, qr = random_tensors(((1, n1, s, 32), (1, n1, s, 32), (1, n1, s, 8)), dtype, 16)
    k, v, kr = random_tensors(((1, n2, s, 32), (1, n2, s, 32), (1, n2, s, 8)), dtype, 17)
    drop = generate_drop_mask(7, 0, n1 * s * s, 0.9)
    kw = dict(scale_value=0.15, keep_prob=0.9, drop_mask=drop, atten_mask=CAUSAL, sparse_mode=4, pre_tokens=300,
              next_tokens=40)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, n1, "BNSD", query_rope=qr, key_rope=kr, **kw)
    plan = AttentionPlan(scale=0.15, pre_tokens=300, next_tokens=40, keep_prob=0.9, drop_mask=drop)
    qc, kc = torch.cat([q, qr], -1), torch.cat([k, kr], -1)
    for i, (got, want) in enumerate(zip((out, smax, ssum), flash_attention_forward_reference(qc, kc, v, plan))):
        assert_close(got if i == 0 else got[..., 0], want, got.dtype)
    dq, dk, dv, _, dqr, dkr, _ = attngrad.flash_attention_score_grad(
        q, k, v, dy, n1, "BNSD", query_rope=qr, key_rope=kr, softmax_max=smax, softmax_sum=ssum, attention_in=out,
        **kw)
    g_dq, g_dk, g_dv = flash_attention_backward_reference(qc, kc, v, dy, out, smax[..., 0], ssum[..., 0], plan)
    for got, want in ((dq, g_dq[..., :32]), (dk, g_dk[..., :32]), (dv, g_dv), (dqr, g_dq[..., 32:]),
                      (dkr, g_dk[..., 32:])):
        assert_close(got, want, dtype)


def test_rope_with_pse_dropout_and_sink_equals_concatenated_fp32():
    """Every feature at once (pse, dropout, band mask, GQA, shared k_rope, sink): the rope path equals attngrad
    on the concatenated tensors (float32: same math, other GEMM split)."""
    q, k, v, dy, qr, kr = _bnsd_inputs(torch.float32, seed=13, kr_heads=1)
    pse = torch.randn(1, N1, SQ, SKV)
    drop = generate_drop_mask(5, 0, B * N1 * SQ * SKV, 0.9)
    sink = torch.randn(N1)
    kw = dict(scale_value=0.2, pse=pse, keep_prob=0.9, drop_mask=drop, atten_mask=CAUSAL, sparse_mode=4,
              pre_tokens=9, next_tokens=3, sink=sink)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, N1, "BNSD", query_rope=qr, key_rope=kr, **kw)
    qc, kc = torch.cat([q, qr], -1), torch.cat([k, kr.expand(-1, N2, -1, -1)], -1)
    ref = attngrad.flash_attention_score(qc, kc, v, N1, "BNSD", **kw)
    for got, want in zip((out, smax, ssum), ref):
        assert_close(got, want.double())
    grads = attngrad.flash_attention_score_grad(q, k, v, dy, N1, "BNSD", query_rope=qr, key_rope=kr, **kw)
    g = attngrad.flash_attention_score_grad(qc, kc, v, dy, N1, "BNSD", **kw)
    want = (g[0][..., :D], g[1][..., :D], g[2], g[3], g[0][..., D:], g[1][..., D:].sum(1, keepdim=True), g[6])
    for got, w in zip(grads, want):
        assert_close(got, w.double())


def test_rope_tnd_shared_key_rope():
    cq, ckv = [9, 9, 30], [12, 20, 33]
    dtype = torch.bfloat16
    q, k, v, dy, qr, kr = random_tensors(((30, N1, D), (33, N2, D), (33, N2, D), (30, N1, D), (30, N1, DR),
                                          (33, 1, DR)), dtype, seed=17)
    kw = dict(scale_value=0.25, actual_seq_qlen=cq, actual_seq_kvlen=ckv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, qr, kr)]
    out, _, _ = attngrad.flash_attention_score(*leaves[:3], N1, "TND", query_rope=leaves[3], key_rope=leaves[4], **kw)
    out.backward(dy)
    qc, kc = torch.cat([q, qr], -1), torch.cat([k, kr.expand(-1, N2, -1)], -1)
    q0 = k0 = 0
    for q1, k1 in zip(cq, ckv):
        if q1 > q0:
            bq, bk, bv, bdy = (t[r0:r1].permute(1, 0, 2)[None] for t, r0, r1 in
                               ((qc, q0, q1), (kc, k0, k1), (v, k0, k1), (dy, q0, q1)))
            plan = AttentionPlan(scale=0.25)
            g_out, g_max, g_sum = flash_attention_forward_reference(bq, bk, bv, plan)
            assert_close(out[q0:q1], g_out[0].permute(1, 0, 2), dtype)
            g_dq, g_dk, _ = flash_attention_backward_reference(bq, bk, bv, bdy, g_out, g_max, g_sum, plan)
            assert_close(leaves[3].grad[q0:q1], g_dq[0, :, :, D:].permute(1, 0, 2), dtype)
            assert_close(leaves[4].grad[k0:k1], g_dk[0, :, :, D:].sum(0)[:, None], dtype)
            assert_close(leaves[1].grad[k0:k1], g_dk[0, :, :, :D].permute(1, 0, 2), dtype)
        q0, k0 = q1, k1


@pytest.mark.parametrize("case,status,param", [
    ("query_rope only", 161001, "keyRope"), ("key_rope only", 161001, "queryRope"),
    ("rope dtype", 161002, "queryRope"), ("rope Dr differs", 161002, "keyRope"),
    ("rope heads", 161002, "keyRope"), ("rope seq", 161002, "queryRope"),
    ("sink dtype", 161002, "sinkIn"), ("sink length", 161002, "sinkIn")])
def test_bad_rope_and_sink(case, status, param):
    q, k, v, dy, qr, kr = _bnsd_inputs(torch.float16, seed=1)
    kw = {"query_rope only": dict(query_rope=qr), "key_rope only": dict(key_rope=kr),
          "rope dtype": dict(query_rope=qr.float(), key_rope=kr),
          "rope Dr differs": dict(query_rope=qr, key_rope=kr[..., :4]),
          "rope heads": dict(query_rope=qr, key_rope=torch.cat([kr, kr[:, :1]], 1)),
          "rope seq": dict(query_rope=qr[:, :, :5], key_rope=kr),
          "sink dtype": dict(sink=torch.zeros(N1, dtype=torch.float16)),
          "sink length": dict(sink=torch.zeros(N1 + 1))}[case]
    for call in (lambda: attngrad.flash_attention_score(q, k, v, N1, "BNSD", **kw),
                 lambda: attngrad.flash_attention_score_grad(q, k, v, dy, N1, "BNSD", **kw)):
        with pytest.raises(AclnnError) as err:
            call()
        assert (err.value.status, err.value.param) == (status, param)


def test_compiled_fullgraph_with_rope_and_sink():
    q, k, v, dy, qr, kr = _bnsd_inputs(torch.float32, seed=21, kr_heads=1)
    sink = torch.randn(N1)

    def attention(q, k, v, qr, kr, sink):
        return attngrad.flash_attention_score(q, k, v, N1, "BNSD", scale_value=0.25, query_rope=qr, key_rope=kr,
                                              sink=sink)[0]

    compiled = torch.compile(attention, fullgraph=True)
    results = []
    for fn in (attention, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, qr, kr, sink)]
        out = fn(*leaves)
        out.backward(dy)
        results.append((out, *(t.grad for t in leaves)))
    for eager, comp in zip(*results):
        assert torch.equal(eager, comp)


def test_npu_v2_names_carry_rope_and_sink():
    q, k, v, dy, qr, kr = _bnsd_inputs(torch.bfloat16, seed=23, kr_heads=1)
    lay = [from_bnsd(t, "BSND") for t in (q, k, v, dy, qr, kr)]
    sink = torch.randn(N1)
    kw = dict(scale_value=0.25, query_rope=lay[4], key_rope=lay[5], sink=sink)
    out, smax, ssum, *_ = npu.npu_fusion_attention_v2(*lay[:3], N1, "BSND", scale=0.25, query_rope=lay[4],
                                                      key_rope=lay[5], sink=sink)
    ref = attngrad.flash_attention_score(*lay[:3], N1, "BSND", **kw)
    assert all(torch.equal(a, b) for a, b in zip((out, smax, ssum), ref))
    grads = npu.npu_fusion_attention_grad_v2(*lay[:4], N1, "BSND", softmax_max=smax, softmax_sum=ssum,
                                             attention_in=out, **kw)
    ref_grads = attngrad.flash_attention_score_grad(*lay[:4], N1, "BSND", softmax_max=smax, softmax_sum=ssum,
                                                    attention_in=out, **kw)
    assert len(grads) == 7 and grads[3].numel() == 0
    assert all(torch.equal(a, b) for a, b in zip(grads[:3] + grads[4:], ref_grads[:3] + ref_grads[4:]))


CQ, CKV = [SQ, 2 * SQ], [SKV, 2 * SKV]   # cumulative lengths of _tnd's two batches
TOKENS = 2147483647


def _tnd(*bnsd):
    """BNSD tensors of the B = 2 batches as contiguous TND (lengths CQ / CKV)."""
    return tuple(x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]).contiguous() for x in bnsd)


def test_aclnn_grad_v3_sink_and_varlen_v3_rope():
    from attngrad import aclnn
    from helpers import acl
    q, k, v, dy, qr, kr = _bnsd_inputs(torch.bfloat16, seed=29)
    sink = torch.randn(N1)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, N1, "BNSD", scale_value=0.25, sink=sink)
    dq, dk, dv, dsink = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros(N1)
    ret, ws, ex = aclnn.aclnnFlashAttentionScoreGradV3GetWorkspaceSize(
        acl(q), acl(k), acl(v), acl(dy), None, None, None, None, acl(smax), acl(ssum), None, acl(out), acl(sink),
        None, None, None, 0.25, 1.0, TOKENS, TOKENS, N1, "BNSD", 0, 0, 1, acl(dq), acl(dk), acl(dv), None,
        acl(dsink))
    assert ret == 0, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnFlashAttentionScoreGradV3(None, ws, ex, None) == 0
    ref = attngrad.flash_attention_score_grad(q, k, v, dy, N1, "BNSD", scale_value=0.25, sink=sink,
                                              softmax_max=smax, softmax_sum=ssum, attention_in=out)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv, dsink), ref[:3] + ref[6:]))
    ret, _, _ = aclnn.aclnnFlashAttentionScoreGradV3GetWorkspaceSize(
        acl(q), acl(k), acl(v), acl(dy), None, None, None, None, acl(smax), acl(ssum), None, acl(out), acl(sink),
        None, None, None, 0.25, 1.0, TOKENS, TOKENS, N1, "BNSD", 0, 0, 1, acl(dq), acl(dk), acl(dv), None,
        acl(torch.zeros(N1 + 1)))
    assert ret == 161002
    # TND rope: forward V3 then grad V3
    t_q = B * SQ
    tq, tk, tv, tdy, tqr, tkr = _tnd(q, k, v, dy, qr, kr)
    o, m8, s8 = torch.zeros(t_q, N1, D, dtype=q.dtype), torch.zeros(t_q, N1, 8), torch.zeros(t_q, N1, 8)
    ret, ws, ex = aclnn.aclnnFlashAttentionVarLenScoreV3GetWorkspaceSize(
        acl(tq), acl(tqr), acl(tk), acl(tkr), acl(tv), None, None, None, None, None, CQ, CKV, None, None, 0.25, 1.0,
        TOKENS, TOKENS, N1, "TND", 0, 0, 1, acl(m8), acl(s8), None, acl(o))
    assert ret == 0, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnFlashAttentionVarLenScoreV3(None, ws, ex, None) == 0
    kw = dict(scale_value=0.25, actual_seq_qlen=CQ, actual_seq_kvlen=CKV, query_rope=tqr, key_rope=tkr)
    assert all(torch.equal(a, b) for a, b in zip((o, m8, s8), attngrad.flash_attention_score(tq, tk, tv, N1, "TND",
                                                                                             **kw)))
    grads = [torch.zeros_like(x) for x in (tq, tqr, tk, tkr, tv)]
    ret, ws, ex = aclnn.aclnnFlashAttentionUnpaddingScoreGradV3GetWorkspaceSize(
        acl(tq), acl(tqr), acl(tk), acl(tkr), acl(tv), acl(tdy), None, None, None, None, acl(m8), acl(s8), None,
        acl(o), None, CQ, CKV, None, None, 0.25, 1.0, TOKENS, TOKENS, N1, "TND", 0, 0, 1, *map(acl, grads), None)
    assert ret == 0, aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnFlashAttentionUnpaddingScoreGradV3(None, ws, ex, None) == 0
    ref = attngrad.flash_attention_score_grad(tq, tk, tv, tdy, N1, "TND", softmax_max=m8, softmax_sum=s8,
                                              attention_in=o, **kw)
    assert all(torch.equal(a, b) for a, b in zip(grads, (ref[0], ref[4], ref[1], ref[5], ref[2])))


def test_aclnn_score_v3_and_varlen_v4_v5(acl_device):
    """aclnnFlashAttentionScoreV3 (sink) and the varlen V4 / V5 APIs (statistics in the input's TND row order; V5
    with rope parts and sink) give the torch functions' results bitwise; a bad sink or softmax layout is 161002."""
    from attngrad import aclnn
    from helpers import acl

    def api(version):
        name = f"aclnnFlashAttention{version}"
        return getattr(aclnn, f"{name}GetWorkspaceSize"), getattr(aclnn, name)

    q, k, v, dy, qr, kr = _bnsd_inputs(torch.bfloat16, seed=29)
    sink = torch.randn(N1)
    results = torch.zeros_like(dy), torch.zeros(B, N1, SQ, 8), torch.zeros(B, N1, SQ, 8)
    dense = [acl(q), acl(k), acl(v), None, None, None, None, acl(sink), None, None, None, 0.25, 1.0, TOKENS, TOKENS,
             N1, "BNSD", 0, 0, 1, acl(results[1]), acl(results[2]), None, acl(results[0])]
    assert acl_device.run(*api("ScoreV3"), *dense) == 0, aclnn.aclGetRecentErrMsg()
    ref = attngrad.flash_attention_score(q, k, v, N1, "BNSD", scale_value=0.25, sink=sink)
    assert all(torch.equal(a, b) for a, b in zip(results, ref))
    dense[7] = acl(sink.half())
    assert acl_device.run(*api("ScoreV3"), *dense) == 161002 and "sinkIn" in aclnn.aclGetRecentErrMsg()

    tq, tk, tv, tdy, tqr, tkr = _tnd(q, k, v, dy, qr, kr)
    out, m8, s8 = torch.zeros_like(tdy), torch.zeros(B * SQ, N1, 8), torch.zeros(B * SQ, N1, 8)
    assert acl_device.run(*api("VarLenScoreV5"), acl(tq), acl(tqr), acl(tk), acl(tkr), acl(tv), None, None, None, None,
                          acl(sink), None, CQ, CKV, None, None, 0.25, 1.0, TOKENS, TOKENS, N1, "TND", 0, 0, 1,
                          "same_as_input", acl(m8), acl(s8), None, acl(out)) == 0, aclnn.aclGetRecentErrMsg()
    kw = dict(scale_value=0.25, actual_seq_qlen=CQ, actual_seq_kvlen=CKV, softmax_layout="TND")
    rope_sink = dict(kw, query_rope=tqr, key_rope=tkr, sink=sink)
    ref = attngrad.flash_attention_score(tq, tk, tv, N1, "TND", **rope_sink)
    assert all(torch.equal(a, b) for a, b in zip((out, m8, s8), ref))
    grads = [torch.zeros_like(x) for x in (tq, tqr, tk, tkr, tv, sink)]
    grad_args = [acl(tq), acl(tqr), acl(tk), acl(tkr), acl(tv), acl(tdy), None, None, None, None, acl(m8), acl(s8),
                 None, acl(out), acl(sink), None, CQ, CKV, None, None, 0.25, 1.0, TOKENS, TOKENS, N1, "TND", 0, 0, 1,
                 "same_as_input", *map(acl, grads[:5]), None, acl(grads[5])]
    assert acl_device.run(*api("UnpaddingScoreGradV5"), *grad_args) == 0, aclnn.aclGetRecentErrMsg()
    ref = attngrad.flash_attention_score_grad(tq, tk, tv, tdy, N1, "TND", softmax_max=m8, softmax_sum=s8,
                                              attention_in=out, **rope_sink)
    assert all(torch.equal(a, b) for a, b in zip(grads, (ref[0], ref[4], ref[1], ref[5], ref[2], ref[6])))
    for at, value, param in ((14, acl(torch.zeros(N1 + 1)), "sinkIn"), (29, "TND", "softmaxInLayout")):
        assert acl_device.run(*api("UnpaddingScoreGradV5"), *grad_args[:at], value, *grad_args[at + 1:]) == 161002
        assert param in aclnn.aclGetRecentErrMsg()

    # V4: V1's parameters with the statistics' order
    assert acl_device.run(*api("VarLenScoreV4"), acl(tq), acl(tk), acl(tv), None, None, None, None, None, CQ, CKV, 0.25,
                          1.0, TOKENS, TOKENS, N1, "TND", 0, 0, "same_as_input", acl(m8), acl(s8), None, acl(out)) == 0
    ref = attngrad.flash_attention_score(tq, tk, tv, N1, "TND", **kw)
    assert all(torch.equal(a, b) for a, b in zip((out, m8, s8), ref))
    grads = [torch.zeros_like(x) for x in (tq, tk, tv)]
    assert acl_device.run(*api("UnpaddingScoreGradV4"), acl(tq), acl(tk), acl(tv), acl(tdy), None, None, None, None,
                          acl(m8), acl(s8), None, acl(out), None, CQ, CKV, 0.25, 1.0, TOKENS, TOKENS, N1, "TND", 0, 0,
                          *map(acl, grads), None, "same_as_input") == 0
    ref = attngrad.flash_attention_score_grad(tq, tk, tv, tdy, N1, "TND", softmax_max=m8, softmax_sum=s8,
                                              attention_in=out, **kw)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref[:3]))


def test_flash_attn_func_sink():
    """flash_attn_func(sink=...) is the BSND contract with the sink; softmax_lse includes the sink logit."""
    q, k, v, dy, _, _ = _bnsd_inputs(torch.float32, seed=31)
    q, k, v, dy = (t.transpose(1, 2) for t in (q, k, v, dy))
    sink = torch.randn(N1)
    out, lse, _ = attngrad.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sink=sink)
    ref, smax, ssum = attngrad.flash_attention_score(q, k, v, N1, "BSND", scale_value=D ** -0.5, sink=sink,
                                                     atten_mask=CAUSAL, sparse_mode=3)
    assert torch.equal(out, ref)
    assert torch.allclose(lse, smax[..., 0] + ssum[..., 0].log())


def test_opcheck_with_rope_and_sink():
    """torch.library's checks (schema, fake kernel, autograd registration) of both ops with the new inputs."""
    from torch.library import opcheck

    from attngrad.ops.flash_attention import score_grad_op_args, score_op_args
    from attngrad.ops.flash_attention_core import split_kwargs

    q, k, v, dy, qr, kr = _bnsd_inputs(torch.float32, seed=37, kr_heads=1)
    sink = torch.randn(N1)
    kwargs = dict(head_num=N1, input_layout="BNSD", scale_value=0.25, query_rope=qr.requires_grad_(),
                  key_rope=kr.requires_grad_(), sink=sink.requires_grad_())
    leaves = [t.requires_grad_() for t in (q, k, v)]
    opcheck(torch.ops.attngrad.flash_attention_score.default, score_op_args(*leaves, *split_kwargs(**kwargs)))
    with torch.no_grad():
        out, smax, ssum = attngrad.flash_attention_score(*leaves, **kwargs)
    detached = {n: (t.detach() if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
    grad_kwargs = dict(detached, softmax_max=smax, softmax_sum=ssum, attention_in=out)
    opcheck(torch.ops.attngrad.flash_attention_score_grad.default,
            score_grad_op_args(*(t.detach() for t in leaves), dy, *split_kwargs(**grad_kwargs)))


@pytest.mark.parametrize("name, printed", [("flash_attention_mla_rope", "dkRope first values"),
                                           ("flash_attention_sink", "dsink rel. error")])
def test_examples_run(name, printed, capsys):
    """The rope and sink examples of ``attngrad examples`` (bfloat16: the kernels this file compiles)."""
    import importlib
    assert importlib.import_module(f"attngrad.examples.{name}").main() == 0
    assert printed in capsys.readouterr().out
