"""Reliability of the varlen (TND) entry points, and valid optional inputs of the BNSD ones.

Varlen: the torch layer / torch_npu names with inputLayout "TND" and aclnnFlashAttentionVarLenScore[V2] /
aclnnFlashAttentionUnpaddingScoreGrad[V2]. Cases come from :mod:`reliability_cases`: a valid TND call
(empty batches, T beyond the totals with trailing (0, 0) entries, list or int tensor lengths, softmax
layout "" / "TND" / None), then mutations of the length arrays (non-cumulative, negative, wrong count,
beyond T, tail rule, non-integers, tensors of wrong dtype or rank, None), of softmaxLayout, and the generic
tensor / attribute mutations. Each call must end in a 161001/161002 naming a parameter (aclnn: outputs
untouched) or match the per-batch float64 golden. The targeted tests pin the status and the parameter of
each length-array rule on every entry point.
"""

from __future__ import annotations

import random

import pytest
import torch

from attngrad import AclnnError, aclnn
from crashproof import assert_child_ok
from reliability_cases import (ACL, ALL, INVALID, NULL, OPS, SENTINEL, VARLEN_OPS, malformed_family, make_outs,
                               run_case, run_valid, single_mutation_cases, varlen_forward_args)

TENSOR_KINDS = ("data", "mask", "stats", "out", "opt")
ATTR_KINDS = ("float", "int", "bool", "str", "ints", "seqlen", "softmax_layout")
VARLEN = OPS["flash_attention_varlen"]


@pytest.mark.parametrize("op", VARLEN_OPS)
def test_every_single_mutation_torch_and_aclnn_v2(op):
    """Exhaustive: each parameter x each mutation of its catalog (length arrays included), torch layer and
    aclnn V2 (the child process sweeps the npu names and aclnn V1)."""
    for case in single_mutation_cases(op, TENSOR_KINDS + ATTR_KINDS, ("torch", "aclnn")):
        run_case(case)


@pytest.mark.parametrize("op", VARLEN_OPS)
def test_generated_malformed_varlen_calls(op):
    """Hypothesis (fixed seed): one or two random mutations on random entry points, dtypes and lengths."""
    malformed_family(op, 100, seed_value=0)


@pytest.mark.parametrize("op", VARLEN_OPS)
def test_varlen_family_in_child_process(op):
    result = assert_child_ok("reliability_cases:varlen_child", op, 60, 1, timeout=600)
    assert f"family {op} ok" in result.stdout


@pytest.mark.parametrize("op", VARLEN_OPS)
@pytest.mark.parametrize("layer", ALL)
def test_valid_varlen_calls_succeed_and_match(op, layer):
    for seed_value in range(6):
        run_valid((op, layer, ("float32", "float16", "bfloat16")[seed_value % 3], seed_value))


# --- the length-array rules, status and parameter pinned on every entry point ---
def _call(layer: str, a: dict, **changes) -> tuple[int, str]:
    """(status, message) of the varlen forward ``a`` with ``changes`` on ``layer``; 0 when accepted (then the
    result is checked against the golden). A rejected aclnn call must leave its outputs untouched."""
    a = dict(a, **changes)
    outs = make_outs(VARLEN, a) if layer in ACL else {}
    try:
        result = VARLEN.callers[layer](a, outs)
    except AclnnError as err:
        return err.status, str(err)
    if layer not in ACL:
        VARLEN.check(a, result)
        return 0, ""
    if result:
        assert all(bool((t == SENTINEL).all()) for t in outs.values()), "a rejected call wrote an output"
        return result, aclnn.aclGetRecentErrMsg()
    VARLEN.check(a, outs)
    return 0, ""


def _base(t1: int = 5, t2: int = 9, dtype=torch.float32) -> dict:
    """Batches (Sq, Skv) = (2, 3), (0, 2), (3, 4): cumulative [2, 2, 5] / [3, 5, 9]; T1 = t1, T2 = t2."""
    g = torch.Generator().manual_seed(7)
    a = varlen_forward_args(random.Random(0), dtype)
    a.update(query=torch.randn(t1, 2, 4, generator=g).to(dtype), key=torch.randn(t2, 1, 4, generator=g).to(dtype),
             value=torch.randn(t2, 1, 4, generator=g).to(dtype), head_num=2, actual_seq_qlen=[2, 2, 5],
             actual_seq_kvlen=[3, 5, 9], softmax_layout="", keep_prob=1.0, drop_mask=None)
    return a


