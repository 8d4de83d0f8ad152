"""Every invalid FlashAttentionScore(Grad) input gives its CANN status (aclnn) / AclnnError naming the parameter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attngrad
from attngrad import aclnn
from attngrad.errors import AclnnError

from helpers import acl

NULL, INVALID = 161001, 161002
TOKENS = 2147483647


def base(layout="BNSD", dtype=torch.float32):
    """Valid grad arguments: B2 N1=4 N2=2 Sq5 Skv6 D8 Dv8."""
    shapes = {"BNSD": ((2, 4, 5, 8), (2, 2, 6, 8)), "BSH": ((2, 5, 32), (2, 6, 16))}[layout]
    q, k = torch.randn(shapes[0], dtype=dtype), torch.randn(shapes[1], dtype=dtype)
    v, dy = torch.randn(shapes[1], dtype=dtype), torch.randn(shapes[0], dtype=dtype)
    stats = torch.ones(2, 4, 5, 8)
    return dict(query=q, key=k, value=v, dy=dy, head_num=4, input_layout=layout, softmax_max=stats,
                softmax_sum=stats.clone(), attention_in=dy.clone())


def call_grad(**kw):
    args = base()
    args.update(kw)
    return attngrad.flash_attention_score_grad(args.pop("query"), args.pop("key"), args.pop("value"),
                                               args.pop("dy"), args.pop("head_num"), args.pop("input_layout"),
                                               **args)


def call_forward(**kw):
    args = base()
    for name in ("dy", "softmax_max", "softmax_sum", "attention_in"):
        args.pop(name)
    args.update(kw)
    return attngrad.flash_attention_score(args.pop("query"), args.pop("key"), args.pop("value"),
                                          args.pop("head_num"), args.pop("input_layout"), **args)


R = torch.randn
CASES = [  # (overrides, status, param, words in the message)
    (dict(query=None), NULL, "query", "null"),
    (dict(value=None), NULL, "value", "null"),
    (dict(softmax_sum=None), NULL, "softmaxSum", "null"),
    (dict(softmax_max=None, softmax_sum=None), NULL, "softmaxMax", "null"),
    (dict(attention_in=None), NULL, "attentionIn", "null"),
    (dict(head_num=0), INVALID, "headNum", "[1"),
    (dict(head_num=2.0), INVALID, "headNum", "integer"),
    (dict(input_layout="NSBD"), INVALID, "inputLayout", "one of"),
    (dict(input_layout=None), NULL, "inputLayout", "null"),
    (dict(input_layout="TND"), INVALID, "query", "3-D"),   # TND goes to the varlen contract
    (dict(softmax_layout="TND"), INVALID, "softmaxLayout", "TND"),
    (dict(query=R(2, 4, 5, 8, dtype=torch.float64)), INVALID, "query", "dtype"),
    (dict(key=R(2, 2, 6, 8, dtype=torch.float16)), INVALID, "key", "dtype"),
    (dict(dy=R(2, 4, 5, 8, dtype=torch.bfloat16)), INVALID, "dy", "dtype"),
    (dict(query=R(2, 4, 5)), INVALID, "query", "4-D"),
    (dict(value=R(2, 2, 7, 8)), INVALID, "value", "key"),
    (dict(dy=R(2, 4, 6, 8)), INVALID, "dy", "query"),
    (dict(key=R(3, 2, 6, 8), value=R(3, 2, 6, 8)), INVALID, "key", "query"),
    (dict(key=R(2, 2, 6, 4), value=R(2, 2, 6, 4)), INVALID, "key", "D axis"),
    (dict(value=R(2, 2, 6, 16)), INVALID, "value", "D axis"),
    (dict(head_num=3), INVALID, "headNum", "N axis"),
    (dict(key=R(2, 3, 6, 8), value=R(2, 3, 6, 8)), INVALID, "key", "GQA"),
    (dict(dy=R(2, 4, 5, 4), attention_in=R(2, 4, 5, 4)), INVALID, "dy", "Dv"),
    (dict(attention_in=R(2, 4, 5, 8, dtype=torch.float16)), INVALID, "attentionIn", "dtype"),
    (dict(keep_prob=0.0), INVALID, "keepProb", "(0"),
    (dict(keep_prob=1.5), INVALID, "keepProb", "1.0]"),
    (dict(keep_prob=0.5), NULL, "dropMask", "null"),
    (dict(keep_prob=0.5, drop_mask=torch.zeros(4, dtype=torch.int8)), INVALID, "dropMask", "dtype"),
    (dict(keep_prob=0.5, drop_mask=torch.zeros(4, dtype=torch.uint8)), INVALID, "dropMask", "bytes"),
    (dict(scale_value="1"), INVALID, "scaleValue", "real"),
    (dict(pre_tokens=1.5), INVALID, "preTokens", "integer"),
    (dict(inner_precise=3), INVALID, "innerPrecise", "2]"),
    (dict(sparse_mode=7), INVALID, "sparseMode", "TND"),
    (dict(sparse_mode=9), INVALID, "sparseMode", "8]"),
    (dict(sparse_mode=-1), INVALID, "sparseMode", "[0"),
    (dict(pse_type=4), INVALID, "pseType", "3]"),
    (dict(pse_type=0), INVALID, "pseType", "pse"),
    (dict(pse=R(2, 4, 5, 7)), INVALID, "pse", "shape must be"),
    (dict(pse=R(2, 4, 5, 6, dtype=torch.float16)), INVALID, "pse", "dtype"),
    (dict(atten_mask=torch.zeros(5, 6)), INVALID, "attenMask", "dtype"),
    (dict(atten_mask=torch.zeros(5, 7, dtype=torch.bool)), INVALID, "attenMask", "last two dims"),
    (dict(atten_mask=torch.zeros(5, 6, dtype=torch.bool), sparse_mode=2), INVALID, "attenMask", "2048"),
    (dict(atten_mask=torch.zeros(2, 2, 5, 6, dtype=torch.bool)), INVALID, "attenMask", "dims 0-1"),
    (dict(prefix=[1.5]), INVALID, "prefix", "integer"),
    (dict(softmax_max=torch.ones(2, 4, 5, 1)), INVALID, "softmaxMax", "[B, N1, Sq, 8]"),
    (dict(softmax_sum=torch.ones(2, 4, 5, 8, dtype=torch.float16)), INVALID, "softmaxSum", "dtype"),
]


@pytest.mark.parametrize("overrides,status,param,words", CASES)
def test_torch_grad_errors(overrides, status, param, words):
    with pytest.raises(AclnnError) as exc:
        call_grad(**overrides)
    assert (exc.value.status, exc.value.param) == (status, param), str(exc.value)
    assert words in str(exc.value)


FORWARD_CASES = [(o, s, p, w) for o, s, p, w in CASES
                 if not set(o) & {"dy", "softmax_max", "softmax_sum", "attention_in"}]


@pytest.mark.parametrize("overrides,status,param,words", FORWARD_CASES)
def test_torch_forward_errors(overrides, status, param, words):
    with pytest.raises(AclnnError) as exc:
        call_forward(**overrides)
    assert (exc.value.status, exc.value.param) == (status, param), str(exc.value)


def test_bsh_head_split_errors():
    args = base("BSH")
    with pytest.raises(AclnnError) as exc:
        attngrad.flash_attention_score(args["query"], args["key"], args["value"], 3, "BSH")
    assert exc.value.param == "query" and "multiple of headNum" in str(exc.value)
    with pytest.raises(AclnnError) as exc:
        attngrad.flash_attention_score(args["query"], R(2, 6, 12), R(2, 6, 12), 4, "BSH")
    assert exc.value.param == "key"
    with pytest.raises(AclnnError) as exc:
        attngrad.flash_attention_score(args["query"], args["key"], R(2, 6, 15), 4, "BSH")
    assert exc.value.param == "value"


def aclnn_grad(args, dq=None, dk=None, dv=None):
    """aclnnFlashAttentionScoreGradV2GetWorkspaceSize status for torch-layer style ``args``."""
    a = dict(base())
    a.update(args)
    q, k, v = a["query"], a["key"], a["value"]
    dq = dq if dq is not None else (torch.zeros_like(q) if isinstance(q, torch.Tensor) else None)
    dk = dk if dk is not None else (torch.zeros_like(k) if isinstance(k, torch.Tensor) else None)
    dv = dv if dv is not None else (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
    status, ws, executor = aclnn.aclnnFlashAttentionScoreGradV2GetWorkspaceSize(
        acl(q), acl(k), acl(v), acl(a["dy"]), acl(a.get("pse")), acl(a.get("drop_mask")), None,
        acl(a.get("atten_mask")), acl(a["softmax_max"]), acl(a["softmax_sum"]), None, acl(a["attention_in"]),
        a.get("prefix"), None, None, a.get("scale_value", 1.0), a.get("keep_prob", 1.0),
        a.get("pre_tokens", TOKENS), a.get("next_tokens", TOKENS), a["head_num"], a["input_layout"],
        a.get("inner_precise", 0), a.get("sparse_mode", 0), a.get("pse_type", 1), acl(dq), acl(dk), acl(dv),
        None)
    return status, executor


# the aclnn V2 grad has no softmaxLayout and takes prefix as an aclIntArray (ints by construction); TND
# belongs to aclnnFlashAttentionUnpaddingScoreGrad (the padded API rejects the layout)
ACLNN_CASES = [c for c in CASES if not set(c[0]) & {"softmax_layout", "prefix"}
               and c[0].get("input_layout") != "TND"]
ACLNN_CASES.append((dict(input_layout="TND"), INVALID, "inputLayout", "TND"))


@pytest.mark.parametrize("overrides,status,param,words", ACLNN_CASES)
def test_aclnn_grad_statuses(overrides, status, param, words):
    got, executor = aclnn_grad(overrides)
    assert got == status and executor is None, aclnn.aclGetRecentErrMsg()
    assert words in aclnn.aclGetRecentErrMsg()


def test_aclnn_cann_only_rules():
    # the forward results are required by CANN's grad (the torch layer would recompute them)
    status, _ = aclnn_grad(dict(softmax_max=None, softmax_sum=None, attention_in=None))
    assert status == NULL and "attentionIn" in aclnn.aclGetRecentErrMsg()
    # outputs are required, must match their inputs
    q = base()["query"]
    assert aclnn_grad({}, dq=torch.zeros(2, 4, 5, 4))[0] == INVALID
    assert aclnn_grad({}, dq=torch.zeros_like(q, dtype=torch.float16))[0] == INVALID
    # all outputs empty -> success without computing (checked before headNum), whatever headNum says
    empty = torch.zeros(0)
    status, executor = aclnn_grad(dict(head_num=-1), dq=empty, dk=empty, dv=empty)
    assert status == 0 and aclnn.aclnnFlashAttentionScoreGradV2(None, 0, executor, None) == 0
    # CANN's documented limits: N <= 256, D <= 512
    big = torch.randn(1, 1, 2, 520)
    status, _, _ = aclnn.aclnnFlashAttentionScoreGetWorkspaceSize(
        acl(big), acl(big), acl(big), None, None, None, None, None, 1.0, 1.0, TOKENS, TOKENS, 1, "BNSD", 0, 0,
        acl(torch.zeros(1, 1, 2, 8)), acl(torch.zeros(1, 1, 2, 8)), None, acl(torch.zeros_like(big)))
    assert status == INVALID and "512" in aclnn.aclGetRecentErrMsg()
    # forward outputs are required
    x = torch.randn(1, 1, 2, 8)
    status, _, _ = aclnn.aclnnFlashAttentionScoreGetWorkspaceSize(
        acl(x), acl(x), acl(x), None, None, None, None, None, 1.0, 1.0, TOKENS, TOKENS, 1, "BNSD", 0, 0,
        None, acl(torch.zeros(1, 1, 2, 8)), None, acl(torch.zeros_like(x)))
    assert status == NULL and "softmaxMaxOut" in aclnn.aclGetRecentErrMsg()


def test_aclnn_non_nd_format():
    a = base()
    t = aclnn.AclTensor.from_torch(a["query"], aclnn.ACL_FORMAT_NCHW)
    dq, dk, dv = (torch.zeros_like(a[n]) for n in ("query", "key", "value"))
    status, _, _ = aclnn.aclnnFlashAttentionScoreGradGetWorkspaceSize(
        t, acl(a["key"]), acl(a["value"]), acl(a["dy"]), None, None, None, None, acl(a["softmax_max"]),
        acl(a["softmax_sum"]), None, acl(a["attention_in"]), None, 1.0, 1.0, TOKENS, TOKENS, 4, "BNSD", 0, 0,
        acl(dq), acl(dk), acl(dv), None)
    assert status == INVALID and "format" in aclnn.aclGetRecentErrMsg()


_dims = st.lists(st.integers(0, 5), min_size=0, max_size=5)
_dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool])


@st.composite
def malformed(draw):
    def tensor():
        if draw(st.booleans()) and draw(st.integers(0, 9)) == 0:
            return None
        return torch.zeros(draw(_dims), dtype=draw(_dtypes))
    return dict(query=tensor(), key=tensor(), value=tensor(), dy=tensor(), softmax_max=tensor(),
                softmax_sum=tensor(), attention_in=tensor(),
                head_num=draw(st.one_of(st.integers(-2, 6), st.floats(allow_nan=True), st.none())),
                input_layout=draw(st.sampled_from(["BSH", "SBH", "BSND", "BNSD", "TND", "bsh", "", None, 3])),
                keep_prob=draw(st.one_of(st.floats(allow_nan=True), st.sampled_from([1.0, 0.5]))),
                sparse_mode=draw(st.integers(-1, 9)), pse_type=draw(st.integers(-1, 4)),
                pre_tokens=draw(st.sampled_from([TOKENS, -3, 0, 2])),
                scale_value=draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just("x"))))


@settings(max_examples=150, deadline=None)
@given(malformed())
def test_malformed_input_only_raises_aclnn_error(args):
    try:
        call_grad(**args)
    except AclnnError as exc:
        assert exc.status in (NULL, INVALID)
    forward = {k: v for k, v in args.items() if k not in ("dy", "softmax_max", "softmax_sum", "attention_in")}
    try:
        call_forward(**forward)
    except AclnnError as exc:
        assert exc.status in (NULL, INVALID)
    status, _ = aclnn_grad(args)
    assert status in (0, NULL, INVALID), aclnn.aclGetRecentErrMsg()
