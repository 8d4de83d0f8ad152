"""Varlen (TND) FlashAttentionScore forward and grad against (a) the same sequences run one by one through the
BNSD kernels and (b) torch's C++ flash attention (SDPA FLASH backend) on the same tokens padded to the longest.

Case: 32 sequences with lengths spread evenly over 64..1024 (Sq_b = Skv_b), N1 = N2 = 8, D = 128, bf16 and fp32,
scale 1/sqrt(D), causal (sparse mode 3 with the compressed [2048, 2048] mask; torch ``is_causal``, top-left
aligned, the same thing when Sq_b = Skv_b). Quick: 8 sequences over 64..256. The grad times only the backward: the
varlen contract's ``run_backward`` on a validated problem with stats from a prior forward; the one-by-one peer
calls ``flash_attention_backward`` per sequence on contiguous BNSD copies made outside the timing; torch's
``autograd.grad`` of a padded [B, N, maxS, D] graph built once. Effective FLOPs: ``4 N D sum_b Sq_b Skv_b``
(forward, halved when causal), the grad 2.5 times that; the padded peer does more work for the same result.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from attngrad.bench import BenchCase
from attngrad.benchmarks.bench_flash_attention import gemm_roofline
from attngrad.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from attngrad.kernels.flash_attention_plan import AttentionPlan
from attngrad.ops import flash_attention_varlen as varlen
from attngrad.ops.flash_attention_core import split_kwargs

HEADS, HEAD_DIM = 8, 128
OPS = ("FlashAttentionVarLenScore", "FlashAttentionUnpaddingScoreGrad")
CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def _lengths(count: int, low: int, high: int) -> list[int]:
    """``count`` lengths spread evenly over [low, high], shuffled deterministically."""
    lengths = [round(low + (high - low) * i / (count - 1)) for i in range(count)]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    return [lengths[i] for i in order]


def _torch_flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]))


def _padded(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Packed [T, N, D] -> [B, N, maxS, D] with zero padding."""
    out = torch.zeros(len(lengths), t.shape[1], max(lengths), t.shape[2], dtype=t.dtype)
    start = 0
    for b, s in enumerate(lengths):
        out[b, :, :s] = t[start:start + s].transpose(0, 1)
        start += s
    return out


def _cases(lengths: list[int], dtype: torch.dtype) -> list[BenchCase]:
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(4))
    cum = torch.tensor(lengths).cumsum(0).tolist()
    scale = 1.0 / math.sqrt(HEAD_DIM)
    seq = dict(actual_seq_qlen=cum, actual_seq_kvlen=cum, scale_value=scale, sparse_mode=3, atten_mask=CAUSAL_MASK)
    out, smax, ssum = varlen.run_forward(varlen.check_forward(q, k, v, *split_kwargs(HEADS, "TND", **seq)))
    grad_problem = varlen.check_backward(q, k, v, dy, *split_kwargs(HEADS, "TND", softmax_max=smax,
                                                                    softmax_sum=ssum, attention_in=out, **seq))
    forward_problem = varlen.check_forward(q, k, v, *split_kwargs(HEADS, "TND", **seq))

    plan = AttentionPlan(scale=scale, next_tokens=0)
    starts = [c - s for c, s in zip(cum, lengths)]
    pieces = [tuple(t[a:a + s].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, dy))
              for a, s in zip(starts, lengths)]
    saved = [flash_attention_forward(bq, bk, bv, plan) for bq, bk, bv, _ in pieces]

    def one_by_one_backward():
        for (bq, bk, bv, bdy), (o, m, s) in zip(pieces, saved):
            flash_attention_backward(bq, bk, bv, bdy, o, m, s, plan)

    def one_by_one_forward():
        for bq, bk, bv, _ in pieces:
            flash_attention_forward(bq, bk, bv, plan)

    padded = [_padded(t, lengths) for t in (q, k, v, dy)]
    leaves = [t.clone().requires_grad_() for t in padded[:3]]
    graph_out = _torch_flash(*leaves)
    flops = 4 * HEADS * HEAD_DIM * sum(s * s for s in lengths) * 0.5
    label = f"TND {len(lengths)} seqs {min(lengths)}..{max(lengths)} (T={total}) N{HEADS} D{HEAD_DIM} causal"
    grad = BenchCase(
        op="FlashAttentionUnpaddingScoreGrad", dtype=dtype, label=label, flops=2.5 * flops,
        roofline=gemm_roofline(dtype),
        impls={"attngrad varlen": lambda: varlen.run_backward(grad_problem),
               "attngrad BNSD one by one": one_by_one_backward,
               "torch sdpa flash (C++) padded": lambda: torch.autograd.grad(graph_out, leaves, padded[3],
                                                                            retain_graph=True)},
        notes="backward only; stats from a prior forward; torch pads every sequence to the longest")
    forward = BenchCase(
        op="FlashAttentionVarLenScore", dtype=dtype, label=label, flops=flops, roofline=gemm_roofline(dtype),
        impls={"attngrad varlen": lambda: varlen.run_forward(forward_problem),
               "attngrad BNSD one by one": one_by_one_forward,
               "torch sdpa flash (C++) padded": lambda: _torch_flash(*padded[:3])},
        notes="torch pads every sequence to the longest")
    return [grad, forward]


def cases(quick: bool) -> list[BenchCase]:
    lengths = _lengths(8, 64, 256) if quick else _lengths(32, 64, 1024)
    return _cases(lengths, torch.bfloat16) + _cases(lengths, torch.float32)
