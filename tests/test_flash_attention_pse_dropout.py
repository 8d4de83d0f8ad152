"""FlashAttention pse (types 0-3, every shape, dpse) and dropout against the reference (docs/cann-semantics.md,
'Position shift (pse)' and 'Dropout')."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attngrad
from attngrad import AclnnError, npu
from attngrad.kernels.dropout import generate_drop_mask
from attngrad.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from attngrad.kernels.flash_attention_plan import alibi_source
from attngrad.kernels.flash_attention_reference import (dense_pse, flash_attention_backward_reference,
                                                        flash_attention_dpse_reference,
                                                        flash_attention_forward_reference)
from attngrad.ops.flash_attention import check_forward, from_bnsd, to_bnsd
from attngrad.ops.flash_attention_core import split_kwargs
from attngrad.precision import assert_close

from helpers import attention_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["BSH", "SBH", "BSND", "BNSD"]
B, N1, N2, D = 2, 4, 2, 16
SCALE = 0.25


def check(layout, dtype, sq, skv, b=B, seed=0, **kw):
    """Forward, grad (dq/dk/dv/dpse) through the torch API against the reference on the contract's plan."""
    q, k, v, dy = attention_inputs(layout, b, N1, N2, sq, skv, D, D, dtype, seed)
    kw.setdefault("scale_value", SCALE)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, N1, layout, **kw)
    dq, dk, dv, dpse = attngrad.flash_attention_score_grad(q, k, v, dy, N1, layout, softmax_max=smax,
                                                           softmax_sum=ssum, attention_in=out, **kw)
    plan = check_forward(q, k, v, *split_kwargs(N1, layout, **kw)).plan
    bq, bk, bv, bdy = (to_bnsd(t, layout, n) for t, n in ((q, N1), (k, N2), (v, N2), (dy, N1)))
    g_out, g_max, g_sum = flash_attention_forward_reference(bq, bk, bv, plan)
    assert_close(to_bnsd(out, layout, N1), g_out, dtype)
    assert_close(smax[..., 0], g_max, torch.float32)
    assert_close(ssum[..., 0], g_sum, torch.float32)
    given = (to_bnsd(out, layout, N1), smax[..., 0], ssum[..., 0])
    golden = flash_attention_backward_reference(bq, bk, bv, bdy, *given, plan)
    for got, want, n in zip((dq, dk, dv), golden, (N1, N2, N2)):
        assert_close(to_bnsd(got, layout, n), want, dtype)
    pse = kw.get("pse")
    if pse is not None and kw.get("pse_type", 1) in (0, 1):
        assert dpse.shape == pse.shape and dpse.dtype == pse.dtype
        assert_close(dpse, flash_attention_dpse_reference(bq, bk, bv, bdy, *given, plan), dtype)
    else:
        assert dpse is None
    return out, dq


def rand(*shape, dtype=torch.float32, seed=5):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


PSE_SHAPES = ["BN1S", "BNSS", "1NSS"]


