"""ScaledMaskedSoftmax(Backward) results against the float64 reference (docs/cann-semantics.md, 'ScaledMaskedSoftmax').

Every result is judged by ``attngrad.precision`` with CANN's single-benchmark rule (use_mere=True);
masked backward outputs must be exactly 0.
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad import aclnn, npu
from attngrad.kernels.gemm_paths import SCALING_ENV, SCALINGS
from attngrad.kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                               scaled_masked_softmax_reference)
from attngrad.precision import assert_close

from helpers import bits, torch_threads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACL_DTYPES = {torch.float32: aclnn.ACL_FLOAT, torch.float16: aclnn.ACL_FLOAT16, torch.bfloat16: aclnn.ACL_BF16,
              torch.bool: aclnn.ACL_BOOL}
MASK_FORMS = ["BN11", "B1", "1N", "11"]
S2_SIZES = [1, 7, 129, 1000, 4096]

SEED_MASK = torch.tensor([1, 1, 0, 0] * 4, dtype=torch.bool).view(2, 2, 2, 2)
SEED_X = torch.arange(1, 17, dtype=torch.float32).view(2, 2, 2, 2)
SEED_FORWARD = torch.tensor([0.5, 0.5, 0.268941, 0.731059] * 4)
SEED_BACKWARD = torch.tensor([0, 0, -66, -84, 0, 0, -742, -840, 0, 0, -2794, -3036, 0, 0, -6990, -7440.0])


def make_mask(shape, form: str, p: float = 0.3) -> torch.Tensor:
    """A random bool mask for data ``shape`` in one of CANN's four broadcast forms."""
    B, N, S1, S2 = shape
    dims = {"BN11": (B, N), "B1": (B, 1), "1N": (1, N), "11": (1, 1)}[form]
    return torch.rand(*dims, S1, S2) < p


def softmax_like(shape, dtype) -> torch.Tensor:
    """A plausible forward output y (rows sum to 1) in ``dtype``."""
    return torch.softmax(torch.randn(shape) * 2, dim=-1).to(dtype)


def check_forward(x, mask, scale, **kw):
    y = attngrad.scaled_masked_softmax(x, mask, scale, **kw)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(y, scaled_masked_softmax_reference(x, mask, scale), x.dtype, use_mere=True)
    return y


def check_backward(dy, y, mask, scale):
    out = attngrad.scaled_masked_softmax_backward(dy, y, mask, scale)
    assert out.dtype == dy.dtype and out.shape == dy.shape
    golden = scaled_masked_softmax_backward_reference(dy, y, mask, scale)
    assert_close(out, golden, dy.dtype, use_mere=True, exact_zero=mask)
    return out


