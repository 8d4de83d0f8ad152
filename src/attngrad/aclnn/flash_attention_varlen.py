"""aclnnFlashAttentionVarLenScore(V2..V5) and aclnnFlashAttentionUnpaddingScoreGrad(V2..V5): thin two-phase wrappers.

Parameters in CANN's C order: the FlashAttentionScore(Grad) order of :mod:`attngrad.aclnn.flash_attention` with
``actualSeqQLenOptional, actualSeqKvLenOptional`` after ``prefixOptional`` (V2 adds ``qStartIdxOptional,
kvStartIdxOptional`` after them and ``pseType`` after ``sparseMode``; V1 runs with pseType 1). inputLayout
must be "TND" and softmaxMax/Sum use CANN's default data order (per-batch [N1, Sq_b, 8] blocks). All checks
live in :mod:`attngrad.ops.flash_attention_varlen` (``cann_limits=True``). ``softmaxOutOut``,
``paddingMaskOptional``, ``softmaxInOptional`` and ``dpseOut`` are reserved by CANN and left untouched.
V3 (MLA) adds ``queryRope`` after ``query`` and ``keyRope`` / ``keyInRope`` after ``key`` / ``keyIn``; the
grad adds ``dqRopeOut`` / ``dkRopeOut`` after ``dqOut`` / ``dkOut`` (attngrad: every dtype, mask, pse and
dropout, where CANN takes bfloat16 with a mask and without pse or dropout). V4 is V1 with the statistics' data
order: ``softmaxOutLayout`` after ``sparseMode`` (forward), ``softmaxInLayout`` after ``dpseOut`` (grad); "" (or
null) is the default order, "same_as_input" the ``[T1, N1, 8]`` rows of the input. V5 is V3 with the sink and
that order: ``sinkOptional`` after ``attenMask`` and ``softmaxOutLayout`` after ``pseType`` (forward);
``sinkInOptional`` after ``attentionIn``, ``softmaxInLayout`` after ``pseType`` and ``dsinkOut`` after
``dpseOut`` (grad).
"""

from __future__ import annotations

from ..ops import flash_attention_varlen as contract
from .executor import two_phase
from .flash_attention import FORWARD_V2_PARAMS, GRAD_V2_PARAMS, forward_prepare, grad_prepare, inserted, v1_params


def with_seq_lens(params: tuple[str, ...]) -> tuple[str, ...]:
    """``params`` with actualSeqQLen and actualSeqKvLen inserted after prefix."""
    at = params.index("prefix") + 1
    return (*params[:at], "actualSeqQLen", "actualSeqKvLen", *params[at:])


VARLEN_FORWARD_V2_PARAMS = with_seq_lens(FORWARD_V2_PARAMS)
VARLEN_GRAD_V2_PARAMS = with_seq_lens(GRAD_V2_PARAMS)
VARLEN_FORWARD_V3_PARAMS = inserted(VARLEN_FORWARD_V2_PARAMS, queryRope="query", keyRope="key")
VARLEN_GRAD_V3_PARAMS = inserted(VARLEN_GRAD_V2_PARAMS, queryRope="query", keyInRope="keyIn", dqRopeOut="dqOut",
                                 dkRopeOut="dkOut")
VARLEN_FORWARD_V4_PARAMS = inserted(v1_params(VARLEN_FORWARD_V2_PARAMS), softmaxOutLayout="sparseMode")
VARLEN_GRAD_V4_PARAMS = inserted(v1_params(VARLEN_GRAD_V2_PARAMS), softmaxInLayout="dpseOut")
VARLEN_FORWARD_V5_PARAMS = inserted(VARLEN_FORWARD_V3_PARAMS, sink="attenMask", softmaxOutLayout="pseType")
VARLEN_GRAD_V5_PARAMS = inserted(VARLEN_GRAD_V3_PARAMS, sinkIn="attentionIn", softmaxInLayout="pseType",
                                 dsinkOut="dpseOut")

aclnnFlashAttentionVarLenScoreGetWorkspaceSize, aclnnFlashAttentionVarLenScore = two_phase(
    "aclnnFlashAttentionVarLenScore", forward_prepare(contract, v1_params(VARLEN_FORWARD_V2_PARAMS)))
aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize, aclnnFlashAttentionVarLenScoreV2 = two_phase(
    "aclnnFlashAttentionVarLenScoreV2", forward_prepare(contract, VARLEN_FORWARD_V2_PARAMS))
aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGrad = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGrad", grad_prepare(contract, v1_params(VARLEN_GRAD_V2_PARAMS)))
aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGradV2 = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGradV2", grad_prepare(contract, VARLEN_GRAD_V2_PARAMS))
aclnnFlashAttentionVarLenScoreV3GetWorkspaceSize, aclnnFlashAttentionVarLenScoreV3 = two_phase(
    "aclnnFlashAttentionVarLenScoreV3", forward_prepare(contract, VARLEN_FORWARD_V3_PARAMS))
aclnnFlashAttentionUnpaddingScoreGradV3GetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGradV3 = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGradV3", grad_prepare(contract, VARLEN_GRAD_V3_PARAMS))
aclnnFlashAttentionVarLenScoreV4GetWorkspaceSize, aclnnFlashAttentionVarLenScoreV4 = two_phase(
    "aclnnFlashAttentionVarLenScoreV4", forward_prepare(contract, VARLEN_FORWARD_V4_PARAMS))
aclnnFlashAttentionUnpaddingScoreGradV4GetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGradV4 = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGradV4", grad_prepare(contract, VARLEN_GRAD_V4_PARAMS))
aclnnFlashAttentionVarLenScoreV5GetWorkspaceSize, aclnnFlashAttentionVarLenScoreV5 = two_phase(
    "aclnnFlashAttentionVarLenScoreV5", forward_prepare(contract, VARLEN_FORWARD_V5_PARAMS))
aclnnFlashAttentionUnpaddingScoreGradV5GetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGradV5 = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGradV5", grad_prepare(contract, VARLEN_GRAD_V5_PARAMS))
