"""aclnnFlashAttentionScore(V2, V3) and aclnnFlashAttentionScoreGrad(V2, V3): thin two-phase wrappers.

Each API's parameters are listed once, in CANN's C order, as the names of CANN's aclnn docs. V2 adds
``qStartIdxOptional, kvStartIdxOptional`` after ``prefixOptional`` and ``pseType`` after ``sparseMode``; V1
runs with pseType 1. V3 adds ``sinkOptional`` after ``attenMaskOptional``; GradV3 adds ``sinkInOptional``
after ``attentionInOptional`` and ``dsinkOut`` after ``dpseOut`` (attngrad: every dtype, not only float16 /
bfloat16). The arguments become the contract's ``AttentionAttrs`` and ``AttentionTensors``
(:mod:`attngrad.ops.flash_attention_core`); all checks live in :mod:`attngrad.ops.flash_attention`
(``cann_limits=True``: the forward results are required by the grad, outputs are required, all-empty grad
outputs succeed). ``softmaxOutOut``, ``paddingMaskOptional``, ``softmaxInOptional`` and ``dpseOut`` are reserved
by CANN and left untouched. :func:`forward_prepare` and :func:`grad_prepare` also serve the varlen APIs of
:mod:`attngrad.aclnn.flash_attention_varlen`.
"""

from __future__ import annotations

from ..ops import flash_attention as contract
from ..ops.flash_attention_core import AttentionAttrs, AttentionTensors
from ..ops.flash_attention_checks import FORWARD_OUTPUTS, GRAD_OUTPUTS
from ..ops.flash_attention_sink_rope import EXTRA_GRAD_OUTPUTS, check_extra_outputs
from ..validation import check_choice
from .executor import as_ints, as_torch_views, check_formats_nd, no_work, two_phase, write_output

FORWARD_V2_PARAMS = ("query", "key", "value", "realShift", "dropMask", "paddingMask", "attenMask", "prefix",
                     "qStartIdx", "kvStartIdx", "scaleValue", "keepProb", "preTokens", "nextTokens", "headNum",
                     "inputLayout", "innerPrecise", "sparseMode", "pseType", "softmaxMaxOut", "softmaxSumOut",
                     "softmaxOutOut", "attentionOutOut")
GRAD_V2_PARAMS = ("query", "keyIn", "value", "dy", "pseShift", "dropMask", "paddingMask", "attenMask", "softmaxMax",
                  "softmaxSum", "softmaxIn", "attentionIn", "prefix", "qStartIdx", "kvStartIdx", "scaleValue",
                  "keepProb", "preTokens", "nextTokens", "headNum", "inputLayout", "innerPrecise", "sparseMode",
                  "pseType", "dqOut", "dkOut", "dvOut", "dpseOut")
V2_ONLY_PARAMS = ("qStartIdx", "kvStartIdx", "pseType")


def inserted(params: tuple[str, ...], **after: str) -> tuple[str, ...]:
    """``params`` with each new parameter (keyword) inserted right after the existing one it names."""
    out = list(params)
    for new, anchor in after.items():
        out.insert(out.index(anchor) + 1, new)
    return tuple(out)


FORWARD_V3_PARAMS = inserted(FORWARD_V2_PARAMS, sink="attenMask")
GRAD_V3_PARAMS = inserted(GRAD_V2_PARAMS, sinkIn="attentionIn", dsinkOut="dpseOut")

# aclTensor inputs (given positionally to the contract) and outputs, by CANN name
FORWARD_INPUTS = ("query", "key", "value")
GRAD_INPUTS = ("query", "keyIn", "value", "dy")
OUTPUT_TENSORS = (*FORWARD_OUTPUTS, "softmaxOutOut", *GRAD_OUTPUTS, "dpseOut", *EXTRA_GRAD_OUTPUTS)
# optional aclTensor parameters -> the AttentionTensors field (padding_mask / softmax_in: reserved by CANN)
TENSOR_KEYWORDS = {"realShift": "pse", "pseShift": "pse", "dropMask": "drop_mask", "paddingMask": "padding_mask",
                   "attenMask": "atten_mask", "softmaxMax": "softmax_max", "softmaxSum": "softmax_sum",
                   "softmaxIn": "softmax_in", "attentionIn": "attention_in", "queryRope": "query_rope",
                   "keyRope": "key_rope", "keyInRope": "key_rope", "sink": "sink", "sinkIn": "sink"}
# aclIntArray parameters -> the contract's keyword, in the order they are converted
INT_ARRAY_KEYWORDS = {"actualSeqQLen": "actual_seq_qlen", "actualSeqKvLen": "actual_seq_kvlen", "prefix": "prefix",
                      "qStartIdx": "q_start_idx", "kvStartIdx": "kv_start_idx"}
ATTRIBUTE_KEYWORDS = {"scaleValue": "scale_value", "keepProb": "keep_prob", "preTokens": "pre_tokens",
                      "nextTokens": "next_tokens", "headNum": "head_num", "inputLayout": "input_layout",
                      "innerPrecise": "inner_precise", "sparseMode": "sparse_mode", "pseType": "pse_type"}
# the TND statistics' data order (varlen V4 / V5): aclnn's string -> the contract's softmax_layout; null reads as ""
SOFTMAX_LAYOUT_PARAMS = ("softmaxOutLayout", "softmaxInLayout")
CANN_SOFTMAX_LAYOUTS = {"": "", "same_as_input": "TND"}


def v1_params(params: tuple[str, ...]) -> tuple[str, ...]:
    """The V1 API's parameters: the V2 ones without qStartIdx, kvStartIdx and pseType (pseType 1)."""
    return tuple(p for p in params if p not in V2_ONLY_PARAMS)


