"""Malformed input at every entry point: torch layer, torch_npu names, aclnn V1/V2.

Cases come from :mod:`reliability_cases`: a valid call, then generic mutations (dtypes incl. int, float64,
complex and bool, ranks, dims, layouts, head counts, non-tensors, meta / sparse / negated-bit tensors,
tensors requiring grad, out-of-range and non-numeric attributes, bad length arrays, overlapping aclnn
outputs). Each must end in ``AclnnError`` naming a parameter, or an aclnn status whose message names one
with the outputs untouched, or a correct result (float64 golden). Every family also runs in a child
process, so a hard crash fails the suite instead of killing it.
"""

from __future__ import annotations

import random

import pytest
import torch

import attngrad
from attngrad import AclnnError, aclnn
from crashproof import assert_child_ok
from reliability_cases import (ACL, INVALID, NULL, OPS, SENTINEL, VARLEN_OPS, drop_mask_bytes, fa_forward_args,
                               fa_grad_args, malformed_family, make_outs, run_case, run_two_phase,
                               single_mutation_cases)

OP_NAMES = sorted(set(OPS) - set(VARLEN_OPS))  # varlen (TND): tests/test_reliability_varlen.py
TENSOR_KINDS = ("data", "mask", "stats", "out")
ATTR_KINDS = ("float", "int", "bool", "str", "ints")


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_single_tensor_mutation_every_entry_point(op):
    """Exhaustive: each tensor parameter x each tensor mutation, torch layer and aclnn V2 (the child process
    sweeps the npu names and aclnn V1)."""
    for case in single_mutation_cases(op, TENSOR_KINDS, ("torch", "aclnn")):
        run_case(case)


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_single_attribute_value(op):
    """Exhaustive: each attribute x each out-of-range / non-numeric / odd-typed value (torch and aclnn V2)."""
    for case in single_mutation_cases(op, ATTR_KINDS, ("torch", "aclnn")):
        run_case(case)


@pytest.mark.parametrize("op", OP_NAMES)
def test_generated_malformed_calls(op):
    """Hypothesis: one or two random mutations on random entry points, dtypes and shapes."""
    malformed_family(op, 60, seed_value=0)


@pytest.mark.parametrize("op", OP_NAMES)
def test_malformed_family_in_child_process(op):
    result = assert_child_ok("reliability_cases:malformed_family_child", op, 30, 1, timeout=600)
    assert f"family {op} ok" in result.stdout


# --- targeted cross-cutting rules the generator reaches only by chance ---
FA_FORWARD = OPS["flash_attention_score"]
SMS_FWD = (aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmax)
SEG_BWD = (aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward)


def _fa_status(layer: str, a: dict, **changes) -> tuple[int, str]:
    """(status, message) of the valid FlashAttentionScore call ``a`` with ``changes`` on ``layer``; aclnn
    outputs (shaped for ``a``) must stay untouched when the call is rejected."""
    outs = make_outs(FA_FORWARD, a) if layer in ACL else {}
    try:
        result = FA_FORWARD.callers[layer](dict(a, **changes), outs)
    except AclnnError as err:
        return err.status, str(err)
    if layer not in ACL:
        return 0, ""
    if result:
        assert all(bool((t == SENTINEL).all()) for t in outs.values()), "a rejected call wrote an output"
    return result, aclnn.aclGetRecentErrMsg()


@pytest.mark.parametrize("layer", ["torch", "aclnn", "aclnn_v1"])
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_too_small_or_mistyped_drop_mask(layer, layout):
    a = fa_forward_args(random.Random(3), torch.float16, layout=layout)
    need = drop_mask_bytes(a)
    for bad in (torch.zeros(need - 1, dtype=torch.uint8), torch.zeros(need, dtype=torch.bool),
                torch.zeros(need, dtype=torch.int32), torch.zeros(need, dtype=torch.uint8, device="meta")):
        status, msg = _fa_status(layer, a, keep_prob=0.5, drop_mask=bad)
        assert status == INVALID and "dropMask" in msg, msg
    status, msg = _fa_status(layer, a, keep_prob=0.5, drop_mask=None)
    assert status == NULL and "dropMask" in msg, msg


