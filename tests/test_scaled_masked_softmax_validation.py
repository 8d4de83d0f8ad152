"""Invalid input of ScaledMaskedSoftmax(Backward) (docs/cann-semantics.md, 'ScaledMaskedSoftmax' and
'Deviations from CANN').

The same case table runs through both layers: the torch layer raises ``AclnnError`` with the status and
the parameter named; ``attngrad.aclnn`` returns the status and ``aclGetRecentErrMsg`` names the parameter.
Property tests throw random malformed input at all four entry points; a crash-proof variant repeats
them in a child process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import attngrad
from attngrad import AclnnError, aclnn
from attngrad.kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                               scaled_masked_softmax_reference)
from attngrad.precision import assert_close
from helpers import acl
from crashproof import assert_child_ok, run_in_child

NULL, INVALID = aclnn.ACLNN_ERR_PARAM_NULLPTR, aclnn.ACLNN_ERR_PARAM_INVALID
SHAPE = (2, 3, 4, 8)
FWD = (aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmax)
BWD = (aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmaxBackward)


def t(shape=SHAPE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def m(shape=SHAPE, dtype=torch.bool) -> torch.Tensor:
    return (torch.rand(shape) < 0.3).to(dtype)


def forward_args(**over) -> dict:
    args = {"x": t(), "mask": m(), "scale": 0.5, "fix": False, "y": t()}
    args.update(over)
    return args


def backward_args(**over) -> dict:
    args = {"dy": t(), "y": t(), "mask": m(), "scale": 0.5, "fix": False, "out": t()}
    args.update(over)
    return args


def call_torch(backward: bool, a: dict):
    if backward:
        return attngrad.scaled_masked_softmax_backward(a["dy"], a["y"], a["mask"], a["scale"], a["fix"])
    return attngrad.scaled_masked_softmax(a["x"], a["mask"], a["scale"], a["fix"])


def call_aclnn(backward: bool, a: dict, formats: dict | None = None) -> int:
    """Both phases through attngrad.aclnn; returns the status (the outputs are written in place)."""
    formats = formats or {}
    names = ("dy", "y", "mask", "scale", "fix", "out") if backward else ("x", "mask", "scale", "fix", "y")
    args = [acl(a[n], formats.get(n, aclnn.ACL_FORMAT_ND)) for n in names]
    get_ws, execute = BWD if backward else FWD
    status, ws, executor = get_ws(*args)
    if status != aclnn.ACLNN_SUCCESS:
        assert executor is None
        return status
    assert ws == 0 and aclnn.aclGetRecentErrMsg() == ""
    return execute(None, ws, executor, None)


# --- the case table: (id, backward?, argument overrides, status, parameter named, layers) ---
BOTH, ACLNN_ONLY = ("torch", "aclnn"), ("aclnn",)
CASES = [
    # forward: nulls (CANN's documentation wins over its code: 161001, not 561103)
    ("x_null", False, {"x": None}, NULL, "x", BOTH),
    ("mask_null", False, {"mask": None}, NULL, "mask", BOTH),
    ("y_null", False, {"y": None}, NULL, "y", ACLNN_ONLY),
    ("y_null_before_dtype", False, {"y": None, "x": t(dtype=torch.int32)}, NULL, "y", ACLNN_ONLY),
    ("mask_null_fix_true", False, {"mask": None, "fix": True}, NULL, "mask", ACLNN_ONLY),
    ("x_not_tensor", False, {"x": [[1.0]]}, INVALID, "x", ("torch",)),
    # dtypes
    ("x_int32", False, {"x": t(dtype=torch.int32)}, INVALID, "x", BOTH),
    ("x_float64", False, {"x": t(dtype=torch.float64)}, INVALID, "x", BOTH),
    ("x_bool", False, {"x": m()}, INVALID, "x", BOTH),
    ("mask_uint8", False, {"mask": m(dtype=torch.uint8)}, INVALID, "mask", BOTH),
    ("mask_float", False, {"mask": m(dtype=torch.float32)}, INVALID, "mask", BOTH),
    ("y_dtype", False, {"y": t(dtype=torch.float16)}, INVALID, "y", ACLNN_ONLY),
    # ranks and shapes
    ("x_rank3", False, {"x": t((3, 4, 8)), "mask": m((3, 4, 8)), "y": t((3, 4, 8))}, INVALID, "x", BOTH),
    ("x_rank5", False, {"x": t((1, *SHAPE)), "y": t((1, *SHAPE))}, INVALID, "x", BOTH),
    ("mask_rank3", False, {"mask": m((3, 4, 8))}, INVALID, "mask", BOTH),
    ("mask_rank5", False, {"mask": m((1, *SHAPE))}, INVALID, "mask", BOTH),
    ("mask_dim2", False, {"mask": m((2, 3, 5, 8))}, INVALID, "mask", BOTH),
    ("mask_dim3", False, {"mask": m((2, 3, 4, 1))}, INVALID, "mask", BOTH),
    ("mask_dim0", False, {"mask": m((4, 3, 4, 8))}, INVALID, "mask", BOTH),
    ("mask_dim1", False, {"mask": m((2, 2, 4, 8))}, INVALID, "mask", BOTH),
    ("mask_larger", False, {"x": t((1, 1, 4, 8)), "y": t((1, 1, 4, 8))}, INVALID, "mask", BOTH),
    ("y_shape", False, {"y": t((2, 3, 4, 9))}, INVALID, "y", ACLNN_ONLY),
    # attributes and CANN limits
    ("scale_str", False, {"scale": "0.5"}, INVALID, "scale", BOTH),
    ("scale_none", False, {"scale": None}, INVALID, "scale", BOTH),
    ("scale_bool", False, {"scale": True}, INVALID, "scale", BOTH),
    ("scale_complex", False, {"scale": 1j}, INVALID, "scale", BOTH),
    ("scale_tensor", False, {"scale": torch.tensor(0.5)}, INVALID, "scale", BOTH),
    ("fix_true", False, {"fix": True}, INVALID, "fixTriuMask", ACLNN_ONLY),
    ("fix_not_bool", False, {"fix": "yes"}, INVALID, "fixTriuMask", BOTH),
    ("s2_zero", False, {"x": t((2, 3, 4, 0)), "mask": m((2, 3, 4, 0)), "y": t((2, 3, 4, 0))}, INVALID, "S2",
     ACLNN_ONLY),
    ("s2_4097", False, {"x": t((1, 1, 2, 4097)), "mask": m((1, 1, 2, 4097)), "y": t((1, 1, 2, 4097))}, INVALID,
     "S2", ACLNN_ONLY),
    # backward: nulls (mask is mandatory)
    ("dy_null", True, {"dy": None}, NULL, "gradOutput", BOTH),
    ("by_null", True, {"y": None}, NULL, "y", BOTH),
    ("bmask_null", True, {"mask": None}, NULL, "mask", BOTH),
    ("out_null", True, {"out": None}, NULL, "out", ACLNN_ONLY),
    ("out_null_before_shape", True, {"out": None, "dy": t((3, 4, 8))}, NULL, "out", ACLNN_ONLY),
    ("bmask_null_fix_true", True, {"mask": None, "fix": True}, NULL, "mask", ACLNN_ONLY),
    # dtypes (documented: gradOutput, y and out dtypes must match -> 161002)
    ("dy_int32", True, {"dy": t(dtype=torch.int32)}, INVALID, "gradOutput", BOTH),
    ("dy_float64", True, {"dy": t(dtype=torch.float64), "y": t(dtype=torch.float64)}, INVALID, "gradOutput", BOTH),
    ("by_dtype", True, {"y": t(dtype=torch.float16)}, INVALID, "y", BOTH),
    ("by_int32", True, {"y": t(dtype=torch.int32)}, INVALID, "y", BOTH),
    ("out_dtype", True, {"out": t(dtype=torch.bfloat16)}, INVALID, "out", ACLNN_ONLY),
    ("bmask_uint8", True, {"mask": m(dtype=torch.uint8)}, INVALID, "mask", BOTH),
    ("bmask_fp16", True, {"mask": m(dtype=torch.float16)}, INVALID, "mask", BOTH),
    # ranks and shapes
    ("dy_rank3", True, {"dy": t((3, 4, 8)), "y": t((3, 4, 8)), "out": t((3, 4, 8)), "mask": m((3, 4, 8))},
     INVALID, "gradOutput", BOTH),
    ("by_shape", True, {"y": t((2, 3, 4, 7))}, INVALID, "y", BOTH),
    ("out_shape", True, {"out": t((2, 3, 1, 8))}, INVALID, "out", ACLNN_ONLY),
    ("bmask_rank3", True, {"mask": m((3, 4, 8))}, INVALID, "mask", BOTH),
    ("bmask_dim2", True, {"mask": m((2, 3, 3, 8))}, INVALID, "mask", BOTH),
    ("bmask_dim3", True, {"mask": m((2, 3, 4, 16))}, INVALID, "mask", BOTH),
    ("bmask_dim0", True, {"mask": m((3, 3, 4, 8))}, INVALID, "mask", BOTH),
    ("bmask_dim1", True, {"mask": m((2, 4, 4, 8))}, INVALID, "mask", BOTH),
    ("bmask_ut_1_2", True, {"dy": t((4, 4, 4, 128)), "y": t((4, 4, 4, 128)), "out": t((4, 4, 4, 128)),
                            "mask": m((1, 2, 4, 128))}, INVALID, "mask", BOTH),
    # attributes and CANN limits
    ("bscale_str", True, {"scale": "x"}, INVALID, "scale", BOTH),
    ("bscale_list", True, {"scale": [1.0]}, INVALID, "scale", BOTH),
    ("bfix_true", True, {"fix": True}, INVALID, "fixTriuMask", ACLNN_ONLY),
    ("bfix_int", True, {"fix": 1}, INVALID, "fixTriuMask", BOTH),
    ("bs2_4097", True, {"dy": t((1, 2, 1, 4097)), "y": t((1, 2, 1, 4097)), "out": t((1, 2, 1, 4097)),
                        "mask": m((1, 1, 1, 4097))}, INVALID, "S2", ACLNN_ONLY),
]


def _case_params(layer: str):
    return [pytest.param(bwd, over, status, param, id=cid) for cid, bwd, over, status, param, layers in CASES
            if layer in layers]


@pytest.mark.parametrize("backward, over, status, param", _case_params("torch"))
def test_invalid_torch_layer(backward, over, status, param):
    a = (backward_args if backward else forward_args)(**over)
    with pytest.raises(AclnnError) as info:
        call_torch(backward, a)
    err = info.value
    assert err.status == status, str(err)
    assert param in str(err)
    assert err.param is not None and param in err.param
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("backward, over, status, param", _case_params("aclnn"))
def test_invalid_aclnn(backward, over, status, param):
    a = (backward_args if backward else forward_args)(**over)
    out_name = "out" if backward else "y"
    before = a[out_name].clone() if isinstance(a[out_name], torch.Tensor) else None
    assert call_aclnn(backward, a) == status
    assert param in aclnn.aclGetRecentErrMsg()
    assert str(status) in aclnn.aclGetRecentErrMsg()
    if before is not None:
        assert torch.equal(a[out_name], before)  # nothing written


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("fmt", [aclnn.ACL_FORMAT_FRACTAL_NZ, aclnn.ACL_FORMAT_NCHW, aclnn.ACL_FORMAT_NHWC])
def test_format_not_nd_aclnn(backward, fmt):
    names = ("dy", "y", "mask", "out") if backward else ("x", "mask", "y")
    shown = {"dy": "gradOutput"}
    for name in names:
        a = (backward_args if backward else forward_args)()
        assert call_aclnn(backward, a, {name: fmt}) == INVALID, name
        msg = aclnn.aclGetRecentErrMsg()
        assert shown.get(name, name) in msg and "format" in msg


@pytest.mark.parametrize("backward", [False, True])
def test_valid_after_invalid_clears_message(backward):
    a = (backward_args if backward else forward_args)()
    assert call_aclnn(backward, dict(a, scale="bad")) == INVALID
    assert call_aclnn(backward, a) == aclnn.ACLNN_SUCCESS
    assert aclnn.aclGetRecentErrMsg() == ""


# --- last-dim limits: CANN's [1, 4096] in aclnn (backward [0, 4096]), anything in the torch layer ---
@pytest.mark.parametrize("s2", [1, 4096])
@pytest.mark.parametrize("backward", [False, True])
def test_last_dim_limits_accepted_aclnn(s2, backward):
    shape = (1, 2, 2, s2)
    x, mask = t(shape), m((1, 1, 2, s2))
    y = torch.zeros(shape)
    assert call_aclnn(False, forward_args(x=x, mask=mask, y=y)) == aclnn.ACLNN_SUCCESS
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.5), use_mere=True)
    if backward:
        dy, out = t(shape), torch.zeros(shape)
        assert call_aclnn(True, backward_args(dy=dy, y=y, mask=mask, out=out)) == aclnn.ACLNN_SUCCESS
        assert_close(out, scaled_masked_softmax_backward_reference(dy, y, mask, 0.5), use_mere=True,
                     exact_zero=mask)


def test_backward_s2_zero_is_an_empty_success_aclnn():
    # the backward's last dim is in [0, 4096]; S2 = 0 is an empty tensor -> success
    shape = (2, 3, 4, 0)
    a = backward_args(dy=t(shape), y=t(shape), out=t(shape), mask=m(shape))
    assert call_aclnn(True, a) == aclnn.ACLNN_SUCCESS
    assert attngrad.scaled_masked_softmax_backward(a["dy"], a["y"], a["mask"]).shape == shape


def test_backward_s2_zero_through_device_memory(acl_device):
    shape = [1, 2, 3, 0]
    empty, _ = acl_device.tensor(torch.zeros(0), aclnn.ACL_FLOAT, dims=shape)
    mask, _ = acl_device.tensor(torch.zeros(0, dtype=torch.bool), aclnn.ACL_BOOL, dims=shape)
    assert acl_device.run(*BWD, empty, empty, mask, 1.0, False, empty) == aclnn.ACLNN_SUCCESS
    assert acl_device.run(*FWD, empty, mask, 1.0, False, empty) == INVALID


@pytest.mark.parametrize("backward", [False, True])
def test_last_dim_beyond_4096_torch_layer_ok(backward):
    shape = (1, 1, 2, 4097)
    x, mask = t(shape), m(shape)
    y = attngrad.scaled_masked_softmax(x, mask, 0.5)
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.5), use_mere=True)
    if backward:
        dy = t(shape)
        out = attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.5)
        assert_close(out, scaled_masked_softmax_backward_reference(dy, y, mask, 0.5), use_mere=True, exact_zero=mask)


def test_fix_triu_mask_aclnn_rejected_even_with_valid_mask():
    for backward in (False, True):
        a = (backward_args if backward else forward_args)(fix=True)
        assert call_aclnn(backward, a) == INVALID
        assert "fixTriuMask" in aclnn.aclGetRecentErrMsg()


def test_negative_dim_aclnn(acl_device):
    x, _ = acl_device.tensor(t(), aclnn.ACL_FLOAT)
    mask, _ = acl_device.tensor(m(), aclnn.ACL_BOOL)
    bad, _ = acl_device.tensor(t(), aclnn.ACL_FLOAT, dims=[2, 3, -1, 8], strides=[96, 32, 8, 1])
    assert acl_device.run(*BWD, bad, x, mask, 1.0, False, x) == INVALID
    assert "gradOutput" in aclnn.aclGetRecentErrMsg()
    assert acl_device.run(*FWD, bad, mask, 1.0, False, x) == INVALID


# --- property tests: random malformed input at all four entry points ---
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
OTHER_DTYPES = [torch.float64, torch.int32, torch.uint8, torch.bool, torch.int8]
SCALES = [1.0, 0.5, 0.0, -2.0, 0.125, 3, np.float32(0.25), float("nan"), float("inf")]
BAD_SCALES = ["1", None, True, [1.0], 1j, torch.tensor(1.0)]
BAD_FIX = [True, 0, 1, None, "false"]
BAD_FORMATS = [aclnn.ACL_FORMAT_NCHW, aclnn.ACL_FORMAT_NHWC, aclnn.ACL_FORMAT_FRACTAL_NZ]
MUTATIONS = ["none", "none", "null", "dtype", "rank", "dim", "mask_dim", "scale", "fix", "last_dim", "format",
             "same_dtype"]


def _tensor(shape, dtype) -> torch.Tensor:
    if dtype in (torch.bool, torch.uint8, torch.int8):
        return (torch.rand(shape) < 0.3).to(dtype)
    return (torch.randn(shape) * 0.25).to(dtype)  # logits stay where fp16 softmax outputs are normal numbers


@st.composite
def cases(draw, backward: bool):
    """A valid call (CANN's shapes, dtypes, broadcast forms), then 0-2 random mutations, most of them invalid."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    names = ["dy", "y", "out"] if backward else ["x", "y"]
    shape = draw(st.lists(st.integers(0, 4), min_size=3, max_size=3)) + [draw(st.sampled_from([1, 2, 3, 5, 4096]))]
    dtype = draw(st.sampled_from(FLOATS))
    mask_lead = draw(st.sampled_from([shape[:2], [1, shape[1]], [shape[0], 1], [1, 1]]))
    shapes = {n: list(shape) for n in names} | {"mask": mask_lead + shape[2:]}
    dtypes = {n: dtype for n in names} | {"mask": torch.bool}
    a = {"scale": draw(st.sampled_from(SCALES)), "fix": False, "formats": {}}
    nulls = set()
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=2)):
        target = draw(st.sampled_from(names + ["mask"]))
        if mutation == "null":
            nulls.add(target)
        elif mutation == "dtype":
            dtypes[target] = draw(st.sampled_from(OTHER_DTYPES + FLOATS))
        elif mutation == "same_dtype":  # every data tensor moves to one other dtype together
            new = draw(st.sampled_from(OTHER_DTYPES + FLOATS))
            dtypes.update({n: new for n in names})
        elif mutation == "rank":
            shapes[target] = draw(st.lists(st.integers(0, 3), min_size=0, max_size=5))
        elif mutation in ("dim", "mask_dim") and shapes[target]:
            target = "mask" if mutation == "mask_dim" else target
            dim = draw(st.integers(0, len(shapes[target]) - 1))
            shapes[target][dim] = draw(st.integers(0, 5))
        elif mutation == "scale":
            a["scale"] = draw(st.sampled_from(BAD_SCALES))
        elif mutation == "fix":
            a["fix"] = draw(st.sampled_from(BAD_FIX))
        elif mutation == "last_dim":  # every tensor at once: only the S2 limit is broken
            s2 = draw(st.sampled_from([0, 4097]))
            for n in shapes:
                if len(shapes[n]) == 4:
                    shapes[n][3] = s2
        elif mutation == "format":
            a["formats"][target] = draw(st.sampled_from(BAD_FORMATS))
    for n in names + ["mask"]:
        a[n] = None if n in nulls else _tensor(tuple(shapes[n]), dtypes[n])
    if not backward:
        a["x"] = a.pop("x")
    return a


