"""ExpSegsum(Backward) parameter checks (docs/cann-semantics.md, 'ExpSegsum') through both layers, and
malformed input fuzzing.

The torch layer raises ``AclnnError`` (status + the parameter named in the message); the aclnn layer
returns the same status. CANN's empty fast path (aclnn layer only) succeeds before any other check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attngrad
from attngrad import AclnnError, aclnn

from helpers import acl

NULL, INVALID = aclnn.ACLNN_ERR_PARAM_NULLPTR, aclnn.ACLNN_ERR_PARAM_INVALID
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def t(*shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype)


def aclnn_status(get_ws, execute, *tensors, fmt=aclnn.ACL_FORMAT_ND):
    status, ws, executor = get_ws(*(acl(x, fmt) for x in tensors))
    if status != aclnn.ACLNN_SUCCESS:
        assert executor is None and aclnn.aclGetRecentErrMsg()
        return status
    return execute(None, ws, executor, None)


def forward_status(x, out, **kw):
    return aclnn_status(aclnn.aclnnExpSegsumGetWorkspaceSize, aclnn.aclnnExpSegsum, x, out, **kw)


def backward_status(go, gs, gi, **kw):
    return aclnn_status(aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward, go, gs, gi, **kw)


# (self, out, status, parameter named) in CANN's check order
FORWARD_BAD = [
    ("self null", None, t(1, 2, 3, 3), NULL, "self"),
    ("out null", t(1, 2, 3), None, NULL, "out"),
    ("self int32", t(1, 2, 3, dtype=torch.int32), t(1, 2, 3, 3, dtype=torch.int32), INVALID, "self"),
    ("self float64", t(1, 2, 3, dtype=torch.float64), t(1, 2, 3, 3, dtype=torch.float64), INVALID, "self"),
    ("out dtype", t(1, 2, 3), t(1, 2, 3, 3, dtype=F16), INVALID, "out"),
    ("dtype before rank", t(2, 3), t(2, 3, 3, dtype=BF16), INVALID, "out"),
    ("self 2-D", t(2, 3), t(2, 3, 3), INVALID, "self"),
    ("self 5-D", t(1, 1, 1, 2, 3), t(1, 1, 1, 2, 3, 3), INVALID, "self"),
    ("out rank", t(1, 2, 3), t(1, 2, 3), INVALID, "out"),
    ("out last dim", t(1, 2, 3), t(1, 2, 3, 4), INVALID, "out"),
    ("out leading dim", t(1, 2, 3, 5), t(1, 3, 3, 5, 5), INVALID, "out"),
]
BACKWARD_BAD = [
    ("gradOutput null", None, t(1, 2, 3, 3), t(1, 2, 3), NULL, "gradOutput"),
    ("gradSelf null", t(1, 2, 3, 3), None, t(1, 2, 3), NULL, "gradSelf"),
    ("gradInput null", t(1, 2, 3, 3), t(1, 2, 3, 3), None, NULL, "gradInput"),
    ("gradOutput int32", t(1, 2, 3, 3, dtype=torch.int32), t(1, 2, 3, 3), t(1, 2, 3), INVALID, "gradOutput"),
    ("gradSelf float64", t(1, 2, 3, 3), t(1, 2, 3, 3, dtype=torch.float64), t(1, 2, 3), INVALID, "gradSelf"),
    # documented: gradSelf has gradOutput's dtype (CANN's aclnn layer does not check it)
    ("gradSelf dtype mismatch", t(1, 2, 3, 3), t(1, 2, 3, 3, dtype=F16), t(1, 2, 3), INVALID, "gradSelf"),
    ("gradInput dtype", t(1, 2, 3, 3, dtype=BF16), t(1, 2, 3, 3, dtype=BF16), t(1, 2, 3), INVALID, "gradInput"),
    ("dtype before rank", t(2, 3, 3), t(2, 3, 3, dtype=F16), t(2, 3), INVALID, "gradSelf"),
    ("gradOutput 3-D", t(2, 3, 3), t(2, 3, 3), t(2, 3), INVALID, "gradOutput"),
    ("gradOutput 6-D", t(1, 1, 1, 1, 3, 3), t(1, 1, 1, 1, 3, 3), t(1, 1, 1, 1, 3), INVALID, "gradOutput"),
    ("gradSelf rank", t(1, 2, 3, 3), t(1, 1, 2, 3, 3), t(1, 2, 3), INVALID, "gradSelf"),
    ("gradInput rank", t(1, 2, 3, 3), t(1, 2, 3, 3), t(1, 2, 3, 1), INVALID, "gradInput"),
    ("last two dims differ", t(1, 2, 3, 4), t(1, 2, 3, 4), t(1, 2, 3), INVALID, "gradOutput"),
    ("gradSelf shape", t(1, 2, 3, 3), t(2, 2, 3, 3), t(1, 2, 3), INVALID, "gradSelf"),
    ("gradInput shape", t(1, 2, 3, 3), t(1, 2, 3, 3), t(1, 2, 4), INVALID, "gradInput"),
    ("5-D gradInput shape", t(1, 2, 3, 2, 2), t(1, 2, 3, 2, 2), t(1, 2, 2, 2), INVALID, "gradInput"),
]
# the torch layer has no output parameter: its cases are the others
TORCH_FORWARD_BAD = [c for c in FORWARD_BAD if c[-1] != "out"]
TORCH_BACKWARD_BAD = [c for c in BACKWARD_BAD if c[-1] != "gradInput"]


@pytest.mark.parametrize("case, x, out, status, param", FORWARD_BAD, ids=[c[0] for c in FORWARD_BAD])
def test_forward_invalid_aclnn(case, x, out, status, param):
    assert forward_status(x, out) == status
    assert param in aclnn.aclGetRecentErrMsg()


@pytest.mark.parametrize("case, x, out, status, param", TORCH_FORWARD_BAD, ids=[c[0] for c in TORCH_FORWARD_BAD])
def test_forward_invalid_torch(case, x, out, status, param):
    with pytest.raises(AclnnError) as info:
        attngrad.exp_segsum(x)
    assert info.value.status == status and info.value.param == param and param in str(info.value)


@pytest.mark.parametrize("case, go, gs, gi, status, param", BACKWARD_BAD, ids=[c[0] for c in BACKWARD_BAD])
def test_backward_invalid_aclnn(case, go, gs, gi, status, param):
    assert backward_status(go, gs, gi) == status
    assert param in aclnn.aclGetRecentErrMsg()


@pytest.mark.parametrize("case, go, gs, gi, status, param", TORCH_BACKWARD_BAD,
                         ids=[c[0] for c in TORCH_BACKWARD_BAD])
def test_backward_invalid_torch(case, go, gs, gi, status, param):
    with pytest.raises(AclnnError) as info:
        attngrad.exp_segsum_backward(go, gs)
    assert info.value.status == status and info.value.param == param and param in str(info.value)


def test_forward_torch_layer_rejects_non_tensors():
    with pytest.raises(AclnnError) as info:
        attngrad.exp_segsum([[0.0, 1.0]])
    assert info.value.status == INVALID and info.value.param == "self"


@pytest.mark.parametrize("which", ["self", "out"])
def test_forward_format_must_be_nd(which):
    x, out = acl(t(1, 2, 3)), acl(t(1, 2, 3, 3))
    if which == "self":
        x = acl(t(1, 2, 3), aclnn.ACL_FORMAT_NCHW)
    else:
        out = acl(t(1, 2, 3, 3), aclnn.ACL_FORMAT_NCHW)
    status, _, executor = aclnn.aclnnExpSegsumGetWorkspaceSize(x, out)
    assert status == INVALID and executor is None and which in aclnn.aclGetRecentErrMsg()


@pytest.mark.parametrize("which", [0, 1, 2])
def test_backward_format_must_be_nd(which):
    tensors = [acl(t(1, 2, 3, 3)), acl(t(1, 2, 3, 3)), acl(t(1, 2, 3))]
    tensors[which] = aclnn.AclTensor.from_torch([t(1, 2, 3, 3), t(1, 2, 3, 3), t(1, 2, 3)][which],
                                                aclnn.ACL_FORMAT_NCHW)
    status, _, _ = aclnn.aclnnExpSegsumBackwardGetWorkspaceSize(*tensors)
    assert status == INVALID and ["gradOutput", "gradSelf", "gradInput"][which] in aclnn.aclGetRecentErrMsg()


# --- empty tensors: CANN's fast path in the aclnn layer, validate-then-empty in the torch layer ---
def test_forward_empty_fast_path_skips_checks_aclnn():
    # an empty self succeeds before any other check: a wrong-dtype, wrong-shape out is not looked at
    assert forward_status(t(0, 2, 3), t(5, dtype=torch.int32)) == aclnn.ACLNN_SUCCESS
    assert forward_status(t(2, 3, 0), t(2, 3, 0, 0)) == aclnn.ACLNN_SUCCESS
    assert forward_status(t(0, 3), t(0, 3, 3), fmt=aclnn.ACL_FORMAT_NCHW) == aclnn.ACLNN_SUCCESS
    assert forward_status(None, t(0, 3, 3)) == NULL  # null is still 161001 (CANN would crash)


@pytest.mark.parametrize("empty", [0, 1, 2])
def test_backward_empty_fast_path_skips_checks_aclnn(empty):
    tensors = [t(1, 2, 3, 4, dtype=torch.int32), t(7, dtype=F16), t(1, dtype=BF16)]  # all invalid
    tensors[empty] = t(0, 2, 3, 3)
    assert backward_status(*tensors) == aclnn.ACLNN_SUCCESS
    tensors[(empty + 1) % 3] = None
    assert backward_status(*tensors) == NULL


def test_empty_output_untouched_aclnn(acl_device):
    # non-empty valid inputs with an empty gradInput: success and no work
    go, _ = acl_device.tensor(torch.ones(1, 2, 3, 3), aclnn.ACL_FLOAT)
    gi, gi_ptr = acl_device.tensor(torch.full((4,), 5.0), aclnn.ACL_FLOAT, dims=[1, 0, 3], strides=[9, 3, 1])
    assert acl_device.run(aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward,
                          go, go, gi) == aclnn.ACLNN_SUCCESS
    assert (acl_device.read(gi_ptr, torch.float32) == 5.0).all()


def test_empty_inputs_are_validated_in_torch_layer():
    with pytest.raises(AclnnError) as info:
        attngrad.exp_segsum(t(0, 2, 3, dtype=torch.float64))
    assert info.value.param == "self"
    with pytest.raises(AclnnError) as info:
        attngrad.exp_segsum_backward(t(0, 2, 3, 4), t(0, 2, 3, 4))
    assert info.value.param == "gradOutput"


# --- fuzzing: malformed shapes and dtypes only ever give AclnnError / a status ---
FUZZ_DTYPES = [F32, F16, BF16, torch.float64, torch.int32, torch.bool, torch.uint8]
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=6).map(tuple)
maybe_tensor = st.one_of(st.none(), st.tuples(shapes, st.sampled_from(FUZZ_DTYPES)))


def _make(arg):
    return None if arg is None else t(*arg[0], dtype=arg[1])


@settings(max_examples=60, deadline=None)
@given(x=maybe_tensor, out=maybe_tensor)
def test_fuzz_forward(x, out):
    x, out = _make(x), _make(out)
    try:
        result = attngrad.exp_segsum(x)
        assert result.shape == (*x.shape, x.shape[-1])
    except AclnnError as exc:
        assert exc.status in (NULL, INVALID)
    status = forward_status(x, out)
    assert status in (aclnn.ACLNN_SUCCESS, NULL, INVALID)


@settings(max_examples=60, deadline=None)
@given(go=maybe_tensor, gs=maybe_tensor, gi=maybe_tensor)
def test_fuzz_backward(go, gs, gi):
    go, gs, gi = _make(go), _make(gs), _make(gi)
    try:
        result = attngrad.exp_segsum_backward(go, gs)
        assert result.shape == go.shape[:-1]
    except AclnnError as exc:
        assert exc.status in (NULL, INVALID)
    status = backward_status(go, gs, gi)
    assert status in (aclnn.ACLNN_SUCCESS, NULL, INVALID)


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=2, max_size=3), t_=st.integers(1, 6),
       dtype=st.sampled_from([F32, F16, BF16]))
def test_fuzz_valid_shapes_run(lead, t_, dtype):
    # well-formed inputs of random shapes succeed in both layers with the same bits
    x = torch.randn(*lead, t_).to(dtype)
    out = attngrad.exp_segsum(x)
    target = t(*lead, t_, t_, dtype=dtype)
    assert forward_status(x, target) == aclnn.ACLNN_SUCCESS and torch.equal(target, out)
    grad = t(*lead, t_, dtype=dtype)
    assert backward_status(out, out, grad) == aclnn.ACLNN_SUCCESS
    assert torch.equal(grad, attngrad.exp_segsum_backward(out, out))
