"""aclnnExpSegsum and aclnnExpSegsumBackward: thin two-phase wrappers.

All checks live in :mod:`attngrad.ops.exp_segsum` (called with ``cann_limits=True``, which puts CANN's
empty fast path first); this layer only adds the aclnn-only format rule (ND) and writes the outputs.
"""

from __future__ import annotations

from ..ops import exp_segsum as contract
from .executor import as_torch, check_format_nd, two_phase, write_output


def _nothing() -> None:
    """CANN's empty fast path: success, no work."""


def _prepare_forward(self, out):
    op = contract.FORWARD
    tx, to = as_torch(op, "self", self), as_torch(op, "out", out)
    if not contract.check_forward(tx, to, cann_limits=True):
        return _nothing
    for name, t in (("self", self), ("out", out)):
        check_format_nd(op, name, t)
    return lambda: write_output(to, contract.forward_kernel(tx))


def _prepare_backward(grad_output, grad_self, grad_input):
    op = contract.BACKWARD
    go, gs, gi = (as_torch(op, n, t) for n, t in
                  (("gradOutput", grad_output), ("gradSelf", grad_self), ("gradInput", grad_input)))
    if not contract.check_backward(go, gs, gi, cann_limits=True):
        return _nothing
    for name, t in (("gradOutput", grad_output), ("gradSelf", grad_self), ("gradInput", grad_input)):
        check_format_nd(op, name, t)
    return lambda: write_output(gi, contract.backward_kernel(go, gs))


aclnnExpSegsumGetWorkspaceSize, aclnnExpSegsum = two_phase("aclnnExpSegsum", _prepare_forward)
aclnnExpSegsumBackwardGetWorkspaceSize, aclnnExpSegsumBackward = two_phase(
    "aclnnExpSegsumBackward", _prepare_backward)
