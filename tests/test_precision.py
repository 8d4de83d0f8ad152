"""The precision harness (README, 'How precision is judged'): it must pass good results and catch bad ones."""

from __future__ import annotations

import pytest
import torch

from attngrad.precision import MERE_TOL, NORM_REL_TOL, assert_close, compare

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _golden(n=1000):
    return torch.rand(n, dtype=torch.float64) + 0.5  # |g| in [0.5, 1.5]: no near-zero denominators


def test_thresholds_per_dtype():
    assert NORM_REL_TOL == {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
    assert MERE_TOL == {torch.float32: 2.0**-13, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_to_dtype_passes(dtype):
    g = _golden()
    report = assert_close(g.to(dtype), g, use_mere=True)
    assert report.dtype == dtype and report.passed


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rel_threshold_is_the_boundary(dtype):
    g = _golden()
    tol = NORM_REL_TOL[dtype]
    assert compare(g * (1 + 0.9 * tol), g, dtype).passed
    bad = compare(g * (1 + 1.1 * tol), g, dtype)
    assert not bad.passed and bad.norm_rel == pytest.approx(1.1 * tol, rel=1e-6)
    with pytest.raises(AssertionError, match="FAIL"):
        assert_close(g * (1 + 1.1 * tol), g, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mere_enforced_only_with_use_mere(dtype):
    # relative error 3 T on the small half of the golden: invisible to the norm, 1.5 T on the mean
    g = _golden()
    g[::2] *= 1e-3
    out = g.clone()
    out[::2] *= 1 + 3 * MERE_TOL[dtype]
    rep_norm = compare(out, g, dtype)
    rep_mere = compare(out, g, dtype, use_mere=True)
    assert rep_norm.passed
    assert rep_mere.mere == pytest.approx(1.5 * MERE_TOL[dtype], rel=1e-3) and not rep_mere.passed


def test_mare_reported_not_enforced():
    g = torch.rand(10000, dtype=torch.float64) + 0.5
    out = g.clone()
    tol = MERE_TOL[torch.float16]
    out[0] = g[0] * (1 + 50 * tol)  # MARE far above 10 T; MERE and the norm stay small
    rep = compare(out, g, torch.float16, use_mere=True)
    assert rep.mare > 10 * tol
    assert rep.passed


def test_catches_a_wrong_result():
    g = _golden()
    assert not compare(g.flip(0), g, torch.float32).passed
    assert not compare(torch.zeros_like(g), g, torch.bfloat16).passed


@pytest.mark.parametrize("where", ["out", "golden"])
def test_nan_mismatch_fails(where):
    g = _golden()
    out = g.clone()
    (out if where == "out" else g)[3] = float("nan")
    rep = compare(out, g, torch.float32)
    assert not rep.special_ok and not rep.passed


def test_matching_nan_and_inf_pass():
    g = _golden()
    g[1], g[2], g[3] = float("nan"), float("inf"), -float("inf")
    rep = compare(g.clone().float(), g, use_mere=True)
    assert rep.special_ok and rep.passed


@pytest.mark.parametrize("value", [-float("inf"), 1.0, float("nan")])
def test_inf_mismatch_fails(value):
    g = _golden()
    g[5] = float("inf")
    out = g.clone()
    out[5] = value
    assert not compare(out, g, torch.float32).passed


def test_inf_where_golden_finite_fails():
    g = _golden()
    out = g.clone()
    out[7] = float("inf")
    assert not compare(out, g, torch.float32).passed


def test_exact_zero_violation():
    g = _golden()
    g[:10] = 0.0
    zero = torch.zeros_like(g, dtype=torch.bool)
    zero[:10] = True
    out = g.clone()
    assert compare(out, g, torch.float32, exact_zero=zero).passed
    out[4] = 1e-30  # numerically negligible, but not exactly 0
    assert compare(out, g, torch.float32).passed
    assert not compare(out, g, torch.float32, exact_zero=zero).passed
    out[4] = float("nan")
    assert not compare(out, g, torch.float32, exact_zero=zero).passed


def test_exact_zero_broadcasts():
    g = torch.rand(2, 3, 4, dtype=torch.float64)
    g[:, :, 0] = 0
    zero = torch.zeros(1, 1, 4, dtype=torch.bool)
    zero[..., 0] = True
    out = g.float()
    assert compare(out, g, exact_zero=zero).passed
    out[1, 2, 0] = -1e-20
    assert not compare(out, g, exact_zero=zero).passed


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape mismatch"):
        compare(torch.zeros(3), torch.zeros(4, dtype=torch.float64))


def test_empty_and_all_zero_golden():
    assert compare(torch.zeros(0), torch.zeros(0, dtype=torch.float64), use_mere=True).passed
    z = torch.zeros(8, dtype=torch.float64)
    assert compare(z.float(), z, use_mere=True).passed
    assert not compare(torch.full((8,), 1e-3), z).passed  # norm of the golden is 0: absolute error judged
