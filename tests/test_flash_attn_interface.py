"""attngrad's flash-attn 2.x interface against a float64 reference of flash-attn's documented semantics.

The reference below is written from flash-attn's docstrings, not from attngrad: bottom-right causal and
windows, alibi ``-slope * |i + Skv - Sq - j|``, GQA by repeating kv heads, rows without keys -> output 0,
zero gradients and lse +inf. Bounds: the README's norm-relative errors (1e-5 fp32, 1.5e-2 bf16).
"""

from __future__ import annotations

import math

import pytest
import torch

import attngrad
from attngrad import (AclnnError, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                      flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
LSE_BOUND = 1e-5          # lse is float32 from float32 scores whatever the input dtype
HEADS, KV_HEADS, DIM = 4, 2, 16


def reference(q, k, v, causal=False, window_size=(-1, -1), alibi_slopes=None, softmax_scale=None):
    """float64 flash-attn on one batch of ``[B, S, H, D]`` tensors -> ``(out, lse [B, H, Sq])``."""
    q, k, v = (t.double() for t in (q, k, v))
    sq, skv, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None]
    diagonal = i + skv - sq
    left, right = window_size
    right = 0 if causal else right
    visible = torch.ones(sq, skv, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diagonal - left
    if right >= 0:
        visible &= j <= diagonal + right
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, q.shape[2])[:, :, None, None]
        scores = scores - slopes * (diagonal - j).abs()
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse.masked_fill(lse == -math.inf, math.inf)


def varlen_reference(q, k, v, cu_q, cu_k, **kwargs):
    """The reference per sequence of packed ``[total, H, D]`` tensors -> ``(out, lse [H, total_q])``."""
    outs, lses = [], []
    slopes = kwargs.pop("alibi_slopes", None)
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        if slopes is not None:
            kwargs["alibi_slopes"] = slopes if slopes.dim() == 1 else slopes[b]
        out, lse = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def relative_error(value: torch.Tensor, golden: torch.Tensor) -> float:
    return ((value.double() - golden).norm() / golden.norm()).item()


def leaves(dtype, *shapes):
    return [torch.randn(shape).to(dtype).requires_grad_() for shape in shapes]


def check_against_reference(run, golden, inputs, dtype):
    """Forward, lse and gradients of ``run(*inputs) -> (out, lse, None)`` against ``golden`` (float64 leaves)."""
    out, lse, probs = run(*inputs)
    assert probs is None and lse.dtype == torch.float32 and out.dtype == dtype
    dy = torch.randn(out.shape).to(dtype)
    grads = torch.autograd.grad(out, inputs, dy)
    refs = [t.detach().double().requires_grad_() for t in inputs]
    ref_out, ref_lse = golden(*refs)
    ref_grads = torch.autograd.grad(ref_out, refs, dy.double())
    assert relative_error(out, ref_out) <= BOUND[dtype]
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isinf(), ~finite) and (lse[~finite] > 0).all()
    assert relative_error(lse[finite], ref_lse[finite]) <= LSE_BOUND
    for grad, ref in zip(grads, ref_grads):
        assert relative_error(grad, ref) <= BOUND[dtype]
    return out, grads


# (seqlen_q, seqlen_k, flash-attn keyword arguments); alibi slopes are drawn per case
CASES = {
    "full": (24, 24, {}),
    "full-scale": (12, 20, {"softmax_scale": 0.3}),
    "causal-sq<sk": (12, 20, {"causal": True}),
    "causal-sq>sk": (20, 12, {"causal": True}),
    "window": (24, 24, {"window_size": (3, 2)}),
    "window-left-only-sq>sk": (20, 12, {"window_size": (4, -1)}),
    "causal-window-sq<sk": (12, 20, {"causal": True, "window_size": (5, -1)}),
    "alibi-square": (24, 24, {"alibi": (HEADS,)}),
    "alibi-causal-sq<sk": (12, 20, {"causal": True, "alibi": (2, HEADS)}),
    "alibi-sq>sk-blocks": (27, 12, {"alibi": (HEADS,)}),
    "alibi-window-sq>sk-blocks": (27, 12, {"window_size": (5, 3), "alibi": (HEADS,)}),
    "alibi-sq>>sk-150-blocks": (300, 2, {"alibi": (HEADS,)}),  # dK / dV of the blocks summed in fp32
}