@pytest.mark.parametrize("layer", ["torch", "npu", "npu_v2", "aclnn", "aclnn_v1"])
@pytest.mark.parametrize("keep_prob", [0.0, -0.25, 1.0 + 2**-40, float("nan"), float("inf"), float("-inf")])
def test_keep_prob_out_of_range_every_entry_point(layer, keep_prob):
    a = fa_forward_args(random.Random(5), torch.float32)
    mask = torch.zeros(drop_mask_bytes(a), dtype=torch.uint8)
    status, msg = _fa_status(layer, a, keep_prob=keep_prob, drop_mask=mask)
    assert status == INVALID and ("keepProb" in msg or "keep_prob" in msg), msg


@pytest.mark.parametrize("value, rule", [(2**63, "int64"), (-2**63 - 1, "int64"), (2.0, "integer"),
                                         (True, "integer"), ("7", "integer")])
@pytest.mark.parametrize("name", ["pre_tokens", "next_tokens", "sparse_mode", "inner_precise", "pse_type",
                                  "head_num"])
def test_integer_attributes_beyond_int64_or_not_integers(name, value, rule):
    a = fa_forward_args(random.Random(1), torch.float32)
    for layer in ("torch", "aclnn"):
        status, msg = _fa_status(layer, a, **{name: value})
        assert status == INVALID and rule in msg, msg


@pytest.mark.parametrize("scale", [2**1100, -(2**2000)])
def test_real_attributes_beyond_double(scale):
    x, mask = torch.randn(1, 1, 2, 4), torch.zeros(1, 1, 2, 4, dtype=torch.bool)
    for call in (lambda: attngrad.scaled_masked_softmax(x, mask, scale),
                 lambda: attngrad.scaled_masked_softmax_backward(x, x, mask, scale)):
        with pytest.raises(AclnnError, match="scale"):
            call()
    status, msg = _fa_status("aclnn", fa_forward_args(random.Random(2), torch.float32), scale_value=scale)
    assert status == INVALID and "scaleValue" in msg


def test_grad_partial_saved_results_is_nullptr():
    """Torch / npu layers: some but not all of softmax_max / softmax_sum / attention_in -> 161001."""
    a = fa_grad_args(random.Random(4), torch.float32, "aclnn")
    for missing in ("softmax_max", "softmax_sum", "attention_in"):
        for layer in ("torch", "npu", "npu_v2"):
            with pytest.raises(AclnnError) as info:
                OPS["flash_attention_score_grad"].callers[layer](dict(a, **{missing: None}), {})
            assert info.value.status == NULL, str(info.value)


@pytest.mark.parametrize("dims", [[2**32, 2**32, 1, 1], [2**62, 4, 1, 1], [1, 1, 2**40, 2**40]])
def test_aclnn_view_descriptions_beyond_int64_are_rejected(dims):
    """A view whose element count wraps int64 must not slip through the storage bounds check."""
    _, ptr = aclnn.aclrtMalloc(64)
    x = aclnn.aclCreateTensor(dims, aclnn.ACL_FLOAT, None, 0, aclnn.ACL_FORMAT_ND, [16], ptr)
    y = torch.full((1, 1, 1, 1), SENTINEL)
    assert run_two_phase(SMS_FWD, x, torch.zeros(1, 1, 1, 1, dtype=torch.bool), 1.0, False, y) == INVALID
    assert "x" in aclnn.aclGetRecentErrMsg() and bool((y == SENTINEL).all())
    aclnn.aclrtFree(ptr)


def test_aclnn_view_description_with_non_integer_dims():
    _, ptr = aclnn.aclrtMalloc(64)
    bad = aclnn.AclTensor(("a", 1, 1, 1), aclnn.ACL_FLOAT, (1, 1, 1, 1), 0, aclnn.ACL_FORMAT_ND, (16,), ptr)
    assert run_two_phase(SEG_BWD, bad, bad, torch.zeros(1)) == INVALID
    assert "gradOutput" in aclnn.aclGetRecentErrMsg()
    aclnn.aclrtFree(ptr)
