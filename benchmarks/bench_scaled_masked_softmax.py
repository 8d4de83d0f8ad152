"""ScaledMaskedSoftmax(Backward) against its PyTorch peers (issue 2's shape: [4,16,512,1024], mask [4,1,...]).

Byte model (what a one-pass kernel must move): forward reads x and the mask and writes y; backward reads
grad_output, y and the mask and writes the gradient. The mask is counted once at its own (broadcast) size.
"""

from __future__ import annotations

import torch

from attngrad import scaled_masked_softmax, scaled_masked_softmax_backward
from attngrad.bench import BenchCase

SCALE = 0.5


def _inputs(shape, mask_shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    mask = torch.rand(mask_shape, generator=g) < 0.2
    y = torch.softmax(x.float(), -1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, mask, y, dy


def cases(quick: bool) -> list[BenchCase]:
    shape, mask_shape = ((2, 8, 256, 1024), (2, 1, 256, 1024)) if quick else ((4, 16, 512, 1024), (4, 1, 512, 1024))
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, mask, y, dy = _inputs(shape, mask_shape, dtype)
        n, es = x.numel(), x.element_size()
        label = f"{list(shape)} mask{list(mask_shape)}"
        out.append(BenchCase(
            "ScaledMaskedSoftmax", dtype, label,
            {"attngrad": lambda x=x, mask=mask: scaled_masked_softmax(x, mask, SCALE),
             "torch softmax(masked_fill)": lambda x=x, mask=mask: torch.softmax(
                 (x * SCALE).masked_fill(mask, -10000.0), -1)},
            bytes_moved=2 * n * es + mask.numel()))
        out.append(BenchCase(
            "ScaledMaskedSoftmaxBackward", dtype, label,
            {"attngrad": lambda dy=dy, y=y, mask=mask: scaled_masked_softmax_backward(dy, y, mask, SCALE),
             "torch _softmax_backward_data+mul_+masked_fill_": lambda dy=dy, y=y, mask=mask, dtype=dtype:
                 torch._softmax_backward_data(dy, y, -1, dtype).mul_(SCALE).masked_fill_(mask, 0)},
            bytes_moved=3 * n * es + mask.numel()))
    return out