def case_kwargs(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    if "alibi" in kwargs:
        kwargs["alibi_slopes"] = torch.rand(kwargs.pop("alibi"))
    return kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_flash_attn_func_matches_reference(case, dtype):
    sq, skv, kwargs = CASES[case]
    kwargs = case_kwargs(kwargs)
    inputs = leaves(dtype, (2, sq, HEADS, DIM), (2, skv, KV_HEADS, DIM), (2, skv, KV_HEADS, DIM))
    check_against_reference(lambda q, k, v: flash_attn_func(q, k, v, return_attn_probs=True, **kwargs),
                            lambda q, k, v: reference(q, k, v, **kwargs), inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window_size": (2, 1)}, {"alibi_slopes": (2, HEADS)},
                                    {"causal": True, "alibi_slopes": (HEADS,)}],
                         ids=["causal", "window", "alibi-per-batch", "alibi-causal"])
@pytest.mark.parametrize("lengths", [((5, 9), (11, 4)), ((7, 3), (7, 3))], ids=["sq!=sk", "sq==sk"])
def test_flash_attn_varlen_func_matches_reference(lengths, kwargs, dtype):
    """Per-sequence bottom-right rules; alibi with unequal lengths runs sequence by sequence, equal ones in
    one TND call."""
    kwargs = {name: torch.rand(value) if name == "alibi_slopes" else value for name, value in kwargs.items()}
    cu_q, cu_k = ([0, *torch.tensor(lens).cumsum(0).tolist()] for lens in lengths)
    inputs = leaves(dtype, (cu_q[-1], HEADS, DIM), (cu_k[-1], KV_HEADS, DIM), (cu_k[-1], KV_HEADS, DIM))
    cu_q_tensor, cu_k_tensor = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    check_against_reference(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q_tensor, cu_k_tensor, max(lengths[0]), max(lengths[1]),
                                               return_attn_probs=True, **kwargs),
        lambda q, k, v: varlen_reference(q, k, v, cu_q, cu_k, **dict(kwargs)), inputs, dtype)


@pytest.mark.parametrize("kwargs", [{"alibi_slopes": (HEADS,)}, {"causal": True, "window_size": (2, 0)},
                                    {"window_size": (0, 1)}], ids=["alibi", "causal-window", "window"])
def test_varlen_sequences_without_queries_or_keys(kwargs):
    """A sequence with queries but no keys (output 0, lse +inf) or keys but no queries, beside ordinary ones:
    any window and alibi are legal there (they select among no scores)."""
    kwargs = {name: torch.rand(value) if name == "alibi_slopes" else value for name, value in kwargs.items()}
    lengths = ((5, 2, 0, 4), (3, 0, 4, 4))
    cu_q, cu_k = ([0, *torch.tensor(lens).cumsum(0).tolist()] for lens in lengths)
    inputs = leaves(torch.float32, (cu_q[-1], HEADS, DIM), (cu_k[-1], KV_HEADS, DIM), (cu_k[-1], KV_HEADS, DIM))
    cu = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    out, _ = check_against_reference(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, *cu, 5, 4, return_attn_probs=True, **kwargs),
        lambda q, k, v: varlen_reference(q, k, v, cu_q, cu_k, **dict(kwargs)), inputs, torch.float32)
    assert torch.equal(out[5:7], torch.zeros_like(out[5:7]))


def test_rows_without_keys_have_zero_output_zero_gradients_and_infinite_lse():
    q, k, v = leaves(torch.float32, (1, 10, HEADS, DIM), (1, 4, KV_HEADS, DIM), (1, 4, KV_HEADS, DIM))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out.backward(torch.randn(out.shape))
    assert torch.equal(out[:, :6], torch.zeros_like(out[:, :6])) and out[:, 6:].abs().min() > 0
    assert torch.equal(q.grad[:, :6], torch.zeros_like(q.grad[:, :6])) and q.grad[:, 6:].abs().max() > 0
    assert torch.isposinf(lse[:, :, :6]).all() and lse[:, :, 6:].isfinite().all()


def test_rows_without_keys_attend_to_the_sink_in_skipped_alibi_blocks():
    """With a sink a row without keys has softmax_lse = sink and output 0, also in the alibi blocks of
    Sq > Skv that are not run (rows 0-2 here; rows 3-11 come from the kernel)."""
    sq, skv, kwargs = CASES["alibi-window-sq>sk-blocks"]
    kwargs = case_kwargs(kwargs)
    q, k, v = leaves(torch.float32, (2, sq, HEADS, DIM), (2, skv, KV_HEADS, DIM), (2, skv, KV_HEADS, DIM))
    sink = torch.randn(HEADS)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, sink=sink, **kwargs)
    ref_out, ref_lse = reference(q.detach(), k.detach(), v.detach(), **kwargs)
    keys_lse = ref_lse.masked_fill(ref_lse.isinf(), -math.inf)      # logsumexp over the keys only
    with_sink = torch.logaddexp(keys_lse, sink.double()[:, None])
    assert torch.equal(lse[:, :, :skv], sink[:, None].expand(2, HEADS, skv))
    assert relative_error(lse, with_sink) <= LSE_BOUND
    assert not out[:, :skv].any()
    keys_share = (keys_lse - with_sink).exp().transpose(1, 2)[..., None]
    assert relative_error(out, ref_out * keys_share) <= BOUND[torch.float32]


