"""Fused one-pass CPU kernels for ScaledMaskedSoftmax and its backward.

Both kernels take 4-D kernel views (see :mod:`.tensor_view`): data ``[B, N, S1, S2]`` with any strides,
and the mask in its own ``[Bm, Nm, S1, S2]`` shape with ``Bm in {1, B}``, ``Nm in {1, N}`` (CANN's
broadcast on dims 0 and 1). Rows are independent, so the ``prange`` split gives the same bits for any
thread count. Each row is read from memory once; the second sweep runs over data still in cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numeric import FASTMATH, exp32, narrow, widen

MASK_VALUE = np.float32(-10000.0)  # CANN fills masked logits with -10000, not -inf
_ROWS_PER_TASK = 16


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def scaled_masked_softmax_forward(x, mask, scale, round_scaled, y):
    """y = softmax(where(mask, -10000, x * scale)) over the last axis, fp32 math.

    ``round_scaled``: the fp16 path of CANN scales in fp16, so ``x * scale`` is rounded to x's dtype
    (``scale`` is then already the fp16-rounded value).
    """
    B, N, S1, S2 = x.shape
    mb = mask.shape[0] > 1
    mn = mask.shape[1] > 1
    rows = B * N * S1
    tasks = (rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK
    for task in prange(tasks):
        buf = np.empty(S2, dtype=np.float32)
        for r in range(task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK)):
            b = r // (N * S1)
            n = (r // S1) % N
            s = r % S1
            bm = b if mb else 0
            nm = n if mn else 0
            top = -np.inf
            for j in range(S2):
                z = widen(x[b, n, s, j]) * scale
                if round_scaled:
                    z = widen(narrow(z, x))
                z = MASK_VALUE if mask[bm, nm, s, j] else z
                buf[j] = z
                top = z if z > top else top
            total = np.float32(0.0)
            for j in range(S2):
                e = exp32(buf[j] - top)
                buf[j] = e
                total += e
            inv = np.float32(1.0) / total
            for j in range(S2):
                y[b, n, s, j] = narrow(buf[j] * inv, y)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def scaled_masked_softmax_backward(grad_output, y, mask, scale, out):
    """out = where(mask, 0, (dy - sum(dy * y)) * y * scale); the row sum runs over ALL positions."""
    B, N, S1, S2 = grad_output.shape
    mb = mask.shape[0] > 1
    mn = mask.shape[1] > 1
    rows = B * N * S1
    for r in prange(rows):
        b = r // (N * S1)
        n = (r // S1) % N
        s = r % S1
        bm = b if mb else 0
        nm = n if mn else 0
        acc = np.float32(0.0)
        for j in range(S2):
            acc += widen(grad_output[b, n, s, j]) * widen(y[b, n, s, j])
        for j in range(S2):
            g = (widen(grad_output[b, n, s, j]) - acc) * widen(y[b, n, s, j]) * scale
            out[b, n, s, j] = narrow(np.float32(0.0) if mask[bm, nm, s, j] else g, out)