def expected_status(a: dict, backward: bool, aclnn_layer: bool) -> int:
    """The status the contract prescribes, written independently of the library (docs/cann-semantics.md,
    'ScaledMaskedSoftmax')."""
    floats = (torch.float32, torch.float16, torch.bfloat16)
    data_names = ("dy", "y") + (("out",) if aclnn_layer else ()) if backward else \
        ("x",) + (("y",) if aclnn_layer else ())
    if any(a[n] is None for n in data_names):
        return NULL
    if a["mask"] is None and (aclnn_layer or a["fix"] is not True):
        return NULL
    lead = a[data_names[0]]
    ok = lead.dtype in floats and lead.dim() == 4
    ok &= all(a[n].dtype == lead.dtype and a[n].shape == lead.shape for n in data_names[1:])
    ok &= not isinstance(a["scale"], bool) and isinstance(a["scale"], (int, float, np.floating))
    ok &= isinstance(a["fix"], bool)
    if a["mask"] is not None and ok:
        mk = a["mask"]
        ok &= mk.dtype == torch.bool and mk.dim() == 4 and mk.shape[2:] == lead.shape[2:] \
            and mk.shape[0] in (1, lead.shape[0]) and mk.shape[1] in (1, lead.shape[1])
    if aclnn_layer and ok:
        ok &= (0 if backward else 1) <= lead.shape[3] <= 4096 and a["fix"] is False
        names = data_names + ("mask",)
        ok &= all(a["formats"].get(n, aclnn.ACL_FORMAT_ND) == aclnn.ACL_FORMAT_ND for n in names)
    return aclnn.ACLNN_SUCCESS if ok else INVALID


