"""A kernel launched through attngrad.kernels.layouts compiles one specialisation for every mix of contiguous and
strided arrays, and computes the same results as with its arguments' own layouts."""

from typing import NamedTuple

import numpy as np
from numba import njit

from attngrad.kernels.layouts import launch_strided, strided_layout


class Pair(NamedTuple):
    a: np.ndarray
    b: np.ndarray
    scale: float


def _kernel():
    @njit
    def weighted_sum(pair, out):
        for i in range(out.shape[0]):
            out[i] = (pair.a[i] + pair.b[i]) * pair.scale
    return weighted_sum


def test_every_mix_of_layouts_shares_one_strided_specialisation():
    kernel = strided_layout(_kernel())
    x = np.arange(16, dtype=np.float32)
    contiguous, strided = x[:8].copy(), x[::2]
    out_c, out_s = np.empty(8, np.float32), np.empty(16, np.float32)[::2]
    for a, b, out in ((strided, contiguous, out_c), (contiguous, strided, out_c), (contiguous, contiguous, out_s),
                      (strided, strided, out_s), (contiguous, contiguous, out_c)):
        kernel(Pair(a, b, 0.5), out)
        np.testing.assert_array_equal(out, (a + b) * np.float32(0.5))
    layouts = {tuple(t.layout for t in sig[0].types[:2]) + (sig[1].layout,) for sig in kernel.dispatcher.signatures}
    assert layouts == {("A", "A", "A")}


def test_launch_strided_compiles_one_specialisation_except_for_exact_arguments():
    kernel = _kernel()
    x = np.arange(16, dtype=np.float32)
    contiguous, strided = x[:8].copy(), x[::2]
    for a, out in ((contiguous, np.empty(8, np.float32)), (strided, np.empty(8, np.float32)),
                   (contiguous, np.empty(16, np.float32)[::2])):
        launch_strided(kernel, Pair(a, contiguous, 0.5), out, exact=(1,))
        np.testing.assert_array_equal(out, (a + contiguous) * np.float32(0.5))
    layouts = {tuple(t.layout for t in sig[0].types[:2]) + (sig[1].layout,) for sig in kernel.signatures}
    assert layouts == {("A", "A", "C"), ("A", "A", "A")}
