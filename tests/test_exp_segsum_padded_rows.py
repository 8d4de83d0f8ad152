"""ExpSegsumBackward's padded row loop: rows are read up to whole 16-lane vectors (past the diagonal), and
what lies there (on and above the diagonal, any value) must add exactly nothing.

Sizes straddle the vector width (15..17, 31..33, 47..49, 64, 65) and the column split of few problems.
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.kernels.exp_segsum_reference import exp_segsum_backward_reference, saturate
from attngrad.precision import assert_close

from helpers import bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65])
@pytest.mark.parametrize("problems", [1, 9])  # 1: column chunks (split path); 9: one task per problem
def test_values_past_the_diagonal_add_nothing(dtype, t, problems):
    g = torch.Generator().manual_seed(t * 10 + problems)
    go = torch.randn(problems, 1, t, t, generator=g).to(dtype)
    gs = torch.randn(problems, 1, t, t, generator=g).to(dtype)
    clean = attngrad.exp_segsum_backward(go, gs)
    golden = saturate(exp_segsum_backward_reference(go, gs), dtype)
    assert_close(clean, golden, dtype, use_mere=True)
    on_and_above = ~torch.ones(t, t, dtype=torch.bool).tril(-1)
    for value in (float("nan"), float("inf"), -0.0):
        dirty = attngrad.exp_segsum_backward(go.masked_fill(on_and_above, value), gs.masked_fill(on_and_above, value))
        assert torch.equal(bits(clean), bits(dirty)), value