# --- forward and backward: dtypes x mask forms x sizes x scales ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("shape", [(2, 3, 4, 129), (2, 3, 1, 7), (1, 2, 3, 1)])
def test_forward_mask_forms(dtype, form, shape):
    x = torch.randn(shape).to(dtype)
    check_forward(x, make_mask(shape, form), 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", MASK_FORMS)
@pytest.mark.parametrize("shape", [(2, 3, 4, 129), (2, 3, 1, 7), (1, 2, 3, 1)])
def test_backward_mask_forms(dtype, form, shape):
    dy, y = torch.randn(shape).to(dtype), softmax_like(shape, dtype)
    check_backward(dy, y, make_mask(shape, form), 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s2", S2_SIZES)
def test_odd_last_dims(dtype, s2):
    shape = (2, 2, 3, s2)
    mask = make_mask(shape, "B1")
    x = (torch.randn(shape) * 3).to(dtype)
    y = check_forward(x, mask, 0.125)
    # y ~ 1/S2: a larger dy keeps the fp16 gradient out of fp16's subnormal range, where rounding alone
    # exceeds the MERE threshold (the kernel is then still bit-equal to the rounded golden)
    check_backward((torch.randn(shape) * 16).to(dtype), y, mask, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s2", [1, 4096])
def test_single_query_row(dtype, s2):
    shape = (3, 2, 1, s2)
    mask = make_mask(shape, "BN11", p=0.5)
    y = check_forward(torch.randn(shape).to(dtype), mask, 1.0)
    check_backward(torch.randn(shape).to(dtype), y, mask, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.5, 1.0, 0.125, 0.0, -1.0, 3.0])
def test_scales(dtype, scale):
    shape = (2, 2, 5, 33)
    mask = make_mask(shape, "1N")
    x = (torch.randn(shape) * 0.5).to(dtype)  # logits x*scale stay where fp16 outputs are normal numbers
    y = check_forward(x, mask, scale)
    out = check_backward(torch.randn(shape).to(dtype), y, mask, scale)
    if scale == 0.0:
        # logits all 0 -> uniform over the unmasked keys (masked ones get exp(-10000) = 0); gradient 0
        keep = (~mask).expand(shape)
        expected = keep / keep.sum(-1, keepdim=True).clamp(min=1)
        assert_close(y, expected.double(), dtype, use_mere=True)
        assert (out == 0).all()


def test_fp16_scale_is_rounded_to_fp16():
    # fp16 path: x * fp16(0.1) is computed and rounded in fp16 (CANN's Muls in fp16):
    # 1001 * 0.0999755859375 -> 100.0625, 1000 * 0.0999755859375 -> 100.0; in fp32 it would be 100.1 and 100.0
    x = torch.tensor([1001.0, 1000.0], dtype=torch.float16).view(1, 1, 1, 2)
    mask = torch.zeros(1, 1, 1, 2, dtype=torch.bool)
    y = attngrad.scaled_masked_softmax(x, mask, 0.1)
    golden = torch.softmax(torch.tensor([100.0625, 100.0], dtype=torch.float64), -1).view(1, 1, 1, 2)
    assert_close(y, golden, use_mere=True)
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.1), use_mere=True)
    fp32_path = torch.softmax(torch.tensor([100.1, 100.0], dtype=torch.float64), -1).view(1, 1, 1, 2)
    assert (y.double() - fp32_path).abs().max() > 1e-3  # the two paths are distinguishable here
    # bf16 scales in fp32: 1000 and 1001 are not both bf16 numbers, so use 1000 and 1004
    xb = torch.tensor([1004.0, 1000.0], dtype=torch.bfloat16).view(1, 1, 1, 2)
    assert_close(attngrad.scaled_masked_softmax(xb, mask, 0.1), torch.softmax(
        torch.tensor([1004 * 0.1, 1000 * 0.1], dtype=torch.float64), -1).view(1, 1, 1, 2), use_mere=True)


# --- non-contiguous inputs of every argument ---
def _transposed(shape, dtype):
    B, N, S1, S2 = shape
    return torch.randn(B, S1, N, S2).to(dtype).transpose(1, 2)


def _stepped(shape, dtype):
    B, N, S1, S2 = shape
    return torch.randn(B, N, S1, 2 * S2).to(dtype)[..., ::2]


def _batch_stepped(shape, dtype):
    B, N, S1, S2 = shape
    return torch.randn(2 * B, N, S1 + 3, S2).to(dtype)[::2, :, 1:S1 + 1]