def check_result(a: dict, backward: bool, result: torch.Tensor) -> None:
    """A call that succeeded must have computed the golden."""
    lead = a["dy"] if backward else a["x"]
    mask = a["mask"]
    if a["fix"] is True:
        s1, s2 = lead.shape[2:]
        mask = torch.ones(s1, s2, dtype=torch.bool).triu(1).view(1, 1, s1, s2)
    scale = float(a["scale"])
    if backward:
        golden = scaled_masked_softmax_backward_reference(a["dy"], a["y"], mask, scale)
    else:
        golden = scaled_masked_softmax_reference(a["x"], mask, scale)
    assert result.shape == lead.shape and result.dtype == lead.dtype
    assert_close(result, golden, lead.dtype, use_mere=True, exact_zero=mask if backward else None)


PROPERTY = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _torch_property(a: dict, backward: bool) -> None:
    want = expected_status(a, backward, aclnn_layer=False)
    event(f"expected status {want}")
    try:
        result = call_torch(backward, a)
    except AclnnError as err:
        assert err.status == want != aclnn.ACLNN_SUCCESS, (str(err), want)
        assert err.param is None or err.param.split(" ")[0] in str(err)
        return
    assert want == aclnn.ACLNN_SUCCESS, f"accepted, expected {want}"
    check_result(a, backward, result)