def test_an_empty_row_passes_no_gradient_to_keys():
    """A window that reaches no key of rows 0-2: their output gradient reaches neither q, k nor v."""
    q, k, v = leaves(torch.float32, (1, 6, HEADS, DIM), (1, 3, KV_HEADS, DIM), (1, 3, KV_HEADS, DIM))
    out = flash_attn_func(q, k, v, window_size=(0, 0))       # bottom-right diagonal: rows 3-5 see key i - 3
    dy = torch.zeros(out.shape)
    dy[:, :3] = torch.randn(dy[:, :3].shape)
    assert all(not grad.any() for grad in torch.autograd.grad(out, (q, k, v), dy))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the summation order of a strided view versus a contiguous copy."""
    return relative_error(a, b.double()) <= 1e-6


def test_packed_forms_equal_the_unpacked_functions():
    qkv = torch.randn(2, 12, 3, HEADS, DIM, requires_grad=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    expected = flash_attn_func(q, k, v, causal=True)
    dy = torch.randn(expected.shape)
    packed = flash_attn_qkvpacked_func(qkv, causal=True)
    assert same(packed, expected)
    assert same(flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True), expected)
    grad, = torch.autograd.grad(packed, qkv, dy)
    assert same(grad, torch.stack(torch.autograd.grad(expected, (q, k, v), dy), 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    rows = qkv.detach()[0]
    expected = flash_attn_varlen_func(*rows.unbind(1), cu, cu, 7, 7, window_size=(2, 0))
    assert same(flash_attn_varlen_qkvpacked_func(rows, cu, 7, window_size=(2, 0)), expected)
    assert same(flash_attn_varlen_kvpacked_func(rows[:, 0], rows[:, 1:], cu, cu, 7, 7, window_size=(2, 0)), expected)


def test_dropout_scales_kept_probabilities_and_repeats_under_manual_seed():
    """v = identity makes the output the dropped probabilities: each entry is 0 or P / (1 - p); the same
    torch.manual_seed gives the same mask, another seed another one; gradients flow through the same mask."""
    skv = DIM
    q = torch.randn(1, 8, 2, DIM, requires_grad=True)
    k = torch.randn(1, skv, 2, DIM)
    v = torch.eye(skv).expand(1, 2, skv, skv).permute(0, 2, 1, 3).contiguous()
    probs, _ = reference(q.detach(), k, v)
    torch.manual_seed(7)
    out = flash_attn_func(q, k, v, dropout_p=0.25)
    kept = out.detach().double() != 0
    assert 0.6 < kept.double().mean() < 0.9
    assert relative_error(out[kept], probs[kept] / 0.75) <= 1e-5
    torch.manual_seed(7)
    again = flash_attn_func(q, k, v, dropout_p=0.25)
    assert torch.equal(out, again)
    assert not torch.equal(out, flash_attn_func(q, k, v, dropout_p=0.25))
    dq, = torch.autograd.grad(out, q, torch.ones_like(out))
    dq_again, = torch.autograd.grad(again, q, torch.ones_like(out))
    assert torch.equal(dq, dq_again) and dq.abs().max() > 0


@pytest.mark.parametrize("kwargs, param", [
    ({"softcap": 30.0}, "softcap"),
    ({"dropout_p": 1.0}, "dropout_p"),
    ({"window_size": (-2, 0)}, "window_size"),
    ({"window_size": (3,)}, "window_size"),
])
def test_unsupported_or_invalid_flash_attn_arguments_raise(kwargs, param):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(AclnnError) as error:
        flash_attn_func(q, q, q, **kwargs)
    assert error.value.status == 161002 and error.value.param == param and param in str(error.value)


def test_varlen_specific_arguments_are_checked():
    t = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    for kwargs, param in (({"cu_seqlens_q": torch.tensor([1, 6])}, "cu_seqlens_q"),
                          ({"block_table": torch.zeros(1, 1, dtype=torch.int32)}, "block_table")):
        arguments = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 6, "max_seqlen_k": 6, **kwargs}
        with pytest.raises(AclnnError) as error:
            flash_attn_varlen_func(t, t, t, **arguments)
        assert error.value.param == param


def test_shapes_and_dtypes_are_left_to_the_operator_contract():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(AclnnError, match="GQA"):
        flash_attn_func(q, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    with pytest.raises(AclnnError, match="pse"):
        flash_attn_func(q, q, q, alibi_slopes=torch.rand(3, dtype=torch.float64))


def test_exported_from_the_package():
    assert attngrad.flash_attn_func is flash_attn_func
