"""Contract of ExpSegsum and ExpSegsumBackward (see docs/cann-semantics.md, 'ExpSegsum').

Forward:  x ``(..., T)`` (3-D or 4-D) -> out ``(..., T, T)``,
          ``out[i, j] = exp(x[j+1] + ... + x[i])`` for ``j <= i`` (diagonal exactly 1), exactly 0 above.
Backward: grad_output, grad_self ``(..., T, T)`` (4-D or 5-D) -> grad_input ``(..., T)``,
          ``grad_input[k] = sum_{i >= k, j < k} grad_output[i, j] * grad_self[i, j]``
          (grad_self is the forward output; values on and above the diagonal are never read).
Dtypes: float32, float16, bfloat16; sums and exp in fp32, outputs in the input dtype (round half to even).

Checks run in CANN's order (``aclnn_segsum.cpp``, ``aclnn_exp_segsum_backward.cpp``). With
``cann_limits=True`` (the aclnn layer) CANN's empty fast path comes first: an empty input (forward: self;
backward: any of the three tensors) returns success without any other check and without work (the check
functions then return False). CANN dereferences the tensors in that test, so a null one crashes there;
attngrad checks for null first (161001), which changes nothing for inputs CANN accepts. The torch layer
validates fully, then returns an empty result for empty input.
"""

from __future__ import annotations

import math

import torch

from ..kernels import exp_segsum as kernels
from ..kernels.numeric import streams
from ..kernels.tensor_view import kernel_view, new_output, unit_stride_rows
from ..precision_mode import NPU
from ..precompile import call_forward
from ..validation import (FLOAT_DTYPES, check_dtype, check_output_view, check_rank, check_same_dtype, check_shape,
                          require_tensor)

FORWARD = "ExpSegsum"
BACKWARD = "ExpSegsumBackward"
_MIN_TASKS = 8  # below this many problems the kernels split each problem to keep every core busy


def _is_empty(*tensors) -> bool:
    return any(t.numel() == 0 for t in tensors if t is not None)


def check_forward(x, out=None, *, cann_limits=False) -> bool:
    """Validate ExpSegsum's arguments in CANN's order; returns True when there is work to do.

    ``out`` is the aclnn output (None in the torch layer).
    """
    op = FORWARD
    x = require_tensor(op, "self", x)
    if cann_limits:
        out = require_tensor(op, "out", out)
        if _is_empty(x):  # CANN: self->IsEmpty() returns success before the other checks
            return False
    check_dtype(op, "self", x, FLOAT_DTYPES)
    if out is not None:
        check_same_dtype(op, "out", out, "self", x)
    check_rank(op, "self", x, (3, 4))
    if out is not None:
        check_rank(op, "out", out, (x.dim() + 1,))
        check_shape(op, "out", out, (*x.shape, x.shape[-1]), "must be self's shape + (T,)")
        check_output_view(op, "out", out)
    return not _is_empty(x)


def check_backward(grad_output, grad_self, grad_input=None, *, cann_limits=False) -> bool:
    """Validate ExpSegsumBackward's arguments in CANN's order; returns True when there is work to do.

    ``grad_input`` is the aclnn output (None in the torch layer).
    """
    op = BACKWARD
    grad_output = require_tensor(op, "gradOutput", grad_output)
    grad_self = require_tensor(op, "gradSelf", grad_self)
    if cann_limits:
        grad_input = require_tensor(op, "gradInput", grad_input)
        if _is_empty(grad_output, grad_self, grad_input):  # CANN's empty fast path, before the other checks
            return False
    check_dtype(op, "gradOutput", grad_output, FLOAT_DTYPES)
    check_dtype(op, "gradSelf", grad_self, FLOAT_DTYPES)
    # CANN's aclnn layer does not compare gradSelf's dtype with gradOutput's (a mismatch fails later,
    # without a kernel). CANN's documentation says "shape and dtype the same as grad_output", and attngrad
    # follows the documentation: a mismatch is 161002 here (docs/cann-semantics.md, 'Deviations from CANN').
    check_same_dtype(op, "gradSelf", grad_self, "gradOutput", grad_output)
    if grad_input is not None:
        check_same_dtype(op, "gradInput", grad_input, "gradOutput", grad_output)
    check_rank(op, "gradOutput", grad_output, (4, 5))
    check_rank(op, "gradSelf", grad_self, (grad_output.dim(),))
    if grad_input is not None:
        check_rank(op, "gradInput", grad_input, (grad_output.dim() - 1,))
    t = grad_output.shape[-1]
    check_shape(op, "gradOutput", grad_output, (*grad_output.shape[:-1], grad_output.shape[-2]),
                "last two dims must be equal")
    check_shape(op, "gradSelf", grad_self, grad_output.shape, "must equal gradOutput's shape")
    if grad_input is not None:
        check_shape(op, "gradInput", grad_input, grad_output.shape[:-1], "must be gradOutput's shape without "
                    f"its last dim (T = {t})")
        check_output_view(op, "gradInput", grad_input)
    return not _is_empty(grad_output, grad_self)