def _aclnn_property(a: dict, backward: bool) -> None:
    want = expected_status(a, backward, aclnn_layer=True)
    event(f"expected status {want}")
    out_name = "out" if backward else "y"
    if want == aclnn.ACLNN_SUCCESS:
        a[out_name].fill_(7)  # must be overwritten
    status = call_aclnn(backward, a, a["formats"])  # never raises: a raise fails the test
    assert status == want, (status, want, aclnn.aclGetRecentErrMsg())
    if status == aclnn.ACLNN_SUCCESS:
        check_result(a, backward, a[out_name])
    else:
        assert aclnn.aclGetRecentErrMsg()


@PROPERTY
@given(cases(backward=False))
def test_property_forward_torch(a):
    _torch_property(a, backward=False)


@PROPERTY
@given(cases(backward=True))
def test_property_backward_torch(a):
    _torch_property(a, backward=True)


@PROPERTY
@given(cases(backward=False))
def test_property_forward_aclnn(a):
    _aclnn_property(a, backward=False)


@PROPERTY
@given(cases(backward=True))
def test_property_backward_aclnn(a):
    _aclnn_property(a, backward=True)


# --- crash-proof: the same malformed batches in a child process ---
def malformed_batch() -> None:
    """Child entry point: every property test once more (a segfault here kills only the child)."""
    for test in (test_property_forward_torch, test_property_backward_torch, test_property_forward_aclnn,
                 test_property_backward_aclnn):
        test()
    print("malformed batch ok")


def test_malformed_batch_in_child_process():
    result = assert_child_ok("test_scaled_masked_softmax_validation:malformed_batch", timeout=600)
    assert "malformed batch ok" in result.stdout


def test_crashproof_reports_segfault_and_exit_codes():
    crashed = run_in_child("ctypes:string_at", 0)  # reads address 0: SIGSEGV
    assert crashed.crashed and crashed.returncode == -11
    assert "SIGSEGV" in crashed.describe() and "Fatal Python error" in crashed.stderr
    assert run_in_child("sys:exit", 3).returncode == 3
    assert run_in_child("operator:truth", 1).returncode == 0
    with pytest.raises(AssertionError, match="code -11"):
        assert_child_ok("ctypes:string_at", 0)
