"""ExpSegsum(Backward) rows of ``attngrad verify``: fp32/fp16/bf16, 3-D/4-D inputs, T from 1 to 256."""

from __future__ import annotations

import torch

from .. import exp_segsum, exp_segsum_backward
from ..kernels.exp_segsum_reference import exp_segsum_backward_reference, exp_segsum_reference, saturate
from ..precision import compare
from . import VerifyCase

# (input shape of the forward, scale of x): x ~ N(0, scale^2) keeps exp(segment sums) in range
SHAPES = [((2, 3, 37), 0.5), ((2, 4, 3, 128), 0.1), ((1, 2, 1, 256), 0.05), ((3, 2, 5, 1), 1.0)]


def _run(shape, scale, dtype):
    def run():
        g = torch.Generator().manual_seed(11)
        x = (torch.randn(shape, generator=g) * scale).to(dtype)
        out = exp_segsum(x)
        grad_output = torch.randn(out.shape, generator=g).to(dtype)
        grad = exp_segsum_backward(grad_output, out)
        upper = torch.ones(shape[-1], shape[-1], dtype=torch.bool).triu(1)
        return [
            ("out", compare(out, saturate(exp_segsum_reference(x), dtype), use_mere=True, exact_zero=upper)),
            ("gradInput", compare(grad, saturate(exp_segsum_backward_reference(grad_output, out), dtype),
                                  use_mere=True)),
        ]
    return run


def cases():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, scale in SHAPES:
            yield VerifyCase("ExpSegsum", dtype, f"x{list(shape)} ~N(0,{scale}^2)", _run(shape, scale, dtype))
