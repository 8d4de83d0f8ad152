"""attngrad: Huawei Ascend CANN's attention-family training operators, faithful to CANN, fast on CPU.

Torch layer (this module), CANN two-phase layer (:mod:`attngrad.aclnn`) and torch_npu names
(:mod:`attngrad.npu`) all run through one contract module per operator in :mod:`attngrad.ops`.
"""

from .errors import AclnnError, aclnn_error_of
from .flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                   flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                   flash_attn_varlen_qkvpacked_func)
from . import npu  # noqa: F401 - torch_npu names
from .ops.exp_segsum import exp_segsum, exp_segsum_backward
from .ops.flash_attention import flash_attention_score, flash_attention_score_grad
from .ops.scaled_masked_softmax import scaled_masked_softmax, scaled_masked_softmax_backward
from .precision_mode import current_precision, precision_mode, set_precision_mode

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "aclnn_error_of",
    "current_precision",
    "exp_segsum",
    "exp_segsum_backward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attention_score",
    "flash_attention_score_grad",
    "precision_mode",
    "scaled_masked_softmax",
    "scaled_masked_softmax_backward",
    "set_precision_mode",
]
