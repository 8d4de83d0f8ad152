"""aclnnFlashAttentionVarLenScore(V2) and aclnnFlashAttentionUnpaddingScoreGrad(V2): thin two-phase wrappers.

Parameters in CANN's C order: the forward per CANN's aclnnFlashAttentionVarLenScore[V2] docs (the
FlashAttentionScore order with ``actualSeqQLenOptional, actualSeqKvLenOptional`` after ``prefixOptional``),
the grad per spec section 1.5. V2 adds ``qStartIdxOptional, kvStartIdxOptional`` after the sequence
lengths and ``pseType`` after ``sparseMode``; V1 runs with pseType 1. inputLayout must be "TND" and
softmaxMax/Sum use CANN's default data order (per-batch [N1, Sq_b, 8] blocks). All checks live in
:mod:`attngrad.ops.flash_attention_varlen` (``cann_limits=True``). ``softmaxOutOut``,
``paddingMaskOptional``, ``softmaxInOptional`` and ``dpseOut`` are reserved by CANN and left untouched.
"""

from __future__ import annotations

from ..ops import flash_attention_varlen as contract
from .executor import as_ints, two_phase, write_output
from .flash_attention import _check_formats, _tensors


def _prepare_forward_v2(query, key, value, real_shift, drop_mask, padding_mask, atten_mask, prefix,
                        actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx, scale_value, keep_prob,
                        pre_tokens, next_tokens, head_num, input_layout, inner_precise, sparse_mode, pse_type,
                        softmax_max_out, softmax_sum_out, softmax_out_out, attention_out_out):
    op = contract.FORWARD
    named = {"query": query, "key": key, "value": value, "realShift": real_shift, "dropMask": drop_mask,
             "paddingMask": padding_mask, "attenMask": atten_mask, "softmaxMaxOut": softmax_max_out,
             "softmaxSumOut": softmax_sum_out, "softmaxOutOut": softmax_out_out,
             "attentionOutOut": attention_out_out}
    t = _tensors(op, named)
    problem = contract.check_forward(
        t["query"], t["key"], t["value"], head_num, input_layout,
        actual_seq_qlen=as_ints(op, "actualSeqQLen", actual_seq_qlen),
        actual_seq_kvlen=as_ints(op, "actualSeqKvLen", actual_seq_kvlen), pse=t["realShift"],
        drop_mask=t["dropMask"], atten_mask=t["attenMask"], prefix=as_ints(op, "prefix", prefix),
        q_start_idx=as_ints(op, "qStartIdx", q_start_idx), kv_start_idx=as_ints(op, "kvStartIdx", kv_start_idx),
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
        softmax_max_out=t["softmaxMaxOut"], softmax_sum_out=t["softmaxSumOut"],
        attention_out=t["attentionOutOut"], cann_limits=True)
    _check_formats(op, named)

    def run():
        out, softmax_max, softmax_sum = contract.run_forward(problem)
        write_output(t["attentionOutOut"], out)
        write_output(t["softmaxMaxOut"], softmax_max)
        write_output(t["softmaxSumOut"], softmax_sum)
    return run


def _prepare_forward(query, key, value, real_shift, drop_mask, padding_mask, atten_mask, prefix, actual_seq_qlen,
                     actual_seq_kvlen, scale_value, keep_prob, pre_tokens, next_tokens, head_num, input_layout,
                     inner_precise, sparse_mode, softmax_max_out, softmax_sum_out, softmax_out_out,
                     attention_out_out):
    return _prepare_forward_v2(query, key, value, real_shift, drop_mask, padding_mask, atten_mask, prefix,
                               actual_seq_qlen, actual_seq_kvlen, None, None, scale_value, keep_prob, pre_tokens,
                               next_tokens, head_num, input_layout, inner_precise, sparse_mode, 1,
                               softmax_max_out, softmax_sum_out, softmax_out_out, attention_out_out)


