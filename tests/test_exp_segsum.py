"""ExpSegsum / ExpSegsumBackward results against the float64 reference (docs/cann-semantics.md, 'ExpSegsum').

Every result is judged by ``attngrad.precision`` (norm-relative error and CANN's MERE; README, 'How precision
is judged').
Goldens that overflow the output dtype are saturated to inf first (``saturate``): no value of that dtype
can be closer. Two documented limits of the judgement (see ``assert_forward_close``):

* fp16 forward outputs below 6.1e-5 are fp16 subnormals whose relative spacing reaches 0.5 near 1e-7, so
  even the correctly rounded golden fails MERE on data whose exp(segment sums) falls there; the kernel is
  then held to the MERE of the rounded golden (it must add no error of its own).
* ``exp32`` overflows from 88.72 while ln(FLT_MAX) = 88.7228 (``kernels/numeric.py``; reported, see
  ``test_exp32_overflow_threshold``): entries whose exponent lies in that band are left out of the
  comparison of the wide-range tests.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

import attngrad
from attngrad import aclnn
from attngrad.kernels import numeric
from attngrad.kernels.exp_segsum_reference import (exp_segsum_backward_reference, exp_segsum_reference,
                                                   saturate)
from attngrad.precision import assert_close, compare

from helpers import bits, torch_threads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACL_DTYPES = {torch.float32: aclnn.ACL_FLOAT, torch.float16: aclnn.ACL_FLOAT16, torch.bfloat16: aclnn.ACL_BF16}
T_SIZES = [1, 2, 37, 128, 256]
# CANN's ExpSegsumBackward ST data: N(mean in [-100, 100], std in [1, 25]); plus unit-scale data
WIDE = [(-100.0, 25.0), (100.0, 25.0), (0.0, 25.0), (-37.0, 1.0), (63.0, 9.0), (0.0, 1.0)]
# forward data whose segment sums stay in exp's range for T <= 256 (the values, not only inf/0)
MODERATE = [(0.0, 0.3), (-0.1, 0.5), (0.05, 0.1), (-1.0, 1.0)]
EXP32_BAND = (88.715, 88.73)  # around exp32's overflow point 88.72 and ln(FLT_MAX) = 88.7228

SEED_X = torch.tensor([0.0, 1.0, 2.0, 3.0]).view(1, 1, 1, 4)
SEED_OUT = torch.tensor([[1, 0, 0, 0], [2.718282, 1, 0, 0], [20.085537, 7.389056, 1, 0],
                         [403.428793, 148.413159, 20.085537, 1]], dtype=torch.float64).view(1, 1, 1, 4, 4)


def normal(shape, mean, std, dtype, generator=None) -> torch.Tensor:
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * std + mean).to(dtype)


def upper(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)


def golden_forward(x: torch.Tensor) -> torch.Tensor:
    return saturate(exp_segsum_reference(x), x.dtype)


def golden_backward(grad_output: torch.Tensor, grad_self: torch.Tensor) -> torch.Tensor:
    return saturate(exp_segsum_backward_reference(grad_output, grad_self), grad_output.dtype)


def assert_forward_close(out: torch.Tensor, x: torch.Tensor, skip_exp32_band: bool = False):
    """Judge a forward output: exact 0 above / 1 on the diagonal, norm-rel, specials and MERE (see module doc)."""
    t = x.shape[-1]
    golden = golden_forward(x)
    assert torch.equal(torch.diagonal(out, dim1=-2, dim2=-1).double(), torch.ones(*x.shape, dtype=torch.float64))
    if skip_exp32_band:
        exponent = exp_segsum_reference(x).log()
        band = (exponent > EXP32_BAND[0]) & (exponent < EXP32_BAND[1])
        out, golden = out.masked_fill(band, 0), golden.masked_fill(band, 0)
    report = compare(out, golden, x.dtype, use_mere=True, exact_zero=upper(t))
    floor = compare(golden.to(x.dtype), golden, x.dtype, use_mere=True)  # the dtype's own rounding
    if floor.passed:
        assert report.passed, str(report)
    else:
        assert x.dtype == torch.float16, f"only fp16 subnormals may defeat MERE: {floor}"
        assert report.special_ok and report.norm_rel <= floor.norm_rel * 1.5 + 1e-4, str(report)
        assert report.mere <= floor.mere * 1.05 + 1e-5, f"{report} vs rounded golden {floor}"
    return report


def check_backward(grad_output, grad_self):
    out = attngrad.exp_segsum_backward(grad_output, grad_self)
    assert out.dtype == grad_output.dtype and out.shape == grad_output.shape[:-1]
    assert (out[..., 0] == 0).all()  # gradInput[0] sums over no column
    assert_close(out, golden_backward(grad_output, grad_self), grad_output.dtype, use_mere=True)
    return out


def leading(rank: int) -> tuple:
    """Leading dims for a given number of them (2 -> 4-D gradients / 3-D input, 3 -> 5-D / 4-D)."""
    return (2, 3) if rank == 2 else (2, 1, 3)


# --- backward against the golden: dtypes x ranks x T x CANN's data distributions ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [4, 5])
@pytest.mark.parametrize("t", T_SIZES)
def test_backward_against_golden(dtype, rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    shape = (*leading(rank - 2), t, t)
    for mean, std in WIDE:
        check_backward(normal(shape, mean, std, dtype, g), normal(shape, -mean / 2, std, dtype, g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [37, 256])
def test_backward_random_cann_like_distributions(dtype, t):
    g = torch.Generator().manual_seed(t)
    for _ in range(4):
        mean = float(torch.empty(()).uniform_(-100, 100, generator=g))
        std = float(torch.empty(()).uniform_(1, 25, generator=g))
        check_backward(normal((1, 2, 2, t, t), mean, std, dtype, g), normal((1, 2, 2, t, t), mean, std, dtype, g))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("problems", [1, 3, 7])
def test_backward_few_problems_split_columns(dtype, problems):
    # fewer than 8 problems: each is split into column chunks whose partial sums are added afterwards
    g = torch.Generator().manual_seed(problems)
    shape = (1, problems, 300, 300)
    check_backward(normal(shape, 0.0, 1.0, dtype, g), normal(shape, 1.0, 2.0, dtype, g))


# --- forward against the golden ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("t", T_SIZES)
def test_forward_against_golden(dtype, rank, t):
    g = torch.Generator().manual_seed(100 * rank + t)
    shape = (*leading(rank - 1), t)
    for mean, std in MODERATE:
        x = normal(shape, mean, std, dtype, g)
        out = attngrad.exp_segsum(x)
        assert out.dtype == dtype and out.shape == (*shape, t) and out.is_contiguous()
        assert_forward_close(out, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [2, 37, 256])
def test_forward_over_and_underflow_like_the_golden(dtype, t):
    # CANN-like wide data: segment sums far beyond exp's range give inf / 0 where the golden does
    g = torch.Generator().manual_seed(t)
    for mean, std in WIDE:
        x = normal((2, 2, 2, t), mean, std, dtype, g)
        out = attngrad.exp_segsum(x)
        assert_forward_close(out, x, skip_exp32_band=True)  # inf exactly where the golden is inf
        assert (out[golden_forward(x) == 0] == 0).all()  # and 0 where it underflows


def test_forward_float32_sums_keep_the_error_of_large_addends():
    # large steps (std 40) over long rows: the running sum often crosses zero, where an addend outweighs it and
    # a Kahan-compensated sum drops its term (up to 1.37e-5 on these rows); each row is judged alone
    g = torch.Generator().manual_seed(7)
    x = normal((400, 1, 1, 300), 0.0, 40.0, torch.float32, g)
    x[1::2] -= torch.rand((200, 1, 1, 1), generator=g) * 40.0  # and a negative drift on every other row
    out = attngrad.exp_segsum(x)
    for p in range(x.shape[0]):
        assert_forward_close(out[p:p + 1], x[p:p + 1], skip_exp32_band=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("problems", [1, 2, 5])
def test_forward_few_problems_split_rows_same_bits(dtype, problems):
    # fewer than 8 problems: rows are split into chunks that replay the sums above them; same bits
    x = normal((1, problems, 200), 0.0, 0.3, dtype)
    alone = attngrad.exp_segsum(x)
    batched = attngrad.exp_segsum(torch.cat([x, normal((1, 20, 200), 0.0, 0.3, dtype)], 1))[:, :problems]
    assert torch.equal(bits(alone), bits(batched))
    assert_forward_close(alone, x)


def test_forward_bfloat16_subnormal_outputs_are_not_flushed():
    # bf16 rows are rounded by the CPU's conversion (which flushes float32 subnormals) only for problems whose
    # negative x sum to at least -80. Here the segment sums from x[1] = -87 on fall by 0.03 per row; the exps of
    # those in [-87.6, -87.34] are float32 subnormals that exp32 and exp2_32 still produce (below about -87.68
    # they return 0, numeric.py). The second problem's 40 x of -2 sum to -80 exactly: the fast path.
    t = 41
    x = torch.cat([torch.tensor([0.0, -87.0]), torch.full((t - 2,), -0.03)]).view(1, 1, t)
    x = torch.cat([x, torch.cat([torch.zeros(1), torch.full((t - 1,), -2.0)]).view(1, 1, t)], 1).to(torch.bfloat16)
    out = attngrad.exp_segsum(x)
    golden = golden_forward(x)
    tiny = (golden > math.exp(-87.6)) & (golden < 2.0**-126)
    assert tiny[0, 0].sum() >= 5 and not tiny[0, 1].any()
    assert (out[tiny] > 0).all()  # not flushed to zero
    ulp = 2.0**-133  # spacing of the bf16 subnormals
    assert ((out[tiny].double() - golden[tiny].double()).abs() <= ulp).all()
    assert_forward_close(out, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [37, 128])
def test_forward_streamed_rows_same_bits(monkeypatch, dtype, t):
    # outputs from numeric.STREAM_MIN_BYTES on are written by non-temporal stores: same bits as plain stores
    x = normal((3, 2, t), 0.0, 0.3, dtype)
    plain = attngrad.exp_segsum(x)
    monkeypatch.setattr(numeric, "STREAM_MIN_BYTES", 0)
    streamed = attngrad.exp_segsum(x)
    assert torch.equal(bits(streamed), bits(plain))
    assert_forward_close(streamed, x)


def test_forward_accumulates_down_columns_not_cumsum_differences():
    # x[0] is huge: a difference of cumulative sums loses everything after it; the running sum does not
    x = torch.tensor([1e8, 0.5, 0.25, 0.125]).view(1, 1, 4)
    out = attngrad.exp_segsum(x)
    assert_forward_close(out, x)
    assert out[0, 0, 3, 1] == pytest.approx(math.exp(0.375), rel=1e-6)


def test_exp32_overflow_threshold():
    # exp(88.7212) = 3.3986e38 < FLT_MAX is representable; exp32 returns inf from 88.72 (numeric.py)
    x = torch.tensor([0.0, 88.7212]).view(1, 1, 2)
    value = attngrad.exp_segsum(x)[0, 0, 1, 0]
    if math.isinf(value):
        pytest.xfail("exp32 overflows from 88.72 < ln(FLT_MAX) = 88.7228 (kernels/numeric.py, reported)")
    assert value == pytest.approx(math.exp(float(x[0, 0, 1])), rel=1e-6)


# --- special values ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_backward_ignores_diagonal_and_upper_triangle(dtype, value):
    t = 37
    go, gs = torch.randn(2, 3, t, t).to(dtype), torch.randn(2, 3, t, t).to(dtype)
    clean = attngrad.exp_segsum_backward(go, gs)
    on_and_above = ~torch.ones(t, t, dtype=torch.bool).tril(-1)
    dirty = attngrad.exp_segsum_backward(go.masked_fill(on_and_above, value), gs.masked_fill(on_and_above, value))
    assert torch.equal(bits(clean), bits(dirty))
    check_backward(go.masked_fill(on_and_above, value), gs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_backward_special_values_in_lower_triangle_follow_golden(dtype, value):
    t = 20
    go, gs = torch.randn(1, 2, 2, t, t).to(dtype), torch.rand(1, 2, 2, t, t).to(dtype) + 0.5
    go[0, 0, 0, 9, 3] = value
    go[0, 1, 1, 15, 0] = value
    gs[0, 1, 0, 7, 6] = value
    out = check_backward(go, gs)
    assert not torch.isfinite(out[0, 0, 0, 4:10]).any() and torch.isfinite(out[0, 0, 0, :4]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_inf_minus_inf_gives_nan(dtype):
    t = 6
    go, gs = torch.ones(1, 1, t, t, dtype=dtype), torch.ones(1, 1, t, t, dtype=dtype)
    go[0, 0, 4, 1] = float("inf")
    go[0, 0, 5, 2] = float("-inf")
    out = check_backward(go, gs)
    assert torch.isnan(out[0, 0, 3:5]).all() and torch.isinf(out[0, 0, 2]) and torch.isinf(out[0, 0, 5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_special_values_follow_golden(dtype):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.0, 1, inf, 2, -inf, 3, nan, 1, 1, -0.5]).view(1, 1, 10).to(dtype)
    out = attngrad.exp_segsum(x)
    assert_forward_close(out, x)
    assert torch.isnan(out[0, 0, 6:, :6]).all() and torch.isinf(out[0, 0, 2:4, :2]).all()
    assert (out[0, 0, 4:6, 2:4] == 0).all()  # inf + -inf only where both are in the segment
    torch.testing.assert_close(out[0, 0, 9, 6:].float(), torch.tensor([1.5, 0.5, -0.5, 0.0]).exp(),
                               rtol=2.0**-8, atol=0)  # after the nan: finite segments again


# --- non-contiguous inputs (read in place) ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["transpose", "last_dim_stride", "expand"])
def test_backward_non_contiguous_same_bits(dtype, view):
    t = 33
    if view == "transpose":  # rows/columns swapped: element [i, j] of the view is base[j, i]
        go = torch.randn(2, 3, t, t).to(dtype).transpose(-1, -2)
        gs = torch.randn(3, 2, t, t).to(dtype).transpose(0, 1)
    elif view == "last_dim_stride":
        go = torch.randn(2, 3, t, 2 * t).to(dtype)[..., ::2]
        gs = torch.randn(2, 3, 2 * t, t).to(dtype)[:, :, ::2]
    else:  # zero strides on the leading dims
        go = torch.randn(1, 1, 1, t, t).to(dtype).expand(2, 3, 2, t, t)
        gs = torch.randn(2, 1, 2, t, t).to(dtype).expand(2, 3, 2, t, t)
    assert not go.is_contiguous()
    out = check_backward(go, gs)
    assert torch.equal(bits(out), bits(attngrad.exp_segsum_backward(go.contiguous(), gs.contiguous())))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["transpose", "last_dim_stride", "expand"])
def test_forward_non_contiguous_same_bits(dtype, view):
    t = 41
    x = {"transpose": lambda b: b.view(3, 2, 2, t).transpose(0, 1),
         "last_dim_stride": lambda b: b.view(2, 3, 2 * t)[..., ::2],
         "expand": lambda b: b[: 3 * t].view(1, 3, t).expand(2, 3, t)}[view](normal(12 * t, 0.0, 0.3, dtype))
    assert not x.is_contiguous()
    out = attngrad.exp_segsum(x)
    assert_forward_close(out, x)
    assert torch.equal(bits(out), bits(attngrad.exp_segsum(x.contiguous())))


# --- CANN's examples and small worked cases ---
def test_seed_forward_example_torch():
    out = attngrad.exp_segsum(SEED_X)
    assert out.shape == (1, 1, 1, 4, 4)
    torch.testing.assert_close(out.double(), SEED_OUT, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_seed_backward_example_torch(dtype):
    ones = torch.ones(1, 1, 1, 4, 4, dtype=dtype)
    assert attngrad.exp_segsum_backward(ones, ones).float().flatten().tolist() == [0, 3, 4, 3]


def test_spec_small_backward_cases():
    ones = torch.ones(1, 2, 3, 3)
    assert attngrad.exp_segsum_backward(ones, ones).tolist() == [[[0, 2, 2], [0, 2, 2]]]
    p = torch.arange(1, 10, dtype=torch.float32).view(1, 1, 3, 3)
    assert attngrad.exp_segsum_backward(p, torch.ones_like(p)).flatten().tolist() == [0, 11, 15]
    t = 9  # gradOutput = gradSelf = ones -> k * (T - k)
    ones = torch.ones(2, 1, 1, t, t)
    assert attngrad.exp_segsum_backward(ones, ones).flatten().tolist() == [k * (t - k) for k in range(t)] * 2


def _aclnn_run(acl_device, get_ws, execute, inputs, out_shape, dtype):
    tensors = [acl_device.tensor(t, ACL_DTYPES[dtype])[0] for t in inputs]
    out, out_ptr = acl_device.tensor(torch.zeros(out_shape, dtype=dtype), ACL_DTYPES[dtype])
    status = acl_device.run(get_ws, execute, *tensors, out)
    assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()
    return acl_device.read(out_ptr, dtype).view(out_shape)


def test_seed_examples_aclnn(acl_device):
    out = _aclnn_run(acl_device, aclnn.aclnnExpSegsumGetWorkspaceSize, aclnn.aclnnExpSegsum, [SEED_X],
                     (1, 1, 1, 4, 4), torch.float32)
    torch.testing.assert_close(out.double(), SEED_OUT, rtol=1e-6, atol=0)
    ones = torch.ones(1, 1, 1, 4, 4)
    grad = _aclnn_run(acl_device, aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward,
                      [ones, ones], (1, 1, 1, 4), torch.float32)
    assert grad.flatten().tolist() == [0, 3, 4, 3]


@pytest.mark.parametrize("module, expected", [
    ("exp_segsum", [1, 0, 0, 0, 2.718282, 1, 0, 0, 20.085537, 7.389056, 1, 0, 403.428793, 148.413159, 20.085537, 1]),
    ("exp_segsum_backward", [0, 3, 4, 3]),
])
def test_example_ports_print_the_seed_results(module, expected):
    import importlib

    main = importlib.import_module(f"attngrad.examples.{module}").main
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main() == 0
    lines = buffer.getvalue().splitlines()
    assert [line.split(" is: ")[0] for line in lines] == [f"result[{i}]" for i in range(len(expected))]
    values = [float(line.split(" is: ")[1]) for line in lines]
    assert values == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_aclnn_matches_torch_layer(acl_device, dtype):
    x = normal((2, 3, 4, 30), 0.0, 0.4, dtype)
    out = _aclnn_run(acl_device, aclnn.aclnnExpSegsumGetWorkspaceSize, aclnn.aclnnExpSegsum, [x],
                     (2, 3, 4, 30, 30), dtype)
    assert torch.equal(bits(out), bits(attngrad.exp_segsum(x)))
    go = torch.randn(out.shape).to(dtype)
    grad = _aclnn_run(acl_device, aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward,
                      [go, out], (2, 3, 4, 30), dtype)
    assert torch.equal(bits(grad), bits(attngrad.exp_segsum_backward(go, out)))


def test_aclnn_non_contiguous_views(acl_device):
    # gradOutput is a transposed view of its storage, gradInput a strided view: only its elements change
    t = 5
    base = torch.randn(2, t, t)
    go, _ = acl_device.tensor(base, aclnn.ACL_FLOAT, dims=[1, 2, t, t], strides=[2 * t * t, t * t, 1, t])
    gs, _ = acl_device.tensor(torch.ones(1, 2, t, t), aclnn.ACL_FLOAT)
    gi, gi_ptr = acl_device.tensor(torch.full((2 * 2 * t,), 7.0), aclnn.ACL_FLOAT, dims=[1, 2, t],
                                   strides=[4 * t, 2 * t, 2], offset=1)
    assert acl_device.run(aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward,
                          go, gs, gi) == aclnn.ACLNN_SUCCESS
    storage = acl_device.read(gi_ptr, torch.float32)
    expected = attngrad.exp_segsum_backward(base.transpose(-1, -2).unsqueeze(0), torch.ones(1, 2, t, t))
    assert torch.equal(storage[1::2].view(1, 2, t), expected)
    assert (storage[0::2] == 7.0).all()


# --- autograd ---
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 17), (1, 2, 2, 64)])
def test_autograd_matches_float64_autograd(dtype, shape):
    x = normal(shape, 0.0, 0.2, dtype).requires_grad_()
    dy = torch.randn(*shape, shape[-1]).to(dtype)
    out = attngrad.exp_segsum(x)
    assert out.requires_grad
    (grad,) = torch.autograd.grad(out, x, dy)
    assert grad.dtype == dtype and grad.shape == x.shape and (grad[..., 0] == 0).all()
    x64 = x.detach().double().requires_grad_()
    (golden,) = torch.autograd.grad(exp_segsum_reference(x64), x64, dy.double())
    assert_close(grad, golden, dtype, use_mere=True)


def test_autograd_non_contiguous_input_and_chain():
    base = torch.randn(3, 2, 12).mul(0.3).requires_grad_()
    loss = (attngrad.exp_segsum(base.transpose(0, 1)) * torch.linspace(-1, 1, 12)).sum()
    (grad,) = torch.autograd.grad(loss, base)
    b64 = base.detach().double().requires_grad_()
    (golden,) = torch.autograd.grad((exp_segsum_reference(b64.transpose(0, 1)) * torch.linspace(-1, 1, 12)).sum(),
                                    b64)
    assert_close(grad, golden, use_mere=True)


def test_autograd_backward_uses_the_backward_kernel():
    x = torch.randn(2, 2, 9).requires_grad_()
    dy = torch.randn(2, 2, 9, 9)
    out = attngrad.exp_segsum(x)
    (grad,) = torch.autograd.grad(out, x, dy)
    assert torch.equal(grad, attngrad.exp_segsum_backward(dy, out.detach()))


def test_no_graph_without_requires_grad():
    assert attngrad.exp_segsum(torch.randn(1, 2, 3)).grad_fn is None
    with torch.no_grad():
        assert attngrad.exp_segsum(torch.randn(1, 2, 3, requires_grad=True)).grad_fn is None


# --- determinism, empty tensors ---
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_across_calls_and_thread_counts(dtype):
    x = normal((1, 3, 150), 0.0, 0.3, dtype)  # 3 problems: split paths on both kernels
    go = torch.randn(1, 3, 150, 150).to(dtype)
    results = []
    for n in (1, 2, 2, 1):
        with torch_threads(n):
            out = attngrad.exp_segsum(x)
            results.append((out, attngrad.exp_segsum_backward(go, out)))
    for out, grad in results[1:]:
        assert torch.equal(bits(out), bits(results[0][0])) and torch.equal(bits(grad), bits(results[0][1]))


@pytest.mark.parametrize("shape", [(0, 2, 3), (2, 0, 3), (2, 3, 0), (0, 1, 2, 5), (1, 2, 3, 0)])
def test_empty_tensors_torch_layer(shape):
    x = torch.randn(shape, requires_grad=True)
    out = attngrad.exp_segsum(x)
    assert out.shape == (*shape, shape[-1])
    grad = attngrad.exp_segsum_backward(out.detach(), out.detach())
    assert grad.shape == shape


def test_aclnn_forward_into_a_strided_output(acl_device):
    # out is every other element of its storage: written in place, the elements between untouched
    t = 6
    x = torch.randn(1, 2, 1, t) * 0.3
    tx, _ = acl_device.tensor(x, aclnn.ACL_FLOAT)
    out, out_ptr = acl_device.tensor(torch.full((2 * 2 * t * t,), 7.0), aclnn.ACL_FLOAT, dims=[1, 2, 1, t, t],
                                     strides=[4 * t * t, 2 * t * t, 2 * t * t, 2 * t, 2])
    assert acl_device.run(aclnn.aclnnExpSegsumGetWorkspaceSize, aclnn.aclnnExpSegsum, tx, out) == aclnn.ACLNN_SUCCESS
    storage = acl_device.read(out_ptr, torch.float32)
    assert torch.equal(storage[0::2].view(1, 2, 1, t, t), attngrad.exp_segsum(x))
    assert (storage[1::2] == 7.0).all()


def test_aclnn_backward_output_inside_an_input(acl_device):
    # gradInput is the first row of gradOutput's own storage: the kernel result goes through a copy
    t = 5
    go_host = torch.randn(1, 1, t, t)
    go, go_ptr = acl_device.tensor(go_host, aclnn.ACL_FLOAT)
    gs, _ = acl_device.tensor(torch.ones(1, 1, t, t), aclnn.ACL_FLOAT)
    gi = aclnn.aclCreateTensor([1, 1, t], aclnn.ACL_FLOAT, [t, t, 1], 0, aclnn.ACL_FORMAT_ND, [t * t], go_ptr)
    assert acl_device.run(aclnn.aclnnExpSegsumBackwardGetWorkspaceSize, aclnn.aclnnExpSegsumBackward,
                          go, gs, gi) == aclnn.ACLNN_SUCCESS
    expected = attngrad.exp_segsum_backward(go_host, torch.ones(1, 1, t, t))
    assert torch.equal(acl_device.read(go_ptr, torch.float32)[:t].view(1, 1, t), expected)