def _arguments(op: str, params: tuple[str, ...],
               args: tuple) -> tuple[dict, dict, AttentionAttrs, AttentionTensors]:
    """CANN's positional arguments -> ``(given aclTensors, their torch views, attrs, optional tensors)``, the
    first two by CANN name. Tensors are converted first (in C order), then the aclIntArrays."""
    if len(args) != len(params):
        raise TypeError(f"{op} takes {len(params)} arguments ({len(args)} given)")
    given = dict(zip(params, args))
    acl_tensors = {p: v for p, v in given.items() if p in (*FORWARD_INPUTS, *GRAD_INPUTS, *OUTPUT_TENSORS,
                                                            *TENSOR_KEYWORDS)}
    views = as_torch_views(op, acl_tensors)
    tensors = AttentionTensors(**{TENSOR_KEYWORDS[p]: t for p, t in views.items() if p in TENSOR_KEYWORDS})
    attributes = {k: as_ints(op, p, given[p]) for p, k in INT_ARRAY_KEYWORDS.items() if p in given}
    attributes.update((ATTRIBUTE_KEYWORDS[p], v) for p, v in given.items() if p in ATTRIBUTE_KEYWORDS)
    for p in SOFTMAX_LAYOUT_PARAMS:
        if p in given:
            attributes["softmax_layout"] = _softmax_layout(op, p, given[p])
    return acl_tensors, views, AttentionAttrs.from_kwargs(**attributes), tensors


def _softmax_layout(op: str, name: str, value) -> str:
    """aclnn's softmaxOutLayout / softmaxInLayout ("" or null: CANN's default per-batch order, "same_as_input":
    rows in the input's TND order) as the contract's softmax_layout ("" / "TND")."""
    value = "" if value is None else value
    check_choice(op, name, value, CANN_SOFTMAX_LAYOUTS)
    return CANN_SOFTMAX_LAYOUTS[value]


def _views(views: dict, names: tuple[str, ...]) -> tuple:
    """The torch views of the aclTensors ``names``."""
    return tuple(views[n] for n in names)


def forward_prepare(contract_module, params: tuple[str, ...]):
    """The ``prepare(*args)`` of a forward API taking ``params`` (CANN's order) for :func:`two_phase`:
    ``contract_module.check_forward`` validates, the run writes attentionOut, softmaxMax and softmaxSum."""
    op = contract_module.FORWARD

    def prepare(*args):
        acl_tensors, t, attrs, tensors = _arguments(op, params, args)
        problem = contract_module.check_forward(*_views(t, FORWARD_INPUTS), attrs, tensors,
                                                outputs=_views(t, FORWARD_OUTPUTS), cann_limits=True)
        check_formats_nd(op, acl_tensors)

        def run():
            out, softmax_max, softmax_sum = contract_module.run_forward(problem)
            write_output(t["attentionOutOut"], out)
            write_output(t["softmaxMaxOut"], softmax_max)
            write_output(t["softmaxSumOut"], softmax_sum)
        return run
    return prepare


def grad_prepare(contract_module, params: tuple[str, ...]):
    """The ``prepare(*args)`` of a grad API taking ``params`` (CANN's order) for :func:`two_phase`:
    ``contract_module.check_backward`` validates (None: all outputs empty, CANN returns success and computes
    nothing), the run writes dq, dk and dv (and dqRopeOut, dkRopeOut, dsinkOut where the API has them)."""
    op = contract_module.BACKWARD

    def prepare(*args):
        acl_tensors, t, attrs, tensors = _arguments(op, params, args)
        problem = contract_module.check_backward(*_views(t, GRAD_INPUTS), attrs, tensors,
                                                 outputs=_views(t, GRAD_OUTPUTS), cann_limits=True)
        if problem is None:
            return no_work
        extra_outputs = {name: t.get(name) for name in EXTRA_GRAD_OUTPUTS if name in params}
        check_extra_outputs(op, extra_outputs, tensors)
        check_formats_nd(op, acl_tensors)

        def run():
            grads = contract_module.run_backward(problem)
            for name, grad in zip(GRAD_OUTPUTS, grads):
                write_output(t[name], grad)
            for name, target in extra_outputs.items():
                result = getattr(grads, EXTRA_GRAD_OUTPUTS[name][1])
                if result is not None:
                    write_output(target, result)
        return run
    return prepare


aclnnFlashAttentionScoreGetWorkspaceSize, aclnnFlashAttentionScore = two_phase(
    "aclnnFlashAttentionScore", forward_prepare(contract, v1_params(FORWARD_V2_PARAMS)))
aclnnFlashAttentionScoreV2GetWorkspaceSize, aclnnFlashAttentionScoreV2 = two_phase(
    "aclnnFlashAttentionScoreV2", forward_prepare(contract, FORWARD_V2_PARAMS))
aclnnFlashAttentionScoreV3GetWorkspaceSize, aclnnFlashAttentionScoreV3 = two_phase(
    "aclnnFlashAttentionScoreV3", forward_prepare(contract, FORWARD_V3_PARAMS))
aclnnFlashAttentionScoreGradGetWorkspaceSize, aclnnFlashAttentionScoreGrad = two_phase(
    "aclnnFlashAttentionScoreGrad", grad_prepare(contract, v1_params(GRAD_V2_PARAMS)))
aclnnFlashAttentionScoreGradV2GetWorkspaceSize, aclnnFlashAttentionScoreGradV2 = two_phase(
    "aclnnFlashAttentionScoreGradV2", grad_prepare(contract, GRAD_V2_PARAMS))
aclnnFlashAttentionScoreGradV3GetWorkspaceSize, aclnnFlashAttentionScoreGradV3 = two_phase(
    "aclnnFlashAttentionScoreGradV3", grad_prepare(contract, GRAD_V3_PARAMS))
