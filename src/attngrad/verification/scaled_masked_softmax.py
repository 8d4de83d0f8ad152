"""ScaledMaskedSoftmax(Backward) rows of ``attngrad verify``."""

from __future__ import annotations

import torch

from .. import scaled_masked_softmax, scaled_masked_softmax_backward
from ..kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                       scaled_masked_softmax_reference)
from ..precision import compare
from . import VerifyCase

SHAPES = [((2, 4, 33, 1), (2, 1, 33, 1)), ((2, 4, 37, 129), (1, 4, 37, 129)),
          ((1, 2, 64, 1000), (1, 1, 64, 1000)), ((1, 1, 8, 4096), (1, 1, 8, 4096))]


def _run(shape, mask_shape, dtype):
    def run():
        g = torch.Generator().manual_seed(7)
        x = (torch.randn(shape, generator=g) * 4).to(dtype)
        mask = torch.rand(mask_shape, generator=g) < 0.25
        y = scaled_masked_softmax(x, mask, 0.5)
        dy = torch.randn(shape, generator=g).to(dtype)
        dx = scaled_masked_softmax_backward(dy, y, mask, 0.5)
        return [
            ("y", compare(y, scaled_masked_softmax_reference(x, mask, 0.5), use_mere=True)),
            ("x_grad", compare(dx, scaled_masked_softmax_backward_reference(dy, y, mask, 0.5), use_mere=True,
                               exact_zero=mask)),
        ]
    return run


def cases():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, mask_shape in SHAPES:
            yield VerifyCase("ScaledMaskedSoftmax", dtype, f"x{list(shape)} mask{list(mask_shape)}",
                             _run(shape, mask_shape, dtype))