def _splits(problems: int) -> int:
    """How many pieces each problem is cut into so that at least ``_MIN_TASKS`` tasks exist."""
    return 1 if problems >= _MIN_TASKS else math.ceil(_MIN_TASKS / max(problems, 1))


def _as_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() < rank else t


def forward_kernel(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the forward kernel on validated input: ``(..., T)`` -> ``(..., T, T)``, written into ``out`` when given
    (a validated view, any strides: the aclnn layer's caller-owned output), else into a new tensor."""
    t = x.shape[-1]
    out = new_output((*x.shape, t), x.dtype) if out is None else out
    if out.numel() == 0:
        return out
    kernels.exp_segsum_forward(kernel_view(_as_rank(x, 4)), _splits(math.prod(x.shape[:-1])), streams(out.nbytes),
                               kernel_view(_as_rank(out, 5)))
    return out


def backward_kernel(grad_output: torch.Tensor, grad_self: torch.Tensor,
                    grad_input: torch.Tensor | None = None) -> torch.Tensor:
    """Run the backward kernel on validated input: ``(..., T, T)`` twice -> ``(..., T)``, written into
    ``grad_input`` when given (a validated view, any strides), else into a new tensor."""
    if grad_input is None:
        grad_input = torch.empty(grad_output.shape[:-1], dtype=grad_output.dtype)
    if grad_input.numel() == 0:
        return grad_input
    go, gs = (kernel_view(_as_rank(unit_stride_rows(t), 5)) for t in (grad_output, grad_self))
    kernels.exp_segsum_backward(go, gs, _splits(math.prod(grad_output.shape[:-2])),
                                kernel_view(_as_rank(grad_input, 4)))
    return grad_input


# ------------------------------------------------------------------------------- custom ops (torch.library)
# Eager and fake kernels run the same checks (see attngrad.ops.scaled_masked_softmax).
@torch.library.custom_op("attngrad::exp_segsum", mutates_args=())
def _forward_op(x: torch.Tensor) -> torch.Tensor:
    check_forward(x)
    return forward_kernel(x)


@_forward_op.register_fake
def _forward_fake(x):
    check_forward(x)
    return x.new_empty((*x.shape, x.shape[-1]))


@torch.library.custom_op("attngrad::exp_segsum_backward", mutates_args=())
def _backward_op(grad_output: torch.Tensor, grad_self: torch.Tensor) -> torch.Tensor:
    check_backward(grad_output, grad_self)
    return backward_kernel(grad_output, grad_self)


@_backward_op.register_fake
def _backward_fake(grad_output, grad_self):
    check_backward(grad_output, grad_self)
    return grad_output.new_empty(grad_output.shape[:-1])


def _save_forward(ctx, inputs, output):
    ctx.save_for_backward(output)


def _differentiate_forward(ctx, grad_out):
    """d x = ExpSegsumBackward(grad_out, out) on the saved output (grad_out cast to its dtype)."""
    (out,) = ctx.saved_tensors
    return _backward_op(grad_out.to(out.dtype), out)


_forward_op.register_autograd(_differentiate_forward, setup_context=_save_forward)


# -------------------------------------------------------------------------------------------- torch layer
def exp_segsum(x):
    """CANN ExpSegsum: x ``(..., T)`` 3-D/4-D float -> ``(..., T, T)`` of x's dtype.

    ``out[i, j] = exp(sum x[j+1..i])`` for ``j <= i`` (fp32 running sums down each column, fp32 exp),
    0 above the diagonal. Differentiable w.r.t. x (the backward is :func:`exp_segsum_backward`'s kernel with
    ``grad_self`` = this output); runs as the custom op ``torch.ops.attngrad.exp_segsum``.
    """
    if not isinstance(x, torch.Tensor):  # the contract's error, not the schema's (the op validates the rest)
        check_forward(x)
    return call_forward(_forward_op, (x,), BACKWARD, NPU)  # its kernels are the same in both precision modes


def exp_segsum_backward(grad_output, grad_self):
    """CANN ExpSegsumBackward: grad_output, grad_self ``(..., T, T)`` 4-D/5-D -> grad_input ``(..., T)``
    (custom op ``torch.ops.attngrad.exp_segsum_backward``)."""
    if not (isinstance(grad_output, torch.Tensor) and isinstance(grad_self, torch.Tensor)):
        check_backward(grad_output, grad_self)
    return _backward_op(grad_output, grad_self)