BAD_LENGTHS = [  # (actual_seq_qlen, actual_seq_kvlen, status, a parameter the message must name)
    ([2, 1, 5], [3, 5, 9], INVALID, "actualSeqQLen"),         # not cumulative (decreasing)
    ([2, 2, 5], [3, 2, 9], INVALID, "actualSeqKvLen"),
    ([2, 3, 5], [3, 2, 3], INVALID, "actualSeqKvLen"),        # per-batch lengths instead of ends
    ([-1, 2, 5], [3, 5, 9], INVALID, "actualSeqQLen"),        # negative
    ([2, 2, 5], [-3, 5, 9], INVALID, "actualSeqKvLen"),
    ([2, 5], [3, 5, 9], INVALID, "actualSeqKvLen"),           # wrong count
    ([2, 2, 5], [3, 9], INVALID, "actualSeqKvLen"),
    ([], [], INVALID, "actualSeqQLen"),                       # empty
    ([2, 2, 6], [3, 5, 9], INVALID, "query"),                 # sum beyond T1
    ([2, 2, 5], [3, 5, 10], INVALID, "key"),                  # sum beyond T2
    ([2, 2, 5], [3, 5, 2**63], INVALID, "actualSeqKvLen"),    # beyond int64
    ([2, 2, 2.5], [3, 5, 9], INVALID, "actualSeqQLen"),       # non-integers
    ([2, 2, 5], ["3", 5, 9], INVALID, "actualSeqKvLen"),
    ([2, 2, 5], [3, 5, None], INVALID, "actualSeqKvLen"),
    (torch.tensor([2., 2., 5.]), [3, 5, 9], INVALID, "actualSeqQLen"),   # tensors of a wrong dtype / rank
    (torch.tensor([True, True]), [3, 5], INVALID, "actualSeqQLen"),
    ([2, 2, 5], torch.tensor([[3, 5, 9]]), INVALID, "actualSeqKvLen"),
    ("2,2,5", [3, 5, 9], INVALID, "actualSeqQLen"),
    (5, [3, 5, 9], INVALID, "actualSeqQLen"),
    (None, [3, 5, 9], NULL, "actualSeqQLen"),                 # None
    ([2, 2, 5], None, NULL, "actualSeqKvLen"),
]
BAD_LENGTH_CASES = [(layer, i) for i in range(len(BAD_LENGTHS)) for layer in ALL]


@pytest.mark.parametrize("layer, index", BAD_LENGTH_CASES)
def test_bad_length_arrays_every_entry_point(layer, index):
    q, kv, status, name = BAD_LENGTHS[index]
    got, msg = _call(layer, _base(), actual_seq_qlen=q, actual_seq_kvlen=kv)
    assert got == status and name in msg, msg


@pytest.mark.parametrize("layer", ALL)
def test_tail_rule(layer):
    """T1 and T2 both beyond the totals: the arrays must end with 0 (docs/cann-semantics.md, 'Varlen (TND)');
    with the trailing (0, 0) the call is valid and rows beyond the totals are 0."""
    a = _base(t1=7, t2=10)
    status, msg = _call(layer, a)
    assert status == INVALID and "actualSeqQLen" in msg, msg
    assert _call(layer, a, actual_seq_qlen=[2, 2, 5, 0], actual_seq_kvlen=[3, 5, 9, 0]) == (0, "")
    assert _call(layer, _base(t1=7), actual_seq_qlen=[2, 2, 5], actual_seq_kvlen=[3, 5, 9]) == (0, "")


@pytest.mark.parametrize("layer", ("torch", "npu", "npu_v2"))
@pytest.mark.parametrize("value, valid", [("", True), (None, True), ("TND", True), ("tnd", False), ("BSND", False),
                                          ("TND ", False), (0, False), (b"TND", False), (["TND"], False)])
def test_softmax_layout_values(layer, value, valid):
    status, msg = _call(layer, _base(dtype=torch.float16), softmax_layout=value)
    assert (status == 0) if valid else (status == INVALID and "softmaxLayout" in msg), msg


@pytest.mark.parametrize("layer", ("torch", "npu", "npu_v2", "aclnn", "aclnn_v1"))
def test_drop_mask_size_is_n1_sum_sq_skv(layer):
    """keepProb < 1 needs ceil(N1 * sum Sq_b*Skv_b / 8) bytes: N1 2 * (2*3 + 0*2 + 3*4) = 36 bits, 5 bytes
    (not the B*N1*maxSq*maxSkv of a padded layout); with exactly that, the per-batch bit blocks match."""
    a = _base(dtype=torch.bfloat16)
    mask = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    for bad, code in ((mask[:4], INVALID), (mask.bool(), INVALID), (mask.to(torch.int32), INVALID),
                      (mask.to("meta"), INVALID), (None, NULL)):
        if layer.startswith("npu") and bad is None:
            continue  # the npu names draw their own mask
        status, msg = _call(layer, a, keep_prob=0.5, drop_mask=bad)
        assert status == code and "dropMask" in msg, msg
    assert _call(layer, a, keep_prob=0.5, drop_mask=mask) == (0, "")


@pytest.mark.parametrize("layer", ("torch", "npu", "npu_v2"))
@pytest.mark.parametrize("which", ("actual_seq_qlen", "actual_seq_kvlen"))
def test_meta_tensor_lengths(layer, which):
    a = _base()
    status, msg = _call(layer, a, **{which: torch.tensor(a[which]).to("meta")})
    assert status == INVALID, msg


# --- valid optional inputs of the BNSD descriptions (mask / sparse modes, pse, dropout) ---
@pytest.mark.parametrize("op", ("flash_attention_score", "flash_attention_score_grad"))
@pytest.mark.parametrize("layer", ALL)
def test_valid_optional_inputs_match_golden(op, layer):
    """The generated valid calls carry attenMask (bool/uint8, sparseMode 0-4), pse (pseType 0/1) and explicit
    dropout; every one must succeed and match the float64 golden, and each feature must be reached."""
    seen = set()
    for seed_value in range(16):
        a = run_valid((op, layer, ("float32", "float16", "bfloat16")[seed_value % 3], seed_value))
        seen |= {f"mode{a['sparse_mode']}" for _ in [0] if a["atten_mask"] is not None}
        seen |= {"pse"} if a["pse"] is not None else set()
        seen |= {"dropout"} if a["keep_prob"] < 1 else set()
    assert {"pse", "mode0"} <= seen and len(seen) >= 4, seen
    assert "dropout" in seen or (op.endswith("grad") and layer.startswith("npu")), seen