def _prepare_grad_v2(query, key_in, value, dy, pse_shift, drop_mask, padding_mask, atten_mask, softmax_max,
                     softmax_sum, softmax_in, attention_in, prefix, actual_seq_qlen, actual_seq_kvlen, q_start_idx,
                     kv_start_idx, scale_value, keep_prob, pre_tokens, next_tokens, head_num, input_layout,
                     inner_precise, sparse_mode, pse_type, dq_out, dk_out, dv_out, dpse_out):
    op = contract.BACKWARD
    named = {"query": query, "keyIn": key_in, "value": value, "dy": dy, "pseShift": pse_shift,
             "dropMask": drop_mask, "paddingMask": padding_mask, "attenMask": atten_mask,
             "softmaxMax": softmax_max, "softmaxSum": softmax_sum, "softmaxIn": softmax_in,
             "attentionIn": attention_in, "dqOut": dq_out, "dkOut": dk_out, "dvOut": dv_out, "dpseOut": dpse_out}
    t = _tensors(op, named)
    problem = contract.check_backward(
        t["query"], t["keyIn"], t["value"], t["dy"], head_num, input_layout,
        actual_seq_qlen=as_ints(op, "actualSeqQLen", actual_seq_qlen),
        actual_seq_kvlen=as_ints(op, "actualSeqKvLen", actual_seq_kvlen), pse=t["pseShift"],
        drop_mask=t["dropMask"], atten_mask=t["attenMask"], softmax_max=t["softmaxMax"],
        softmax_sum=t["softmaxSum"], attention_in=t["attentionIn"], prefix=as_ints(op, "prefix", prefix),
        q_start_idx=as_ints(op, "qStartIdx", q_start_idx), kv_start_idx=as_ints(op, "kvStartIdx", kv_start_idx),
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
        inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type, dq_out=t["dqOut"],
        dk_out=t["dkOut"], dv_out=t["dvOut"], cann_limits=True)
    if problem is None:  # all outputs empty: CANN returns success and computes nothing
        return lambda: None
    _check_formats(op, named)

    def run():
        for name, grad in zip(("dqOut", "dkOut", "dvOut"), contract.run_backward(problem)[:3]):
            write_output(t[name], grad)
    return run


def _prepare_grad(query, key_in, value, dy, pse_shift, drop_mask, padding_mask, atten_mask, softmax_max,
                  softmax_sum, softmax_in, attention_in, prefix, actual_seq_qlen, actual_seq_kvlen, scale_value,
                  keep_prob, pre_tokens, next_tokens, head_num, input_layout, inner_precise, sparse_mode, dq_out,
                  dk_out, dv_out, dpse_out):
    return _prepare_grad_v2(query, key_in, value, dy, pse_shift, drop_mask, padding_mask, atten_mask, softmax_max,
                            softmax_sum, softmax_in, attention_in, prefix, actual_seq_qlen, actual_seq_kvlen, None,
                            None, scale_value, keep_prob, pre_tokens, next_tokens, head_num, input_layout,
                            inner_precise, sparse_mode, 1, dq_out, dk_out, dv_out, dpse_out)


aclnnFlashAttentionVarLenScoreGetWorkspaceSize, aclnnFlashAttentionVarLenScore = two_phase(
    "aclnnFlashAttentionVarLenScore", _prepare_forward)
aclnnFlashAttentionVarLenScoreV2GetWorkspaceSize, aclnnFlashAttentionVarLenScoreV2 = two_phase(
    "aclnnFlashAttentionVarLenScoreV2", _prepare_forward_v2)
aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGrad = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGrad", _prepare_grad)
aclnnFlashAttentionUnpaddingScoreGradV2GetWorkspaceSize, aclnnFlashAttentionUnpaddingScoreGradV2 = two_phase(
    "aclnnFlashAttentionUnpaddingScoreGradV2", _prepare_grad_v2)
