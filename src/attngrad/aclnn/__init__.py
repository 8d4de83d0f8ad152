"""CANN's two-phase C API, in Python: ``aclnnXGetWorkspaceSize(...) -> (status, ws, executor)`` then
``aclnnX(workspace, ws, executor, stream) -> status``. Bad input returns a status (never raises);
``aclGetRecentErrMsg()`` gives the message. Status codes: docs/cann-semantics.md, 'Validation order and status codes'.
"""

from ..errors import (ACLNN_ERR_INNER, ACLNN_ERR_INNER_NULLPTR, ACLNN_ERR_INNER_TILING_ERROR,
                      ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, ACLNN_ERR_RUNTIME_ERROR, ACLNN_SUCCESS)
from .executor import AclOpExecutor
from .exp_segsum import (aclnnExpSegsum, aclnnExpSegsumBackward, aclnnExpSegsumBackwardGetWorkspaceSize,
                         aclnnExpSegsumGetWorkspaceSize)
from .flash_attention import (aclnnFlashAttentionScore, aclnnFlashAttentionScoreGetWorkspaceSize,
                              aclnnFlashAttentionScoreGrad, aclnnFlashAttentionScoreGradGetWorkspaceSize,
                              aclnnFlashAttentionScoreGradV2, aclnnFlashAttentionScoreGradV2GetWorkspaceSize,
                              aclnnFlashAttentionScoreGradV3, aclnnFlashAttentionScoreGradV3GetWorkspaceSize,
                              aclnnFlashAttentionScoreV2, aclnnFlashAttentionScoreV2GetWorkspaceSize,
                              aclnnFlashAttentionScoreV3, aclnnFlashAttentionScoreV3GetWorkspaceSize)
from .flash_attention_varlen import (aclnnFlashAttentionUnpaddingScoreGrad,
                                     aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize,
                                     aclnnFlashAttentionUnpaddingScoreGradV2,
                                     aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize,
                                     aclnnFlashAttentionUnpaddingScoreGradV3,
                                     aclnnFlashAttentionUnpaddingScoreGradV3GetWorkspaceSize,
                                     aclnnFlashAttentionUnpaddingScoreGradV4,
                                     aclnnFlashAttentionUnpaddingScoreGradV4GetWorkspaceSize,
                                     aclnnFlashAttentionUnpaddingScoreGradV5,
                                     aclnnFlashAttentionUnpaddingScoreGradV5GetWorkspaceSize,
                                     aclnnFlashAttentionVarLenScore, aclnnFlashAttentionVarLenScoreGetWorkspaceSize,
                                     aclnnFlashAttentionVarLenScoreV2,
                                     aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize,
                                     aclnnFlashAttentionVarLenScoreV3,
                                     aclnnFlashAttentionVarLenScoreV3GetWorkspaceSize,
                                     aclnnFlashAttentionVarLenScoreV4,
                                     aclnnFlashAttentionVarLenScoreV4GetWorkspaceSize,
                                     aclnnFlashAttentionVarLenScoreV5,
                                     aclnnFlashAttentionVarLenScoreV5GetWorkspaceSize)
from .runtime import *  # noqa: F401,F403 - the AscendCL names, as in C
from .scaled_masked_softmax import (aclnnScaledMaskedSoftmax, aclnnScaledMaskedSoftmaxBackward,
                                    aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize,
                                    aclnnScaledMaskedSoftmaxGetWorkspaceSize)
