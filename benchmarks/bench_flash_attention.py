"""FlashAttentionScore forward and grad: attngrad's fused kernels against torch's C++ flash attention (CPU).

Cases (BNSD, scale 1/sqrt(D); plans resolved by the contract from CANN's arguments):

* B1 N8 S2048 D128, bf16 and fp32: full attention, and causal as CANN's sparse mode 2 with its compressed
  [2048, 2048] mask (torch: ``is_causal=True``, top-left aligned too);
* band: sparse mode 4 with pre = next = 128 at B1 N4 S4096 D64 bf16. torch's CPU SDPA flash backend accepts
  a dense boolean ``attn_mask`` (it then runs ``_scaled_dot_product_flash_attention_for_cpu`` over every
  tile, no skipping): the peer gets the equivalent [S, S] mask;
* grad with a BNSS pse, causal mask and dropout 0.9 against attngrad's own plain causal grad (the cost of
  the score modifiers), B1 N8 S2048 D128 bf16.

The grad times only the backward: attngrad's ``flash_attention_backward`` with stats from a prior forward;
torch's ``autograd.grad`` of an output whose graph is built once outside the timed call. Effective FLOPs:
``4 D`` per visible (query, key) pair (:func:`visible_pairs`, exact for every mode) in the forward, 2.5 times
that in the grad (the usual convention: the backward's five GEMMs against the forward's two).
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from attngrad.bench import BenchCase
from attngrad.kernels.dropout import generate_drop_mask
from attngrad.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from attngrad.kernels.flash_attention_plan import visible_pairs
from attngrad.ops.flash_attention import check_forward
from attngrad.ops.flash_attention_core import split_kwargs

_TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
_PEER = "torch sdpa flash (C++)"


def _torch_flash(q, k, v, causal=False, mask=None):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))


def _inputs(shape, dtype):
    b, n, s, d = shape
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, n, s, d, generator=gen).to(dtype) for _ in range(4))


def _plan(q, k, v, **kw):
    return check_forward(q, k, v, *split_kwargs(q.shape[1], "BNSD", scale_value=1.0 / math.sqrt(q.shape[-1]),
                                                **kw)).plan


def _label(shape, what):
    b, n, s, d = shape
    return f"B{b} N{n} S{s} D{d} BNSD{what}"


def _case_pair(shape, dtype, what, plan_kw, peer_kw, peer_name=_PEER) -> list[BenchCase]:
    q, k, v, dy = _inputs(shape, dtype)
    plan = _plan(q, k, v, **plan_kw)
    out, smax, ssum = flash_attention_forward(q, k, v, plan)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    graph_out = _torch_flash(*leaves, **peer_kw)
    b, n, s, d = shape
    flops = 4 * d * visible_pairs(plan, b, n, s, s)
    roofline = "gemm_bf16_best" if dtype != torch.float32 else "gemm_fp32"
    grad = BenchCase(
        op="FlashAttentionScoreGrad", dtype=dtype, label=_label(shape, what), flops=2.5 * flops, roofline=roofline,
        impls={"attngrad": lambda: flash_attention_backward(q, k, v, dy, out, smax, ssum, plan),
               peer_name: lambda: torch.autograd.grad(graph_out, leaves, dy, retain_graph=True)},
        notes="backward only; stats from a prior forward")
    forward = BenchCase(
        op="FlashAttentionScore", dtype=dtype, label=_label(shape, what), flops=flops, roofline=roofline,
        impls={"attngrad": lambda: flash_attention_forward(q, k, v, plan),
               peer_name: lambda: _torch_flash(q, k, v, **peer_kw)})
    return [grad, forward]


def _band_cases(shape) -> list[BenchCase]:
    s, w = shape[2], 128
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    allowed = (j - i <= w) & (i - j <= w)  # torch: True = attend
    return _case_pair(shape, torch.bfloat16, f" band mode 4 pre=next={w}",
                      dict(atten_mask=_TRIU, sparse_mode=4, pre_tokens=w, next_tokens=w), dict(mask=allowed),
                      "torch sdpa flash (C++, dense bool mask)")


def _modifier_case(shape) -> BenchCase:
    """pse [B,N1,S,S] + causal + dropout 0.9 vs plain causal, both attngrad grads (ratio = modifier cost)."""
    b, n, s, d = shape
    q, k, v, dy = _inputs(shape, torch.bfloat16)
    pse = torch.randn(b, n, s, s, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    drop = generate_drop_mask(0, 0, b * n * s * s, 0.9)
    full = _plan(q, k, v, atten_mask=_TRIU, sparse_mode=2, pse=pse, keep_prob=0.9, drop_mask=drop)
    plain = _plan(q, k, v, atten_mask=_TRIU, sparse_mode=2)
    stats_full = flash_attention_forward(q, k, v, full)
    stats_plain = flash_attention_forward(q, k, v, plain)
    return BenchCase(
        op="FlashAttentionScoreGrad", dtype=torch.bfloat16, label=_label(shape, " causal+pse BNSS+dropout 0.9"),
        flops=2.5 * 4 * d * visible_pairs(plain, b, n, s, s), roofline="gemm_bf16_best",
        impls={"attngrad pse+causal+dropout": lambda: flash_attention_backward(q, k, v, dy, *stats_full, full),
               "attngrad plain causal": lambda: flash_attention_backward(q, k, v, dy, *stats_plain, plain)},
        notes="cost of pse + dropout score modifiers (target: <= 1.5x the plain causal grad)")


def cases(quick: bool) -> list[BenchCase]:
    shape = (1, 2, 512, 128) if quick else (1, 8, 2048, 128)
    band_shape = (1, 1, 1024, 64) if quick else (1, 4, 4096, 64)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        out += _case_pair(shape, dtype, "", {}, {})
        out += _case_pair(shape, dtype, " causal mode 2", dict(atten_mask=_TRIU, sparse_mode=2), dict(causal=True))
    return out + _band_cases(band_shape) + [_modifier_case(shape)]
