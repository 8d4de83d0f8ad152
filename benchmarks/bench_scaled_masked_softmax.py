"""ScaledMaskedSoftmax(Backward) against its PyTorch peers (the headline shape: [4,16,512,1024], mask [4,1,...]).

Byte model (what a one-pass kernel must move): forward reads x and the mask and writes y; backward reads
grad_output, y and the mask and writes the gradient. The mask is counted once at its own (broadcast) size.

Output allocation. A fresh 134 MB output is a new mmap that the first write page-faults in (about as
costly as the kernel itself here), while the copy roofline writes into an existing buffer. So the first
implementation (the one rated against the roofline) writes into a preallocated output, as CANN's aclnn
API does (the caller owns ``y``/``out``), and so does one torch peer (``out=``/``grad_input=``); the
allocating calls of both (the torch-level functions as a user calls them) are timed too.
"""

from __future__ import annotations

import torch

from attngrad import scaled_masked_softmax, scaled_masked_softmax_backward
from attngrad.bench import BenchCase
from attngrad.ops.scaled_masked_softmax import backward_kernel, forward_kernel

OPS = ("ScaledMaskedSoftmax", "ScaledMaskedSoftmaxBackward")
SCALE = 0.5
MASK_VALUE = -10000.0


def _inputs(shape, mask_shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    mask = torch.rand(mask_shape, generator=g) < 0.2
    y = torch.softmax(x.float(), -1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, mask, y, dy


def _torch_forward_into(x, mask, tmp, y):
    torch.mul(x, SCALE, out=tmp).masked_fill_(mask, MASK_VALUE)
    torch._softmax(tmp, -1, False, out=y)


def _forward_case(label, x, mask, bytes_moved) -> BenchCase:
    y, tmp = torch.empty_like(x), torch.empty_like(x)
    return BenchCase(
        "ScaledMaskedSoftmax", x.dtype, label,
        {"attngrad (out preallocated)": lambda: forward_kernel(x, mask, SCALE, y),
         "attngrad op (allocates)": lambda: scaled_masked_softmax(x, mask, SCALE),
         "torch softmax(masked_fill) (allocates)": lambda: torch.softmax(
             (x * SCALE).masked_fill(mask, MASK_VALUE), -1),
         "torch softmax(masked_fill) (out=)": lambda: _torch_forward_into(x, mask, tmp, y)},
        bytes_moved=bytes_moved, notes="ratios against attngrad (out preallocated)")


def _backward_case(label, dy, y, mask, bytes_moved) -> BenchCase:
    out = torch.empty_like(dy)
    return BenchCase(
        "ScaledMaskedSoftmaxBackward", dy.dtype, label,
        {"attngrad (out preallocated)": lambda: backward_kernel(dy, y, mask, SCALE, out),
         "attngrad op (allocates)": lambda: scaled_masked_softmax_backward(dy, y, mask, SCALE),
         "torch _softmax_backward_data+mul_+masked_fill_ (allocates)": lambda: torch._softmax_backward_data(
             dy, y, -1, dy.dtype).mul_(SCALE).masked_fill_(mask, 0),
         "torch _softmax_backward_data+mul_+masked_fill_ (grad_input=)": lambda: torch._softmax_backward_data(
             dy, y, -1, dy.dtype, grad_input=out).mul_(SCALE).masked_fill_(mask, 0)},
        bytes_moved=bytes_moved, notes="ratios against attngrad (out preallocated)")


def cases(quick: bool) -> list[BenchCase]:
    shape, mask_shape = ((2, 8, 256, 1024), (2, 1, 256, 1024)) if quick else ((4, 16, 512, 1024), (4, 1, 512, 1024))
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, mask, y, dy = _inputs(shape, mask_shape, dtype)
        n, es = x.numel(), x.element_size()
        label = f"{list(shape)} mask{list(mask_shape)}"
        out.append(_forward_case(label, x, mask, 2 * n * es + mask.numel()))
        out.append(_backward_case(label, dy, y, mask, 3 * n * es + mask.numel()))
    return out
