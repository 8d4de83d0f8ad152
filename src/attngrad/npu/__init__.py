"""torch_npu-compatible names: ``import attngrad.npu as torch_npu``-style aliasing runs torch_npu code.

Argument names, defaults and return tuples follow torch_npu (including the ``pre_tockens`` spelling).
Every function is a thin layer over the operator contracts in :mod:`attngrad.ops`.
"""

from .fusion_attention import (npu_fusion_attention, npu_fusion_attention_grad, npu_fusion_attention_grad_v2,
                               npu_fusion_attention_v2)
from .softmax import npu_scaled_masked_softmax, npu_scaled_masked_softmax_backward
from .shim import install
