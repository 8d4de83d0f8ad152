"""FlashAttentionScore forward and grad: attngrad's fused kernels against torch's C++ flash attention (CPU).

Cases (BNSD, scale 1/sqrt(D), 1/sqrt(D + Dr) with rope; plans resolved by the contract from CANN's arguments):

* B1 N8 S2048 D128, bf16 and fp32: full attention, and causal as CANN's sparse mode 2 with its compressed
  [2048, 2048] mask (torch: ``is_causal=True``, top-left aligned too);
* band: sparse mode 4 with pre = next = 128 at B1 N4 S4096 D64 bf16. torch's CPU SDPA flash backend accepts
  a dense boolean ``attn_mask`` (it then runs ``_scaled_dot_product_flash_attention_for_cpu`` over every
  tile, no skipping): the peer gets the equivalent [S, S] mask;
* grad with a BNSS pse, causal mask and dropout 0.9 against attngrad's own plain causal grad (the cost of
  the score modifiers), B1 N8 S2048 D128 bf16;
* MLA rope parts (``rope Dr64``), causal mode 2, bf16 and fp32: the fused rope path (``rope=(q_rope, k_rope)``,
  Dr 64) against attngrad on the concatenated ``[q, q_rope]`` / ``[k, k_rope]`` (D 192, value D 128) and torch's
  flash on them with value zero-padded to 192 (its CPU flash needs one head dim for q, k and v). The fused
  path needs no concatenated copy of q and k: the case's notes give the bytes saved at its shape;
* attention sink (``sink``), causal mode 2, bf16: attngrad with a float32 ``[N1]`` sink against attngrad
  without one (ratio = no-sink time / sink time, so the overhead is 1 / ratio - 1).

The grad times only the backward: attngrad's ``flash_attention_backward`` with stats from a prior forward;
torch's ``autograd.grad`` of an output whose graph is built once outside the timed call. Effective FLOPs:
``2 (Dqk + Dv)`` per visible (query, key) pair (:func:`visible_pairs`, exact for every mode; ``4 D`` without
rope) in the forward, 2.5 times that in the grad (the usual convention: the backward's five GEMMs against the
forward's two).
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
OPS = ("FlashAttentionScore", "FlashAttentionScoreGrad")


def _torch_flash(q, k, v, causal=False, mask=None):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=1.0 / math.sqrt(q.shape[-1]))


def _inputs(shape, dtype):
    b, n, s, d = shape
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, n, s, d, generator=gen).to(dtype) for _ in range(4))


def _plan(q, k, v, **kw):
    """The contract's plan for BNSD q, k, v and the keywords ``kw``; scale 1/sqrt(D + Dr) (Dr: query_rope's D)."""
    d = q.shape[-1] + (kw["query_rope"].shape[-1] if "query_rope" in kw else 0)
    return check_forward(q, k, v, *split_kwargs(q.shape[1], "BNSD", scale_value=1.0 / math.sqrt(d), **kw)).plan


def _label(shape, what):
    b, n, s, d = shape
    return f"B{b} N{n} S{s} D{d} BNSD{what}"


def _attngrad_calls(q, k, v, dy, plan, rope=None) -> tuple:
    """(forward, grad) calls of attngrad's kernels on one problem; the grad's stats from a forward run now."""
    stats = flash_attention_forward(q, k, v, plan, rope=rope)
    return (lambda: flash_attention_forward(q, k, v, plan, rope=rope),
            lambda: flash_attention_backward(q, k, v, dy, *stats, plan, rope=rope))


def _torch_calls(q, k, v, dy, **peer_kw) -> tuple:
    """(forward, grad) calls of torch's flash; the grad's graph is built once here, on copies as leaves."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    graph_out = _torch_flash(*leaves, **peer_kw)
    return (lambda: _torch_flash(q, k, v, **peer_kw),
            lambda: torch.autograd.grad(graph_out, leaves, dy, retain_graph=True))


def gemm_roofline(dtype: torch.dtype) -> str:
    """The GEMM roofline a flash attention case of ``dtype`` is rated against: fp32's, else the best of bf16 and
    widened fp32 (the kernels take either path, see docs/performance.md, 'GEMM paths')."""
    return "gemm_fp32" if dtype == torch.float32 else "gemm_bf16_best"


def _grad_and_forward(shape, dtype, what, plan, impls: dict, notes="", pair_flops=None) -> list[BenchCase]:
    """The grad and the forward case of one problem; ``impls``: name -> (forward, grad) calls, attngrad's first.
    ``pair_flops``: effective forward FLOPs per visible pair (default ``4 D``)."""
    b, n, s, d = shape
    flops = (pair_flops or 4 * d) * visible_pairs(plan, b, n, s, s)
    common = dict(dtype=dtype, label=_label(shape, what), roofline=gemm_roofline(dtype))
    return [BenchCase(op="FlashAttentionScoreGrad", flops=2.5 * flops, impls={k: c[1] for k, c in impls.items()},
                      notes="; ".join(filter(None, ("backward only; stats from a prior forward", notes))), **common),
            BenchCase(op="FlashAttentionScore", flops=flops, impls={k: c[0] for k, c in impls.items()}, notes=notes,
                      **common)]