NON_CONTIGUOUS = {"transposed12": _transposed, "step_last": _stepped, "step_batch": _batch_stepped}
MASK_VIEWS = {
    "expanded": lambda shape: make_mask(shape, "11").expand(shape),
    "transposed23": lambda shape: make_mask((shape[0], shape[1], shape[3], shape[2]), "B1").transpose(2, 3),
    "step_last": lambda shape: make_mask((*shape[:3], 2 * shape[3]), "1N")[..., ::2],
    "transposed12": lambda shape: make_mask((shape[0], shape[2], shape[1], shape[3]), "BN11").transpose(1, 2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", list(NON_CONTIGUOUS))
def test_non_contiguous_data(dtype, view):
    shape = (2, 3, 4, 37)
    make = NON_CONTIGUOUS[view]
    mask = make_mask(shape, "BN11")
    x = make(shape, dtype)
    assert not x.is_contiguous()
    check_forward(x, mask, 0.5)
    y = make(shape, dtype)
    y.copy_(softmax_like(shape, dtype))
    dy = make(shape, dtype)
    assert not dy.is_contiguous() and not y.is_contiguous()
    check_backward(dy, y, mask, 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", list(MASK_VIEWS))
def test_non_contiguous_mask(dtype, view):
    shape = (2, 3, 4, 19)
    mask = MASK_VIEWS[view](shape)
    assert not mask.is_contiguous()
    x = torch.randn(shape).to(dtype)
    y = check_forward(x, mask, 1.0)
    assert torch.equal(bits(y), bits(attngrad.scaled_masked_softmax(x, mask.contiguous(), 1.0)))
    check_backward(torch.randn(shape).to(dtype), y, mask, 1.0)


# --- special values ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s2", [1, 7, 1000])
def test_fully_masked_rows(dtype, s2):
    shape = (2, 2, 4, s2)
    mask = make_mask(shape, "BN11")
    mask[0, 1, 2] = True
    mask[1, :, 0] = True
    x = torch.randn(shape).to(dtype)
    y = check_forward(x, mask, 1.0)
    uniform = torch.tensor(1.0 / s2, dtype=torch.float32).to(dtype)  # fp32 softmax, then rounded
    assert (y[0, 1, 2] == uniform).all() and (y[1, :, 0] == uniform).all()
    out = check_backward(torch.randn(shape).to(dtype), y, mask, 0.5)
    assert (out[0, 1, 2] == 0).all() and (out[1, :, 0] == 0).all()
    assert not torch.signbit(out[mask.expand(shape)]).any()  # +0, not -0


SPECIALS = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", SPECIALS)
def test_forward_special_under_mask_leaves_row_unaffected(dtype, value):
    shape = (2, 2, 3, 9)
    mask = make_mask(shape, "1N")
    mask[0, :, :, 4] = True
    x = torch.randn(shape).to(dtype)
    clean = check_forward(x, mask, 0.5)
    dirty = x.clone()
    dirty[mask.expand(shape)] = value
    y = check_forward(dirty, mask, 0.5)
    assert torch.equal(bits(y), bits(clean))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", SPECIALS)
def test_forward_special_outside_mask_follows_golden(dtype, value):
    shape = (1, 2, 3, 8)
    mask = torch.zeros(1, 1, 3, 8, dtype=torch.bool)
    mask[..., 0] = True
    x = torch.randn(shape).to(dtype)
    x[0, 0, 1, 3] = value
    x[0, 1, 2, :] = value  # whole row special (masked position 0 aside)
    y = check_forward(x, mask, 1.0)
    if value != value or value > 0:
        assert torch.isnan(y[0, 0, 1]).all()
    else:  # -inf is just a zero probability
        assert y[0, 0, 1, 3] == 0 and torch.isfinite(y[0, 0, 1]).all()
        assert y[0, 1, 2, 0] == 1  # only the masked -10000 logit is left
    assert torch.isfinite(y[0, 0, 0]).all()  # other rows untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", SPECIALS)
@pytest.mark.parametrize("arg", ["dy", "y"])
def test_backward_special_values(dtype, value, arg):
    shape = (2, 2, 4, 16)
    mask = make_mask(shape, "B1")
    mask[:, :, :, 5] = True
    mask[:, :, :, 9] = False
    dy, y = torch.randn(shape).to(dtype), softmax_like(shape, dtype)
    target = dy if arg == "dy" else y
    target[0, 0, 0, 5] = value  # under the mask: output 0 there, reaches the row sum
    target[1, 1, 2, 9] = value  # outside the mask
    out = check_backward(dy, y, mask, 0.5)
    assert out[0, 0, 0, 5] == 0
    assert torch.isfinite(out[0, 0, 1]).all() and torch.isfinite(out[1, 1, 3]).all()
    assert not torch.isfinite(out[1, 1, 2, 9])


@pytest.mark.parametrize("scale", [0.0, 1.0])
def test_backward_inf_in_row_sum(scale):
    # dy = inf at j=1: the row sum is inf, g = (dy - inf) * y = [-inf, nan, -inf]; times scale 0 -> all nan
    shape = (1, 1, 2, 4)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[..., 3] = True
    dy, y = torch.ones(shape), torch.full(shape, 0.25)
    dy[0, 0, 0, 1] = float("inf")
    out = check_backward(dy, y, mask, scale)
    assert torch.isnan(out[0, 0, 0, 1]) and out[0, 0, 0, 3] == 0
    if scale == 0:
        assert torch.isnan(out[0, 0, 0, :3]).all()
    else:
        assert (out[0, 0, 0, [0, 2]] == -float("inf")).all()
    assert (out[0, 0, 1] == 0).all()  # dy - sum(dy * y) = 1 - 1 = 0 in the clean row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [17, 64, 1000])  # a scalar tail, whole vectors, both
@pytest.mark.parametrize("rows", [1, 70])  # one row, and rows whose sums are taken ahead of their gradients
def test_backward_products_in_cann_order(dtype, width, rows):
    # ((dy - sum) * y) * scale: y * scale = 1e-50 underflows float32, the gradient (+-1e-38) does not
    shape = (1, 1, rows, width)
    y = torch.full(shape, 1e-20)
    y[..., 0] = 1.0
    dy = torch.zeros(shape)
    dy[..., 1::2] = 1e12
    dy[0, 0, 0, 3] = float("inf")  # then (inf - inf) * y = nan at 3 and -inf (not inf * 0 = nan) elsewhere
    y, dy = y.to(dtype), dy.to(dtype)
    mask = torch.zeros(shape, dtype=torch.bool)
    out = attngrad.scaled_masked_softmax_backward(dy, y, mask, 1e-30)
    golden = scaled_masked_softmax_backward_reference(dy, y, mask, 1e-30)
    assert torch.equal(out[0, 0, 0].isnan(), golden[0, 0, 0].isnan())
    assert (out[0, 0, 0, [0, 1, 2]] == -float("inf")).all()
    rest = out[0, 0, 1:].double()
    assert (rest[:, 1::2] != 0).all()
    # against the golden rounded to the dtype: within bf16's rounding (float32's subnormals are closer)
    assert torch.allclose(rest, golden[0, 0, 1:].to(dtype).double(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitudes(dtype):
    shape = (1, 2, 3, 50)
    big = {torch.float32: 1e30, torch.float16: 10000.0, torch.bfloat16: 1e30}[dtype]  # fp16: < 65504 at 6 sigma
    x = (torch.randn(shape) * big).to(dtype)
    mask = make_mask(shape, "BN11")
    y = check_forward(x, mask, 1.0)
    assert torch.isfinite(y).all()
    check_backward((torch.randn(shape) * big).to(dtype), y, mask, 1.0)


@pytest.fixture(params=SCALINGS)
def float16_scaling(request, monkeypatch):
    """Each of the two float16 roundings of x * scale, forced (a CPU with AVX512-FP16 runs its one multiply)."""
    monkeypatch.setenv(SCALING_ENV, request.param)
    return request.param


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.usefixtures("float16_scaling")
def test_fp16_scaled_overflow_follows_the_fp16_golden(sign):
    # x * scale is computed in fp16: 60000 * 2 overflows to inf -> nan row; -inf -> probability 0
    shape = (1, 1, 2, 6)
    x = torch.randn(shape).to(torch.float16)
    x[0, 0, 0, 2] = sign * 60000.0
    mask = torch.zeros(shape, dtype=torch.bool)
    y = check_forward(x, mask, 2.0)
    if sign > 0:
        assert torch.isnan(y[0, 0, 0]).all()
    else:
        assert y[0, 0, 0, 2] == 0 and torch.isfinite(y[0, 0, 0]).all()
    assert torch.isfinite(y[0, 0, 1]).all()
    # the same value in fp32 or bf16 does not overflow
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.isfinite(check_forward(x.to(dtype), mask, 2.0)).all()


def test_fp16_roundings_give_the_same_bits(monkeypatch):
    # 130 rows (past one 64-row block, so most rows run in the software pipeline's middle), every fifth holding a
    # logit that overflows to +inf (a nan row) and every seventh one that overflows to -inf, on a strided x
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 130, 301, generator=g) * 300
    x[0, :, ::5, 7] = 40000.0
    x[0, :, ::7, 11] = -40000.0
    x = x.to(torch.float16).transpose(2, 3).contiguous().transpose(2, 3)
    mask = torch.rand(1, 1, 130, 301, generator=g) < 0.2
    mask[..., [7, 11]] = False
    results = []
    for scaling in SCALINGS:
        monkeypatch.setenv(SCALING_ENV, scaling)
        results.append(attngrad.scaled_masked_softmax(x, mask, 2.0))
    assert torch.equal(bits(results[0]), bits(results[1]))
    assert torch.isnan(results[0][0, :, ::5]).all() and torch.isfinite(results[0][0, :, 1:5]).all()
    assert_close(results[0], scaled_masked_softmax_reference(x, mask, 2.0), torch.float16, use_mere=True)


@pytest.mark.parametrize("s2", [8, 300])  # rows in the software pipeline's middle, not only at a block's ends
@pytest.mark.usefixtures("float16_scaling")
def test_fp16_rows_whose_max_lies_near_the_scaled_overflow(s2):
    # x * 2 in fp16: x <= -32760 overflows to -inf. Rows: all overflowed (nan row); an overflowed logit beside a max
    # of -65408, of -65472 and of -65504 (probability 0 for it, the rest a softmax); all overflowed but a masked one
    base = [[-32760.0, -32768.0], [-60000.0, -32704.0], [-60000.0, -32736.0], [-32760.0, -32752.0],
            [-60000.0, -40000.0]]
    rows = 4 * len(base)
    x = torch.empty(1, 1, rows, s2)
    for r in range(rows):
        first, rest = base[r % len(base)]
        x[0, 0, r] = rest - torch.arange(s2) % 3
        x[0, 0, r, r % s2] = first
    x = x.to(torch.float16)
    mask = torch.zeros(1, 1, rows, s2, dtype=torch.bool)
    mask[0, 0, 4::len(base), 1] = True
    y = check_forward(x, mask, 2.0)
    assert torch.isnan(y[0, 0, ::len(base)]).all()
    finite = torch.ones(rows, dtype=torch.bool)
    finite[::len(base)] = False
    assert torch.isfinite(y[0, 0, finite]).all()
    for kind in (1, 2, 3):  # the overflowed logit: exactly 0, where a finite stand-in 32 below the max would not be
        r = torch.arange(kind, rows, len(base))
        assert (y[0, 0, r, r % s2] == 0).all()


def test_unmasked_logit_below_mask_value():
    # an unmasked logit <= -10000 lets the masked positions (-10000) take the probability mass
    x = torch.tensor([-20000.0, 0.0, -30000.0]).view(1, 1, 1, 3)
    mask = torch.tensor([False, True, False]).view(1, 1, 1, 3)
    y = check_forward(x, mask, 1.0)
    assert y[0, 0, 0, 1] == 1.0


# --- CANN's examples ---
def test_seed_forward_example_torch():
    y = attngrad.scaled_masked_softmax(SEED_X, SEED_MASK, 1.0)
    torch.testing.assert_close(y.flatten(), SEED_FORWARD, atol=1e-6, rtol=0)
    assert_close(y, scaled_masked_softmax_reference(SEED_X, SEED_MASK, 1.0), use_mere=True)


def test_seed_backward_example_torch():
    out = attngrad.scaled_masked_softmax_backward(SEED_X, SEED_X, SEED_MASK, 1.0)
    assert torch.equal(out.flatten(), SEED_BACKWARD)


def _seed_aclnn(acl_device, backward: bool) -> torch.Tensor:
    """The C++ example, line by line: host vectors -> aclrtMalloc/aclrtMemcpy -> aclCreateTensor -> two calls."""
    shape = [2, 2, 2, 2]
    data, _ = acl_device.tensor(SEED_X, aclnn.ACL_FLOAT)
    mask, _ = acl_device.tensor(SEED_MASK, aclnn.ACL_BOOL)
    out, out_ptr = acl_device.tensor(torch.zeros(shape), aclnn.ACL_FLOAT)
    if backward:
        y, _ = acl_device.tensor(SEED_X, aclnn.ACL_FLOAT)
        status = acl_device.run(aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize,
                                aclnn.aclnnScaledMaskedSoftmaxBackward, data, y, mask, 1.0, False, out)
    else:
        status = acl_device.run(aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmax,
                                data, mask, 1.0, False, out)
    assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()
    return acl_device.read(out_ptr, torch.float32)


def test_seed_forward_example_aclnn(acl_device):
    torch.testing.assert_close(_seed_aclnn(acl_device, backward=False), SEED_FORWARD, atol=1e-6, rtol=0)


def test_seed_backward_example_aclnn(acl_device):
    assert torch.equal(_seed_aclnn(acl_device, backward=True), SEED_BACKWARD)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", MASK_FORMS)
def test_aclnn_matches_torch_layer(acl_device, dtype, form):
    shape = (2, 3, 5, 70)
    x, dy = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    mask = make_mask(shape, form)
    tx, _ = acl_device.tensor(x, ACL_DTYPES[dtype])
    tdy, _ = acl_device.tensor(dy, ACL_DTYPES[dtype])
    tmask, _ = acl_device.tensor(mask, aclnn.ACL_BOOL)
    ty, y_ptr = acl_device.tensor(torch.zeros(shape, dtype=dtype), ACL_DTYPES[dtype])
    tout, out_ptr = acl_device.tensor(torch.zeros(shape, dtype=dtype), ACL_DTYPES[dtype])
    assert acl_device.run(aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmax,
                          tx, tmask, 0.25, False, ty) == 0
    assert acl_device.run(aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize,
                          aclnn.aclnnScaledMaskedSoftmaxBackward, tdy, ty, tmask, 0.25, False, tout) == 0
    y = acl_device.read(y_ptr, dtype).view(shape)
    out = acl_device.read(out_ptr, dtype).view(shape)
    assert torch.equal(bits(y), bits(attngrad.scaled_masked_softmax(x, mask, 0.25)))
    assert torch.equal(bits(out), bits(attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.25)))
    assert_close(out, scaled_masked_softmax_backward_reference(dy, y, mask, 0.25), use_mere=True, exact_zero=mask)


# --- autograd ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["BN11", "1N"])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_autograd_matches_golden_gradient(dtype, form, scale):
    shape = (2, 3, 4, 33)
    mask = make_mask(shape, form)
    x = torch.randn(shape).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    y = attngrad.scaled_masked_softmax(x, mask, scale)
    assert y.requires_grad
    (grad,) = torch.autograd.grad(y, x, dy)
    assert grad.dtype == dtype
    # the kernel's backward sees the rounded y, so the golden gradient uses y; the float64 chain is checked below
    golden = scaled_masked_softmax_backward_reference(dy, y.detach(), mask, scale)
    assert_close(grad, golden, dtype, use_mere=True, exact_zero=mask)


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_autograd_matches_float64_autograd(scale):
    shape = (2, 2, 3, 17)
    mask = make_mask(shape, "B1")
    x = torch.randn(shape, requires_grad=True)
    dy = torch.randn(shape)
    (grad,) = torch.autograd.grad(attngrad.scaled_masked_softmax(x, mask, scale), x, dy)
    x64 = x.detach().double().requires_grad_()
    (golden,) = torch.autograd.grad(scaled_masked_softmax_reference(x64, mask, scale), x64, dy.double())
    assert_close(grad, golden, use_mere=True, exact_zero=mask)


def test_autograd_non_contiguous_input_and_chain():
    shape = (2, 3, 4, 10)
    base = torch.randn(2, 4, 3, 10, requires_grad=True)
    mask = make_mask(shape, "11")
    y = attngrad.scaled_masked_softmax(base.transpose(1, 2), mask, 0.5)
    loss = (y * torch.arange(10.0)).sum()
    (grad,) = torch.autograd.grad(loss, base)
    b64 = base.detach().double().requires_grad_()
    loss64 = (scaled_masked_softmax_reference(b64.transpose(1, 2), mask, 0.5) * torch.arange(10.0)).sum()
    (golden,) = torch.autograd.grad(loss64, b64)
    assert_close(grad, golden, use_mere=True)


def test_no_graph_without_requires_grad():
    y = attngrad.scaled_masked_softmax(torch.randn(1, 1, 2, 3), torch.zeros(1, 1, 2, 3, dtype=torch.bool))
    assert not y.requires_grad and y.grad_fn is None
    x = torch.randn(1, 1, 2, 3, requires_grad=True)
    with torch.no_grad():
        assert attngrad.scaled_masked_softmax(x, torch.zeros(1, 1, 2, 3, dtype=torch.bool)).grad_fn is None


# --- fix_triu_mask (torch layer extension) ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s1, s2", [(5, 5), (3, 8), (8, 3)])
@pytest.mark.parametrize("given", [False, True])
def test_fix_triu_mask(dtype, s1, s2, given):
    shape = (2, 2, s1, s2)
    triu = torch.ones(s1, s2, dtype=torch.bool).triu(1).expand(1, 1, s1, s2)
    mask = make_mask(shape, "BN11") if given else None  # a given mask is replaced by the triangle
    x, dy = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    y = attngrad.scaled_masked_softmax(x, mask, 0.5, fix_triu_mask=True)
    assert torch.equal(bits(y), bits(attngrad.scaled_masked_softmax(x, triu, 0.5)))
    assert_close(y, scaled_masked_softmax_reference(x, triu, 0.5), dtype, use_mere=True)
    out = attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.5, fix_triu_mask=True)
    assert torch.equal(bits(out), bits(attngrad.scaled_masked_softmax_backward(dy, y, triu, 0.5)))
    assert_close(out, scaled_masked_softmax_backward_reference(dy, y, triu, 0.5), dtype, use_mere=True,
                 exact_zero=triu)


def test_fix_triu_mask_autograd():
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    dy = torch.randn(1, 2, 4, 4)
    triu = torch.ones(4, 4, dtype=torch.bool).triu(1).view(1, 1, 4, 4)
    (g1,) = torch.autograd.grad(attngrad.scaled_masked_softmax(x, None, 1.0, fix_triu_mask=True), x, dy)
    (g2,) = torch.autograd.grad(attngrad.scaled_masked_softmax(x, triu, 1.0), x, dy)
    assert torch.equal(g1, g2)


# --- torch_npu names ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fixed", [False, True])
def test_npu_names_match_torch_functions(dtype, fixed):
    shape = (2, 3, 4, 20)
    x, dy, mask = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), make_mask(shape, "B1")
    y = npu.npu_scaled_masked_softmax(x, mask, 0.5, fixed)
    assert torch.equal(bits(y), bits(attngrad.scaled_masked_softmax(x, mask, 0.5, fix_triu_mask=fixed)))
    assert torch.equal(bits(npu.npu_scaled_masked_softmax(x, mask)), bits(attngrad.scaled_masked_softmax(x, mask)))
    out = npu.npu_scaled_masked_softmax_backward(dy, y, mask, 0.5, fixed)
    assert torch.equal(bits(out), bits(attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.5, fixed)))


