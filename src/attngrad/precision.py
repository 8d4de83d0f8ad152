"""How attngrad judges results against a float64 golden (the README's 'How precision is judged').

The golden is computed in float64 from the same inputs (already rounded to their own dtype).
``compare`` returns the figures and a verdict:

* norm-relative error ``||out - golden|| / ||golden||`` within ``NORM_REL_TOL[dtype]``;
* for the softmax and segsum operators also CANN's single-benchmark mean
  ``MERE = mean(|out - golden| / (|golden| + 1e-7)) < MERE_TOL[dtype]``; its max rule
  ``MARE < 10 * T`` is reported but not enforced (it flags cancellation-sized outputs).
  One adjustment: the denominator is never below the dtype's smallest normal number. CANN's 1e-7
  floor lies inside float16's subnormal range (< 6.1e-5), where even the correctly rounded golden has
  relative errors of up to 50%; for float32 and bfloat16 the floor is unchanged;
* special values: wherever the golden is nan, +inf or -inf the output must be the same, and
  positions the caller lists as ``exact_zero`` must be exactly 0.

CANN's element rule for flash attention (:func:`element_bad`, used by ``attngrad compare`` and the golden-mode
tests): an element is bad when ``|a - g| > max(ELEMENT_REL * max(|a|, |g|), ELEMENT_ABS)``; an output passes
when at most ``ELEMENT_BAD_RATIO`` of its elements are bad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORM_REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
MERE_TOL = {torch.float32: 2.0**-13, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
ELEMENT_REL, ELEMENT_ABS, ELEMENT_BAD_RATIO = 0.005, 2.5e-5, 0.005


def element_bad(actual: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """Bool, CANN's element rule: ``|a - g| > max(0.005 * max(|a|, |g|), 2.5e-5)`` in float64 (a nan or inf on
    either side is bad unless both hold the same special value)."""
    a, g = actual.detach().double(), golden.detach().double()
    same_special = (a == g) | (a.isnan() & g.isnan())
    bad = (a - g).abs() > torch.clamp(ELEMENT_REL * torch.maximum(a.abs(), g.abs()), min=ELEMENT_ABS)
    return (bad | ~(a.isfinite() & g.isfinite())) & ~same_special


@dataclass
class PrecisionReport:
    dtype: torch.dtype
    norm_rel: float
    mere: float
    mare: float
    special_ok: bool
    use_mere: bool

    @property
    def passed(self) -> bool:
        ok = self.special_ok and self.norm_rel <= NORM_REL_TOL[self.dtype]
        if self.use_mere:
            ok = ok and self.mere < MERE_TOL[self.dtype]
        return ok

    def __str__(self) -> str:
        verdict = "pass" if self.passed else "FAIL"
        return (f"{verdict}: norm_rel={self.norm_rel:.3e} (tol {NORM_REL_TOL[self.dtype]:.1e}) "
                f"MERE={self.mere:.3e} MARE={self.mare:.3e} special_ok={self.special_ok}")


def compare(out: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype | None = None, *,
            use_mere: bool = False, exact_zero: torch.Tensor | None = None) -> PrecisionReport:
    """Compare ``out`` against the float64 ``golden``; ``dtype`` selects the thresholds (default out's)."""
    dtype = dtype or out.dtype
    o = out.detach().to(torch.float64)
    g = golden.detach().to(torch.float64)
    if o.shape != g.shape:
        raise ValueError(f"shape mismatch: out {list(o.shape)} vs golden {list(g.shape)}")
    finite = torch.isfinite(g)
    special_ok = bool(torch.equal(torch.isnan(o), torch.isnan(g)))
    special_ok &= bool(torch.equal(o[torch.isinf(g)], g[torch.isinf(g)]))
    if exact_zero is not None:
        special_ok &= bool((o[exact_zero.expand_as(o)] == 0).all())
    diff = (o - g)[finite]
    gf = g[finite]
    norm_g = float(torch.linalg.vector_norm(gf)) if gf.numel() else 0.0
    norm_d = float(torch.linalg.vector_norm(diff)) if diff.numel() else 0.0
    norm_rel = norm_d / norm_g if norm_g > 0 else norm_d
    floor = torch.finfo(dtype).tiny if dtype in MERE_TOL else 0.0
    rel = diff.abs() / (gf.abs() + 1e-7).clamp_min(floor)
    mere = float(rel.mean()) if rel.numel() else 0.0
    mare = float(rel.max()) if rel.numel() else 0.0
    if norm_rel != norm_rel:  # nan where the golden is finite
        special_ok = False
    return PrecisionReport(dtype, norm_rel, mere, mare, special_ok, use_mere)


def assert_close(out: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype | None = None, **kw) -> PrecisionReport:
    """``compare`` and raise ``AssertionError`` with the figures when the verdict is fail."""
    report = compare(out, golden, dtype, **kw)
    assert report.passed, str(report)
    return report
