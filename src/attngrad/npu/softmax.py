"""torch_npu's ``npu_scaled_masked_softmax`` and ``npu_scaled_masked_softmax_backward``."""

from __future__ import annotations

from ..ops.scaled_masked_softmax import scaled_masked_softmax, scaled_masked_softmax_backward


def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """torch_npu signature: ``npu_scaled_masked_softmax(x, mask, scale=1, fixed_triu_mask=False) -> y``."""
    return scaled_masked_softmax(x, mask, scale, fixed_triu_mask)


def npu_scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask):
    """torch_npu signature: ``npu_scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask)``."""
    return scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask)
