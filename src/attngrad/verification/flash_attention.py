"""FlashAttentionScore(Grad) rows of ``attngrad verify``: forward out and dq/dk/dv against the float64 golden.

The grad golden uses the operator's own forward results (attentionIn, softmax max/sum), as CANN's grad does.
"""

from __future__ import annotations

import torch

from .. import flash_attention_score, flash_attention_score_grad
from ..kernels.flash_attention_plan import AttentionPlan
from ..kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                  flash_attention_forward_reference)
from ..ops.flash_attention import from_bnsd, to_bnsd
from ..precision import compare
from . import VerifyCase

# (layout, B, N1, N2, Sq, Skv, D, Dv)
SHAPES = [("BNSD", 2, 4, 2, 130, 97, 64, 64), ("BSH", 1, 3, 3, 37, 256, 128, 128),
          ("BSND", 1, 8, 1, 1, 300, 64, 32), ("SBH", 2, 2, 1, 200, 200, 96, 64)]


def _run(layout, b, n1, n2, sq, skv, d, dv, dtype):
    def run():
        g = torch.Generator().manual_seed(11)
        q, k, v, dy = (from_bnsd(torch.randn(b, n, s, e, generator=g).to(dtype), layout)
                       for n, s, e in ((n1, sq, d), (n2, skv, d), (n2, skv, dv), (n1, sq, dv)))
        scale = d ** -0.5
        out, smax, ssum = flash_attention_score(q, k, v, n1, layout, scale_value=scale)
        dq, dk, dv_ = flash_attention_score_grad(q, k, v, dy, n1, layout, scale_value=scale, softmax_max=smax,
                                                 softmax_sum=ssum, attention_in=out)[:3]
        bq, bk, bv = to_bnsd(q, layout, n1), to_bnsd(k, layout, n2), to_bnsd(v, layout, n2)
        plan = AttentionPlan(scale=scale)
        golden_out = flash_attention_forward_reference(bq, bk, bv, plan)[0]
        golden = flash_attention_backward_reference(bq, bk, bv, to_bnsd(dy, layout, n1), to_bnsd(out, layout, n1),
                                                    smax[..., 0], ssum[..., 0], plan)
        return [("attention_out", compare(out, from_bnsd(golden_out, layout))),
                *((name, compare(got, from_bnsd(gold, layout)))
                  for name, got, gold in zip(("dq", "dk", "dv"), (dq, dk, dv_), golden))]
    return run


def cases():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for layout, b, n1, n2, sq, skv, d, dv in SHAPES:
            yield VerifyCase("FlashAttentionScoreGrad", dtype,
                             f"{layout} B{b} N{n1}/{n2} Sq{sq} Skv{skv} D{d} Dv{dv}",
                             _run(layout, b, n1, n2, sq, skv, d, dv, dtype))
