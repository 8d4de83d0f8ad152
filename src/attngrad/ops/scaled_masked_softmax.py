"""Contract of ScaledMaskedSoftmax and ScaledMaskedSoftmaxBackward (see docs/cann-semantics.md, 'ScaledMaskedSoftmax').

Forward:  ``y = softmax(where(mask, -10000, x * scale))`` over the last axis (fp16: scaled in fp16, except in
the golden precision mode of :mod:`attngrad.precision_mode`, which scales in fp32; the backward is the same in
both modes).
Backward: ``out = where(mask, 0, (dy - sum(dy * y)) * y * scale)``, the sum over the whole row.

Shapes: x / grad_output / y ``[B, N, S1, S2]``; mask bool ``[B|1, N|1, S1, S2]`` (True = masked).
Dtypes: float32, float16, bfloat16; outputs take the input dtype (round half to even).

``cann_limits=True`` (the aclnn layer) adds CANN's own limits: ``1 <= S2 <= 4096`` and
``fix_triu_mask`` false. The torch layer accepts any S2 (0 gives an empty result) and
``fix_triu_mask=True``, which replaces the mask by the strictly upper triangular one (j > i), as
torch_npu's ``npu_scaled_masked_softmax`` does (the given mask may then be None).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import scaled_masked_softmax as kernels
from ..kernels.numeric import streams
from ..kernels.tensor_view import kernel_view, new_output, unit_stride_rows
from ..precision_mode import NPU, check_precision, current_precision
from ..precompile import call_forward
from ..validation import (FLOAT_DTYPES, check_dim_broadcast, check_dim_equal, check_dtype, check_float,
                          check_output_view, check_range, check_rank, check_same_dtype, check_shape, invalid, is_real,
                          require_tensor)

FORWARD = "ScaledMaskedSoftmax"
BACKWARD = "ScaledMaskedSoftmaxBackward"
CANN_MAX_LAST_DIM = 4096


def triu_mask(s1: int, s2: int) -> torch.Tensor:
    """The mask ``fix_triu_mask`` stands for: True strictly above the diagonal, shape [1, 1, S1, S2]."""
    return torch.ones(s1, s2, dtype=torch.bool).triu(1).view(1, 1, s1, s2)


def _check_mask(op: str, mask: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """mask: bool, 4-D, dims 0-1 equal to ``ref``'s or 1 (broadcast), dims 2-3 equal to ``ref``'s."""
    check_dtype(op, "mask", mask, (torch.bool,))
    check_rank(op, "mask", mask, (4,))
    check_dim_broadcast(op, "mask", mask, 0, ref.shape[0], ref_name)
    check_dim_broadcast(op, "mask", mask, 1, ref.shape[1], ref_name)
    check_dim_equal(op, "mask", mask, 2, ref.shape[2], ref_name)
    check_dim_equal(op, "mask", mask, 3, ref.shape[3], ref_name)


def _check_attrs(op: str, data: torch.Tensor, scale, fix_triu_mask, cann_limits: bool,
                 min_last_dim: int = 1) -> float:
    """scale a float, fixTriuMask a bool; ``cann_limits``: S2 (``data``'s last dim) in [min_last_dim, 4096]
    and fixTriuMask false. Returns the scale as a Python float."""
    scale = check_float(op, "scale", scale)
    if not isinstance(fix_triu_mask, bool):
        raise invalid(op, "fixTriuMask", "must be a bool", repr(fix_triu_mask))
    if cann_limits:
        check_range(op, "last dim (S2)", data.shape[3], min_last_dim, CANN_MAX_LAST_DIM)
        if fix_triu_mask:
            raise invalid(op, "fixTriuMask", "only false is supported by CANN", True)
    return scale


def _resolve_mask(op: str, mask, data_name: str, data: torch.Tensor, fix_triu_mask: bool) -> torch.Tensor:
    """The mask the kernel reads: the given one (checked against ``data``), or with ``fix_triu_mask`` the
    [1, 1, S1, S2] strict upper triangle (a given mask is still checked)."""
    if mask is None and fix_triu_mask:
        return triu_mask(data.shape[2], data.shape[3])
    mask = require_tensor(op, "mask", mask)
    _check_mask(op, mask, data_name, data)
    return triu_mask(data.shape[2], data.shape[3]) if fix_triu_mask else mask


def check_forward(x, mask, scale=1.0, fix_triu_mask=False, y=None, *, cann_limits=False):
    """Validate in CANN's order; returns ``(x, mask, scale)`` ready for the kernel.

    A null x or mask is 161001, as CANN's documentation says (its code returns 561103). ``y``: the aclnn output.
    """
    op = FORWARD
    x = require_tensor(op, "x", x)
    if not fix_triu_mask or cann_limits:
        require_tensor(op, "mask", mask)
    if y is not None or cann_limits:  # the aclnn output y is required, checked with the other nulls
        require_tensor(op, "y", y)
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_rank(op, "x", x, (4,))
    if y is not None:
        check_same_dtype(op, "y", y, "x", x)
        check_shape(op, "y", y, x.shape, "must equal x's shape")
        check_output_view(op, "y", y)
    scale = _check_attrs(op, x, scale, fix_triu_mask, cann_limits)
    mask = _resolve_mask(op, mask, "x", x, fix_triu_mask)
    return x, mask, scale


def check_backward(grad_output, y, mask, scale=1.0, fix_triu_mask=False, out=None, *, cann_limits=False):
    """Validate in CANN's order; gradOutput, y and out dtypes must match (161002), as CANN's documentation says."""
    op = BACKWARD
    grad_output = require_tensor(op, "gradOutput", grad_output)
    y = require_tensor(op, "y", y)
    if not fix_triu_mask or cann_limits:
        require_tensor(op, "mask", mask)
    if cann_limits:
        require_tensor(op, "out", out)
    check_dtype(op, "gradOutput", grad_output, FLOAT_DTYPES)
    check_same_dtype(op, "y", y, "gradOutput", grad_output)
    if out is not None:
        check_same_dtype(op, "out", out, "gradOutput", grad_output)
    check_rank(op, "gradOutput", grad_output, (4,))
    check_shape(op, "y", y, grad_output.shape, "must equal gradOutput's shape")
    if out is not None:
        check_shape(op, "out", out, grad_output.shape, "must equal gradOutput's shape")
        check_output_view(op, "out", out)
    # the backward's last dim is documented as [0, 4096]: S2 = 0 is an empty tensor -> success (CANN's tiling
    # would reject it with an inner error; attngrad follows the documentation, see docs/cann-semantics.md).
    scale = _check_attrs(op, grad_output, scale, fix_triu_mask, cann_limits, min_last_dim=0)
    mask = _resolve_mask(op, mask, "gradOutput", grad_output, fix_triu_mask)
    return grad_output, y, mask, scale


def forward_kernel(x: torch.Tensor, mask: torch.Tensor, scale: float, y: torch.Tensor | None = None,
                   precision: str = NPU) -> torch.Tensor:
    """Run the fused forward kernel on validated input: x [B,N,S1,S2], mask bool [B|1,N|1,S1,S2] -> y like x
    (float16 input in the npu precision mode: the scale is rounded to float16 first, as CANN scales in fp16).
    ``y``, when given, is a validated output view (any strides) written in place, as the aclnn layer's
    caller-owned output."""
    y = new_output(x.shape, x.dtype) if y is None else y
    if y.numel() == 0:
        return y
    half = x.dtype == torch.float16 and check_precision(precision) == NPU
    kscale = np.float32(torch.tensor(scale, dtype=torch.float16 if half else torch.float32).item())
    kernels.scaled_masked_softmax_forward(kernel_view(x), kernel_view(unit_stride_rows(mask)), kscale,
                                          kernels.scaling_of(half), streams(y.nbytes), kernel_view(y))
    return y


def backward_kernel(grad_output, y, mask, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fused backward kernel on validated input: grad_output, y [B,N,S1,S2], mask bool
    [B|1,N|1,S1,S2] -> the gradient like grad_output, written into ``out`` when given (a validated view)."""
    out = new_output(grad_output.shape, grad_output.dtype) if out is None else out
    if out.numel() == 0:
        return out
    kernels.scaled_masked_softmax_backward(kernel_view(grad_output), kernel_view(y),
                                           kernel_view(unit_stride_rows(mask)), np.float32(scale),
                                           streams(out.nbytes), kernel_view(out))
    return out


# ------------------------------------------------------------------------------- custom ops (torch.library)
# The ops run the contract's validation in their eager and fake kernels alike, so a bad input raises the same
# AclnnError in eager, under torch.compile and in torch.export; the public functions below only call them.
@torch.library.custom_op("attngrad::scaled_masked_softmax", mutates_args=())
def _forward_op(x: torch.Tensor, mask: torch.Tensor | None, scale: float, fix_triu_mask: bool,
                precision: str = NPU) -> torch.Tensor:
    return forward_kernel(*check_forward(x, mask, scale, fix_triu_mask), precision=precision)


@_forward_op.register_fake
def _forward_fake(x, mask, scale, fix_triu_mask, precision=NPU):
    check_forward(x, mask, scale, fix_triu_mask)
    check_precision(precision)
    return x.new_empty(x.shape)


@torch.library.custom_op("attngrad::scaled_masked_softmax_backward", mutates_args=())
def _backward_op(grad_output: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 fix_triu_mask: bool) -> torch.Tensor:
    return backward_kernel(*check_backward(grad_output, y, mask, scale, fix_triu_mask))


@_backward_op.register_fake
def _backward_fake(grad_output, y, mask, scale, fix_triu_mask):
    check_backward(grad_output, y, mask, scale, fix_triu_mask)
    return grad_output.new_empty(grad_output.shape)


def _save_forward(ctx, inputs, output):
    _, mask, ctx.scale, ctx.fix_triu_mask, _ = inputs
    ctx.save_for_backward(output, mask)


def _differentiate_forward(ctx, grad_y):
    """d x = ScaledMaskedSoftmaxBackward(grad_y, y, mask) on the saved y (grad_y cast to y's dtype)."""
    y, mask = ctx.saved_tensors
    grad_x = _backward_op(grad_y.to(y.dtype), y, mask, ctx.scale, ctx.fix_triu_mask)
    return grad_x, None, None, None, None


_forward_op.register_autograd(_differentiate_forward, setup_context=_save_forward)


# -------------------------------------------------------------------------------------------- torch layer
def _schema_ready(tensors: tuple, mask, scale, fix_triu_mask) -> bool:
    """True when the arguments have the ops' schema types; otherwise the contract's check reports the bad one
    in CANN's order (a valid call is validated once, by the op)."""
    return (all(isinstance(t, torch.Tensor) for t in tensors) and (mask is None or isinstance(mask, torch.Tensor))
            and is_real(scale) and isinstance(fix_triu_mask, bool))


def scaled_masked_softmax(x, mask, scale=1.0, fix_triu_mask=False):
    """CANN ScaledMaskedSoftmax. x ``[B,N,S1,S2]`` float, mask bool ``[B|1,N|1,S1,S2]`` -> y like x.

    Differentiable w.r.t. x (the backward is :func:`scaled_masked_softmax_backward`'s kernel); runs as the custom
    op ``torch.ops.attngrad.scaled_masked_softmax``, so it compiles and exports.
    """
    if not _schema_ready((x,), mask, scale, fix_triu_mask):  # the contract's error, not the schema's
        check_forward(x, mask, scale, fix_triu_mask)
    # the backward's kernels are the same in both precision modes
    return call_forward(_forward_op, (x, mask, float(scale), fix_triu_mask, current_precision()), BACKWARD, NPU)


def scaled_masked_softmax_backward(grad_output, y, mask, scale=1.0, fix_triu_mask=False):
    """CANN ScaledMaskedSoftmaxBackward: gradient of x given dy (``grad_output``) and the forward y
    (custom op ``torch.ops.attngrad.scaled_masked_softmax_backward``)."""
    if not _schema_ready((grad_output, y), mask, scale, fix_triu_mask):
        check_backward(grad_output, y, mask, scale, fix_triu_mask)
    return _backward_op(grad_output, y, mask, float(scale), fix_triu_mask)
