"""FlashAttentionScore forward and grad: attngrad's fused kernels against torch's C++ flash attention (CPU).

Case: B1 N8 S2048 D128 BNSD, scale 1/sqrt(D), bf16 and fp32, non-causal and causal (left-up band
``next_tokens = 0``, torch's ``is_causal`` is top-left aligned too). The grad times only the backward:
attngrad's ``flash_attention_backward`` with stats from a prior forward; torch's ``autograd.grad`` of an
output whose graph is built once outside the timed call. Effective FLOPs: forward ``4 B N Sq Skv D``,
grad 2.5 times that, both halved when causal (peers_and_conventions.md section 4.1).
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from attngrad.bench import BenchCase
from attngrad.kernels.flash_attention import flash_attention_backward, flash_attention_forward
from attngrad.kernels.flash_attention_plan import AttentionPlan


def _torch_flash(q, k, v, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))


def _case_pair(shape, dtype, causal) -> list[BenchCase]:
    b, n, s, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(b, n, s, d, generator=gen).to(dtype) for _ in range(4))
    plan = AttentionPlan(scale=1.0 / math.sqrt(d), next_tokens=0 if causal else 2**31 - 1)
    out, smax, ssum = flash_attention_forward(q, k, v, plan)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    graph_out = _torch_flash(*leaves, causal)
    flops = 4 * b * n * s * s * d * (0.5 if causal else 1.0)
    label = f"B{b} N{n} S{s} D{d} BNSD{' causal' if causal else ''}"
    roofline = "gemm_bf16" if dtype != torch.float32 else "gemm_fp32"
    grad = BenchCase(
        op="FlashAttentionScoreGrad", dtype=dtype, label=label, flops=2.5 * flops, roofline=roofline,
        impls={"attngrad": lambda: flash_attention_backward(q, k, v, dy, out, smax, ssum, plan),
               "torch sdpa flash (C++)": lambda: torch.autograd.grad(graph_out, leaves, dy, retain_graph=True)},
        notes="backward only; stats from a prior forward")
    forward = BenchCase(
        op="FlashAttentionScore", dtype=dtype, label=label, flops=flops, roofline=roofline,
        impls={"attngrad": lambda: flash_attention_forward(q, k, v, plan),
               "torch sdpa flash (C++)": lambda: _torch_flash(q, k, v, causal)})
    return [grad, forward]


def cases(quick: bool) -> list[BenchCase]:
    shape = (1, 2, 512, 128) if quick else (1, 8, 2048, 128)
    return [c for dtype in (torch.bfloat16, torch.float32) for causal in (False, True)
            for c in _case_pair(shape, dtype, causal)]