def _case_pair(shape, dtype, what, plan_kw, peer_kw, peer_name=_PEER) -> list[BenchCase]:
    q, k, v, dy = _inputs(shape, dtype)
    plan = _plan(q, k, v, **plan_kw)
    return _grad_and_forward(shape, dtype, what, plan, {"attngrad": _attngrad_calls(q, k, v, dy, plan),
                                                        peer_name: _torch_calls(q, k, v, dy, **peer_kw)})


def _band_cases(shape) -> list[BenchCase]:
    s, w = shape[2], 128
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    allowed = (j - i <= w) & (i - j <= w)  # torch: True = attend
    return _case_pair(shape, torch.bfloat16, f" band mode 4 pre=next={w}",
                      dict(atten_mask=_TRIU, sparse_mode=4, pre_tokens=w, next_tokens=w), dict(mask=allowed),
                      "torch sdpa flash (C++, dense bool mask)")


def _modifier_cases(shape) -> list[BenchCase]:
    """Causal grads with dropout 0.9 and a pse, dense [B,N1,S,S] or alibi generated from float32 slopes (pse_type
    2), against the plain causal grad (ratio = plain time / modified time: the modifiers' cost)."""
    b, n, s, d = shape
    q, k, v, dy = _inputs(shape, torch.bfloat16)
    causal = dict(atten_mask=_TRIU, sparse_mode=2)
    dropout = dict(keep_prob=0.9, drop_mask=generate_drop_mask(0, 0, b * n * s * s, 0.9))
    plain = _plan(q, k, v, **causal)
    pses = {"pse BNSS": dict(pse=torch.randn(b, n, s, s, generator=torch.Generator().manual_seed(1)).to(q.dtype)),
            "alibi": dict(pse=torch.rand(n, generator=torch.Generator().manual_seed(3)), pse_type=2)}
    return [BenchCase(
        op="FlashAttentionScoreGrad", dtype=torch.bfloat16, label=_label(shape, f" causal+{name}+dropout 0.9"),
        flops=2.5 * 4 * d * visible_pairs(plain, b, n, s, s), roofline="gemm_bf16_best",
        impls={f"attngrad {name}+causal+dropout": _attngrad_calls(q, k, v, dy, _plan(q, k, v, **pse, **dropout,
                                                                                      **causal))[1],
               "attngrad plain causal": _attngrad_calls(q, k, v, dy, plain)[1]},
        notes="cost of the pse + dropout score modifiers (target: ratio >= 0.9)") for name, pse in pses.items()]


def rope_cases(shape, dtype, dr: int = 64) -> list[BenchCase]:
    """MLA rope parts of head dim ``dr``, causal mode 2: fused rope vs the concatenated q / k (attngrad and
    torch's flash, value zero-padded to D + dr for torch). The notes give the concatenated copies' bytes."""
    b, n, s, d = shape
    q, k, v, dy = _inputs(shape, dtype)
    q_rope, k_rope = _inputs((b, n, s, dr), dtype)[:2]
    q_cat, k_cat = torch.cat([q, q_rope], -1), torch.cat([k, k_rope], -1)
    causal = dict(atten_mask=_TRIU, sparse_mode=2)
    fused = _plan(q, k, v, query_rope=q_rope, key_rope=k_rope, **causal)
    padded = torch.nn.functional.pad
    saved = (q_cat.numel() + k_cat.numel()) * q_cat.element_size()
    impls = {"attngrad fused rope": _attngrad_calls(q, k, v, dy, fused, rope=(q_rope, k_rope)),
             "attngrad on concatenated q/k": _attngrad_calls(q_cat, k_cat, v, dy, _plan(q_cat, k_cat, v, **causal)),
             "torch sdpa flash (C++, concatenated q/k, v padded)":
                 _torch_calls(q_cat, k_cat, padded(v, (0, dr)), padded(dy, (0, dr)), causal=True)}
    return _grad_and_forward(shape, dtype, f" causal mode 2 rope Dr{dr}", fused, impls, pair_flops=2 * (2 * d + dr),
                             notes=f"fused rope saves the concatenated q/k copies: {saved / 2**20:.1f} MiB")


def sink_cases(shape) -> list[BenchCase]:
    """Attention sink (float32 [N1]), causal mode 2, bf16: attngrad with the sink vs without (ratio: overhead)."""
    q, k, v, dy = _inputs(shape, torch.bfloat16)
    sink = torch.randn(shape[1], generator=torch.Generator().manual_seed(2))
    causal = dict(atten_mask=_TRIU, sparse_mode=2)
    plain = _plan(q, k, v, **causal)
    impls = {"attngrad sink": _attngrad_calls(q, k, v, dy, _plan(q, k, v, sink=sink, **causal)),
             "attngrad no sink": _attngrad_calls(q, k, v, dy, plain)}
    return _grad_and_forward(shape, torch.bfloat16, " causal mode 2 sink", plain, impls,
                             notes="sink overhead = 1 / ratio - 1 (target: <= 5%)")


def cases(quick: bool) -> list[BenchCase]:
    shape = (1, 2, 512, 128) if quick else (1, 8, 2048, 128)
    band_shape = (1, 1, 1024, 64) if quick else (1, 4, 4096, 64)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        out += _case_pair(shape, dtype, "", {}, {})
        out += _case_pair(shape, dtype, " causal mode 2", dict(atten_mask=_TRIU, sparse_mode=2), dict(causal=True))
        out += rope_cases(shape, dtype)
    return out + _band_cases(band_shape) + _modifier_cases(shape) + sink_cases(shape)