def test_npu_keyword_names():
    shape = (1, 2, 3, 4)
    x, mask = torch.randn(shape), make_mask(shape, "11")
    y = npu.npu_scaled_masked_softmax(x=x, mask=mask, scale=2.0, fixed_triu_mask=False)
    out = npu.npu_scaled_masked_softmax_backward(y_grad=x, y=y, mask=mask, scale=2.0, fixed_triu_mask=False)
    assert torch.equal(out, attngrad.scaled_masked_softmax_backward(x, y, mask, 2.0))


# --- determinism ---
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_across_calls_and_thread_counts(dtype):
    shape = (4, 4, 33, 300)  # 528 rows: split over the threads
    x, dy, mask = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), make_mask(shape, "B1")
    results = []
    for n in (1, 2, 2, 1):
        with torch_threads(n):
            y = attngrad.scaled_masked_softmax(x, mask, 0.3)
            results.append((y, attngrad.scaled_masked_softmax_backward(dy, y, mask, 0.3)))
    for y, out in results[1:]:
        assert torch.equal(bits(y), bits(results[0][0])) and torch.equal(bits(out), bits(results[0][1]))


# --- empty tensors in the torch layer ---
@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (2, 0, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0)])
def test_empty_tensors_torch_layer(shape):
    x = torch.randn(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    y = attngrad.scaled_masked_softmax(x, mask)
    out = attngrad.scaled_masked_softmax_backward(x, y, mask)
    assert y.shape == shape and out.shape == shape


def test_last_dim_beyond_cann_limit_in_torch_layer():
    shape = (1, 2, 3, 5000)  # > 4096: CANN rejects it, the torch layer computes it
    x, mask = torch.randn(shape).to(torch.bfloat16), make_mask(shape, "1N")
    y = check_forward(x, mask, 0.5)
    check_backward(torch.randn(shape).to(torch.bfloat16), y, mask, 0.5)
