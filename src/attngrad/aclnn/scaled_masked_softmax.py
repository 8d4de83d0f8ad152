"""aclnnScaledMaskedSoftmax and aclnnScaledMaskedSoftmaxBackward: thin two-phase wrappers.

All checks live in :mod:`attngrad.ops.scaled_masked_softmax`; this layer only adds the aclnn-only
rules (ND format, CANN's S2 and fixTriuMask limits via ``cann_limits=True``).
"""

from __future__ import annotations

from ..ops import scaled_masked_softmax as contract
from ..precision_mode import current_precision
from .executor import as_torch_views, check_formats_nd, run_into, two_phase


def _prepare_forward(x, mask, scale, fixed_triu_mask, y):
    op = contract.FORWARD
    named = {"x": x, "mask": mask, "y": y}
    tx, tmask, ty = as_torch_views(op, named).values()
    tx, tmask, scale = contract.check_forward(tx, tmask, scale, fixed_triu_mask, ty, cann_limits=True)
    check_formats_nd(op, named)
    precision = current_precision()
    return lambda: run_into(ty, (tx, tmask), lambda dest: contract.forward_kernel(tx, tmask, scale, dest, precision))


def _prepare_backward(grad_output, y, mask, scale, fix_triu_mask, out):
    op = contract.BACKWARD
    named = {"gradOutput": grad_output, "y": y, "mask": mask, "out": out}
    go, ty, tm, to = as_torch_views(op, named).values()
    go, ty, tm, scale = contract.check_backward(go, ty, tm, scale, fix_triu_mask, to, cann_limits=True)
    check_formats_nd(op, named)
    return lambda: run_into(to, (go, ty, tm), lambda dest: contract.backward_kernel(go, ty, tm, scale, dest))


aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnnScaledMaskedSoftmax = two_phase(
    "aclnnScaledMaskedSoftmax", _prepare_forward)
aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize, aclnnScaledMaskedSoftmaxBackward = two_phase(
    "aclnnScaledMaskedSoftmaxBackward", _prepare_backward)
