"""ExpSegsum(Backward) against its PyTorch peers (headline shapes: x [8,8,4,128], gradients [8,8,4,128,128]).

Peers are the eager torch compositions of the documented formulas, in fp32: CANN's documented steps for the forward
(broadcast, where, cumsum, masked_fill -inf, exp) and its nine steps for the backward
(multiply, where, flip, cumsum, flip, where, sum).

Byte model (the minimum a one-pass kernel must move; P problems = product of the leading dims, element
size s):
* backward: read the strict lower triangle of gradOutput and gradSelf, ``2 * P * T*(T-1)/2 * s``, and
  write gradInput, ``P * T * s`` (the diagonal and the upper triangle are never read);
* forward: read x, ``P * T * s``, and write the whole output, ``P * T * T * s``.

As for ScaledMaskedSoftmax, the rated attngrad call writes into a preallocated output (aclnn's caller-owned
output); the torch-level call, which allocates its output, is timed alongside.
"""

from __future__ import annotations

import torch

from attngrad import exp_segsum, exp_segsum_backward
from attngrad.bench import BenchCase
from attngrad.ops.exp_segsum import backward_kernel, forward_kernel

OPS = ("ExpSegsum", "ExpSegsumBackward")


def torch_exp_segsum(x: torch.Tensor) -> torch.Tensor:
    """ExpSegsum as a vectorised torch composition in fp32 (lower-triangular cumulative sums, exp), cast to
    x's dtype."""
    t = x.shape[-1]
    xf = x.float()
    wide = xf.unsqueeze(-1).expand(*xf.shape, t)
    wide = torch.where(torch.ones(t, t, dtype=torch.bool).tril(-1), wide, torch.zeros(()))
    sums = wide.cumsum(-2).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(0), float("-inf"))
    return sums.exp().to(x.dtype)


def torch_exp_segsum_backward(grad_output: torch.Tensor, grad_self: torch.Tensor) -> torch.Tensor:
    """CANN's nine documented steps of ExpSegsumBackward in fp32 (where-masking), cast to grad_output's
    dtype."""
    t = grad_output.shape[-1]
    upper = torch.ones(t, t, dtype=torch.bool).triu(0)
    zero = torch.zeros(())
    out_mul = torch.where(upper, zero, grad_output.float() * grad_self.float())
    out_flip2 = out_mul.flip(-2).cumsum(-2).flip(-2)
    return torch.where(upper, zero, out_flip2).sum(-1).to(grad_output.dtype)


def cases(quick: bool) -> list[BenchCase]:
    shape = (2, 8, 4, 128) if quick else (8, 8, 4, 128)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(shape, generator=g) * 0.1).to(dtype)
        grad_self = exp_segsum(x)
        grad_output = torch.randn(grad_self.shape, generator=g).to(dtype)
        y, grad_input = torch.empty_like(grad_self), torch.empty(shape, dtype=dtype)
        t, es = shape[-1], x.element_size()
        problems = x.numel() // t
        out.append(BenchCase(
            "ExpSegsum", dtype, f"x{list(shape)}",
            {"attngrad (out preallocated)": lambda x=x, y=y: forward_kernel(x, y),
             "attngrad op (allocates)": lambda x=x: exp_segsum(x),
             "torch composition (fp32)": lambda x=x: torch_exp_segsum(x)},
            bytes_moved=problems * (t + t * t) * es,
            notes="bytes: read x + write the (..., T, T) output; ratios against attngrad (out preallocated)"))
        out.append(BenchCase(
            "ExpSegsumBackward", dtype, f"grad{list(grad_self.shape)}",
            {"attngrad (out preallocated)": lambda go=grad_output, gs=grad_self, gi=grad_input: backward_kernel(
                go, gs, gi),
             "attngrad op (allocates)": lambda go=grad_output, gs=grad_self: exp_segsum_backward(go, gs),
             "torch nine steps (fp32)": lambda go=grad_output, gs=grad_self: torch_exp_segsum_backward(go, gs)},
            bytes_moved=problems * (2 * (t * (t - 1) // 2) + t) * es,
            notes="bytes: read the strict lower triangles of both inputs + write gradInput; ratios against "
                  "attngrad (out preallocated)"))
    return out