def pse_dims(shape, sq, skv):
    """The dims of a dense pse of one of PSE_SHAPES."""
    return {"BN1S": (B, N1, 1, skv), "BNSS": (B, N1, sq, skv), "1NSS": (1, N1, sq, skv)}[shape]


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("shape", PSE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_external_pse_shapes_and_dpse(pse_type, shape, dtype):
    sq, skv = 270, 300
    layout = LAYOUTS[(len(shape) + pse_type) % 4]
    mask = torch.rand(sq, skv, generator=torch.Generator().manual_seed(3)) < 0.1
    check(layout, dtype, sq, skv, pse=rand(*pse_dims(shape, sq, skv), dtype=dtype), pse_type=pse_type,
          atten_mask=mask, pre_tokens=200, next_tokens=30)


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("shape", PSE_SHAPES)
def test_external_pse_without_a_mask(pse_type, shape):
    """No mask to test on any tile: the backward forms the logits with the pse inside its exp sweep (pse_type 1
    with dropout)."""
    sq, skv = 270, 300
    dtype = DTYPES[(PSE_SHAPES.index(shape) + pse_type) % 3]
    drop = torch.randint(0, 256, (B * N1 * sq * skv // 8 + 1,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(4))
    dropout = dict(keep_prob=0.8, drop_mask=drop) if pse_type else {}
    pse = rand(*pse_dims(shape, sq, skv), dtype=dtype)
    check(LAYOUTS[(shape.count("S") + pse_type) % 4], dtype, sq, skv, pse=pse, pse_type=pse_type, **dropout)


@pytest.mark.parametrize("pse_type", [0, 1])
def test_alibi_compressed_pse(pse_type):
    """[B|1, N1, 1024, Skv] with Sq == Skv > 1024 and a causal mode: the compressed form's reconstruction rule."""
    s, heads = 1100, 1
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(1, heads, s, 8, generator=g) for _ in range(4))
    comp = torch.randn(1, heads, 1024, s, generator=g)
    triu = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    plan = check_forward(q, k, v, *split_kwargs(heads, "BNSD", pse=comp, pse_type=pse_type, atten_mask=triu,
                                                sparse_mode=2, scale_value=0.3)).plan
    assert plan.pse_compressed
    out, m, l = flash_attention_forward(q, k, v, plan)
    r_out, r_max, r_sum = flash_attention_forward_reference(q, k, v, plan)
    assert_close(out, r_out, torch.float32)
    dq, dk, dv, dpse = flash_attention_backward(q, k, v, dy, out, m, l, plan, with_dpse=True)[:4]
    for got, want in zip((dq, dk, dv), flash_attention_backward_reference(q, k, v, dy, out, m, l, plan)):
        assert_close(got, want, torch.float32)
    assert_close(dpse, flash_attention_dpse_reference(q, k, v, dy, out, m, l, plan), torch.float32)
    full = dense_pse(plan, comp, s, s)[0, 0]        # row i < Sq - 1024: comp[m = i % 1024, Skv-(i-j)-(1024-m)]
    assert full[70, 30] == comp[0, 0, 70, s - 40 - (1024 - 70)] and full[80, 7] == comp[0, 0, 80 - (s - 1024), 7]
    for i, j in ((70, 30), (80, 7), (1099, 1099), (3, 0)):
        assert full[i, j] == comp[0, 0, alibi_source(i, j, s, s)[0], alibi_source(i, j, s, s)[1]]


@pytest.mark.parametrize("pse_type", [2, 3])
@pytest.mark.parametrize("slopes", ["N", "BN"])
@pytest.mark.parametrize("starts", [(None, None), ([5], [2]), ([0], [7])])
def test_generated_alibi(pse_type, slopes, starts):
    s = 290
    pse = torch.rand(N1 if slopes == "N" else (B, N1), generator=torch.Generator().manual_seed(2))
    layout = LAYOUTS[(pse_type + len(slopes)) % 4]
    dtype = DTYPES[(pse_type + (starts[0] or [0])[0]) % 3]
    check(layout, dtype, s, s, pse=pse, pse_type=pse_type, q_start_idx=starts[0], kv_start_idx=starts[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_generated_alibi_with_probabilities_at_the_end_of_float32(dtype):
    # every row has keys 145 or more positions away, where slopes of 0.6-1.2 take logit - max past -87.3, the end
    # of float32's normal range for exp(logit - max) (P, and dS = P (dP - Dr), subnormal there); the forward's
    # P V and the backward flush subnormals, and the results still match the reference; the calling thread's float
    # mode (it runs tiles too) is the one it had
    s = 290
    drop = generate_drop_mask(3, 0, B * N1 * s * s, 0.9)
    check("BNSD", dtype, s, s, pse=torch.linspace(0.6, 1.2, N1), pse_type=2, keep_prob=0.9, drop_mask=drop)
    assert np.float32(1e-38) * np.float32(0.01) > 0


@pytest.mark.parametrize("keep_prob", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout(keep_prob, dtype):
    sq, skv = 260, 300
    drop = generate_drop_mask(7, 0, B * N1 * sq * skv, keep_prob)
    out, _ = check(LAYOUTS[int(keep_prob * 10) % 4], dtype, sq, skv, keep_prob=keep_prob, drop_mask=drop)
    if keep_prob == 1.0:  # the mask is ignored
        q, k, v, _ = attention_inputs(LAYOUTS[2], B, N1, N2, sq, skv, D, D, dtype)
        assert torch.equal(out, attngrad.flash_attention_score(q, k, v, N1, "BSND", scale_value=SCALE)[0])


@pytest.mark.parametrize("layout,dtype", list(zip(LAYOUTS, DTYPES + [torch.bfloat16])))
def test_dropout_pse_mask_gqa_together(layout, dtype):
    sq, skv = 300, 280
    drop = generate_drop_mask(1, 64, B * N1 * sq * skv, 0.8)
    check(layout, dtype, sq, skv, pse=rand(B, N1, sq, skv, dtype=dtype), pse_type=0, keep_prob=0.8,
          drop_mask=drop, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1), sparse_mode=3,
          inner_precise=2)


def test_odd_skv_dropout_bits():
    """Skv % 8 != 0: the flat bit index runs across rows (no per-row padding)."""
    sq, skv = 37, 29
    drop = torch.randint(0, 256, (B * N1 * sq * skv // 8 + 1,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(4))
    check("BNSD", torch.float32, sq, skv, keep_prob=0.7, drop_mask=drop)


@pytest.mark.parametrize("pse_shape", [(B, N1, 1, 40), (1, N1, 33, 40)])
def test_autograd_with_respect_to_pse(pse_shape):
    q, k, v, dy = (t.requires_grad_() for t in attention_inputs("BSH", B, N1, N2, 33, 40, D, D, torch.float32))
    pse = rand(*pse_shape).requires_grad_()
    out = attngrad.flash_attention_score(q, k, v, N1, "BSH", pse=pse, scale_value=SCALE, pse_type=1)[0]
    out.backward(dy)
    want = torch.autograd.grad(_torch_attention(q, k, v, pse), (q, k, v, pse), dy)
    for got, w in zip((q.grad, k.grad, v.grad, pse.grad), want):
        assert_close(got, w.double(), torch.float32)


def _torch_attention(q, k, v, pse):
    """Plain torch composition (BSH, pseType 1) as an independent autograd golden."""
    bq, bk, bv = to_bnsd(q, "BSH", N1), to_bnsd(k, "BSH", N2), to_bnsd(v, "BSH", N2)
    bk, bv = bk.repeat_interleave(N1 // N2, 1), bv.repeat_interleave(N1 // N2, 1)
    p = torch.softmax((bq @ bk.transpose(-1, -2) + pse) * SCALE, -1)
    return from_bnsd(p @ bv, "BSH")


def test_npu_training_step_regenerates_the_drop_mask():
    """npu_fusion_attention draws the mask from (seed, offset); the grad regenerates the same one."""
    q, k, v, dy = attention_inputs("BNSD", B, N1, N2, 40, 48, D, D, torch.float32)
    fwd = npu.npu_fusion_attention(q, k, v, N1, "BNSD", scale=SCALE, keep_prob=0.7, seed=11, offset=16)
    out, smax, ssum, _, seed, offset, numels = fwd
    assert (seed, offset, numels) == (11, 16, B * N1 * 40 * 48)
    mask = generate_drop_mask(11, 16, numels, 0.7)
    explicit = attngrad.flash_attention_score(q, k, v, N1, "BNSD", scale_value=SCALE, keep_prob=0.7,
                                              drop_mask=mask)
    assert torch.equal(out, explicit[0])
    grads = npu.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                          attention_in=out, scale_value=SCALE, keep_prob=0.7, seed=seed,
                                          offset=offset, numels=numels)
    want = attngrad.flash_attention_score_grad(q, k, v, dy, N1, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                               attention_in=out, scale_value=SCALE, keep_prob=0.7,
                                               drop_mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(grads[:3], want[:3]))
    other = npu.npu_fusion_attention(q, k, v, N1, "BNSD", scale=SCALE, keep_prob=0.7, seed=12, offset=16)[0]
    assert not torch.equal(out, other)


def test_npu_names_take_an_explicit_dropout_mask():
    """An explicit ``dropout_mask`` (say, dumped from an NPU run) reaches the forwards and both grads; the grads
    use it, not the mask (seed, offset) would regenerate."""
    q, k, v, dy = attention_inputs("BNSD", B, N1, N2, 40, 48, D, D, torch.float32)
    mask = generate_drop_mask(5, 0, B * N1 * 40 * 48, 0.7)
    out, smax, ssum, _, seed, offset, numels = npu.npu_fusion_attention(q, k, v, N1, "BNSD", scale=SCALE,
                                                                        keep_prob=0.7, dropout_mask=mask)
    kw = dict(scale_value=SCALE, keep_prob=0.7)
    assert torch.equal(out, attngrad.flash_attention_score(q, k, v, N1, "BNSD", drop_mask=mask, **kw)[0])
    saved = dict(softmax_max=smax, softmax_sum=ssum, attention_in=out, **kw)
    want = attngrad.flash_attention_score_grad(q, k, v, dy, N1, "BNSD", drop_mask=mask, **saved)
    for grad in (npu.npu_fusion_attention_grad, npu.npu_fusion_attention_grad_v2):
        got = grad(q, k, v, dy, N1, "BNSD", seed=seed, offset=offset, numels=numels, dropout_mask=mask, **saved)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])), grad.__name__
    regenerated = npu.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", seed=seed, offset=offset, numels=numels,
                                                **saved)
    assert not torch.equal(regenerated[0], want[0])


def test_generator_is_reproducible_and_calibrated():
    a = generate_drop_mask(3, 5, 100_003, 0.9)
    assert a.dtype == torch.uint8 and a.numel() == 12501 and torch.equal(a, generate_drop_mask(3, 5, 100_003, 0.9))
    bits = np.unpackbits(a.numpy(), bitorder="little")
    assert abs(bits[:100_003].mean() - 0.9) < 0.01 and bits[100_003:].sum() == 0
    shifted = np.unpackbits(generate_drop_mask(3, 13, 100, 0.9).numpy(), bitorder="little")[:92]
    assert np.array_equal(shifted, bits[8:100])   # offset counts elements


# ----------------------------------------------------------------------------------------- validation
def _forward(sq=20, skv=20, **kw):
    q, k, v, _ = attention_inputs("BNSD", B, N1, N2, sq, skv, D, D, torch.float32)
    return attngrad.flash_attention_score(q, k, v, N1, "BNSD", **kw)


TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
ERRORS = [
    (dict(pse=rand(B, N1, 20)), "pse", "4-D"),
    (dict(pse=rand(B, 1, 20, 20)), "pse", "shape must be"),
    (dict(pse=rand(1, N1, 1, 20)), "pse", "shape must be"),
    (dict(pse=rand(1, N1, 1024, 20)), "pse", "alibi-compressed"),
    (dict(sq=1100, skv=1100, pse=rand(1, N1, 1024, 1100)), "pse", "causal"),
    (dict(pse=rand(N1, dtype=torch.float16), pse_type=2), "pse", "dtype"),
    (dict(pse=rand(N1 + 1), pse_type=2), "pse", "[N1] or [B, N1]"),
    (dict(skv=24, pse=rand(N1), pse_type=3), "pseType", "Sq == Skv"),
    (dict(pse=rand(N1), pse_type=2, q_start_idx=[1, 2]), "qStartIdx", "1 element"),
    (dict(keep_prob=0.5, drop_mask=torch.zeros(B * N1 * 400 // 8 - 1, dtype=torch.uint8)), "dropMask", "bytes"),
    (dict(keep_prob=0.5, drop_mask=torch.zeros(400, dtype=torch.bool)), "dropMask", "dtype"),
]


@pytest.mark.parametrize("kw,param,words", ERRORS)
def test_invalid_pse_and_dropout(kw, param, words):
    with pytest.raises(AclnnError) as exc:
        _forward(**kw)
    assert exc.value.status == 161002 and exc.value.param == param and words in str(exc.value)
    with pytest.raises(AclnnError) as exc:
        _forward(keep_prob=0.5)
    assert exc.value.status == 161001 and exc.value.param == "dropMask"
