"""aclnnExpSegsum and aclnnExpSegsumBackward: thin two-phase wrappers.

All checks live in :mod:`attngrad.ops.exp_segsum` (called with ``cann_limits=True``, which puts CANN's
empty fast path first); this layer only adds the aclnn-only format rule (ND) and runs the kernels straight
into the caller's outputs (:func:`.executor.run_into`: through a copy only when an output shares storage with
an input).
"""

from __future__ import annotations

from ..ops import exp_segsum as contract
from .executor import as_torch_views, check_formats_nd, no_work, run_into, two_phase


def _prepare_forward(self, out):
    op = contract.FORWARD
    named = {"self": self, "out": out}
    tx, to = as_torch_views(op, named).values()
    if not contract.check_forward(tx, to, cann_limits=True):
        return no_work
    check_formats_nd(op, named)
    return lambda: run_into(to, (tx,), lambda dest: contract.forward_kernel(tx, dest))


def _prepare_backward(grad_output, grad_self, grad_input):
    op = contract.BACKWARD
    named = {"gradOutput": grad_output, "gradSelf": grad_self, "gradInput": grad_input}
    go, gs, gi = as_torch_views(op, named).values()
    if not contract.check_backward(go, gs, gi, cann_limits=True):
        return no_work
    check_formats_nd(op, named)
    return lambda: run_into(gi, (go, gs), lambda dest: contract.backward_kernel(go, gs, dest))


aclnnExpSegsumGetWorkspaceSize, aclnnExpSegsum = two_phase("aclnnExpSegsum", _prepare_forward)
aclnnExpSegsumBackwardGetWorkspaceSize, aclnnExpSegsumBackward = two_phase(
    "aclnnExpSegsumBackward", _prepare_backward)
