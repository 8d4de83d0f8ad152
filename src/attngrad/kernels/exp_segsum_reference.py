"""Plain float64 reference of ExpSegsum and ExpSegsumBackward: the golden of the tests.

The forward follows CANN's documented steps (broadcast, zero j >= i, cumsum down the rows, -inf
above the diagonal, exp); the backward follows CANN's nine documented steps literally (multiply, mask the
diagonal and above, flip, cumsum, flip, mask, sum the last axis). Masks are applied with ``where``, so
nan/inf on or above the diagonal never reach the result. Inputs are used as given (already rounded to
their dtype); results are float64.
"""

from __future__ import annotations

import torch


def _upper_with_diagonal(t: int) -> torch.Tensor:
    """CANN's masks A and B of the ExpSegsumBackward steps: True on and above the diagonal, False strictly
    below."""
    return torch.ones(t, t, dtype=torch.bool).triu(0)


def exp_segsum_reference(x: torch.Tensor) -> torch.Tensor:
    """x ``(..., T)`` -> ``(..., T, T)``: ``exp(sum x[j+1..i])`` for j <= i, 0 above the diagonal."""
    t = x.shape[-1]
    xd = x.double()
    wide = xd.unsqueeze(-1).expand(*xd.shape, t)  # wide[..., i, j] = x[i]
    wide = torch.where(_upper_with_diagonal(t), torch.zeros((), dtype=torch.float64), wide)  # step 2: j >= i -> 0
    sums = wide.cumsum(-2)  # step 3
    sums = sums.masked_fill(_upper_with_diagonal(t).triu(1), float("-inf"))  # step 4: j > i -> -inf
    return sums.exp()  # step 5


def exp_segsum_backward_reference(grad_output: torch.Tensor, grad_self: torch.Tensor) -> torch.Tensor:
    """(..., T, T) x2 -> (..., T): ``grad[k] = sum_{i >= k, j < k} grad_output[i, j] * grad_self[i, j]``."""
    t = grad_output.shape[-1]
    zero = torch.zeros((), dtype=torch.float64)
    out_mul = grad_output.double() * grad_self.double()  # step 1
    mask_a = _upper_with_diagonal(t)  # step 2
    out_mul = torch.where(mask_a, zero, out_mul)  # step 3
    out_flip = out_mul.flip(-2)  # step 4
    out_cumsum = out_flip.cumsum(-2)  # step 5
    out_flip2 = out_cumsum.flip(-2)  # step 6
    mask_b = _upper_with_diagonal(t)  # step 7
    out_flip2 = torch.where(mask_b, zero, out_flip2)  # step 8
    return out_flip2.sum(-1)  # step 9


def saturate(golden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The golden with values that overflow ``dtype`` replaced by +-inf, as the kernel's cast makes them.

    (Finite float64 values beyond the dtype's range cannot be represented by any result of that dtype.)
    """
    cast = golden.to(dtype).double()
    return torch.where(torch.isinf(cast) & torch.isfinite(golden), cast, golden)
