"""Fused CPU kernels for ExpSegsum (CANN op ``Segsum``) and its backward (``ExpSegsumGrad``).

Contract: kernel views (see :mod:`.tensor_view`: float32, bfloat16 as uint16, float16 as int16; any strides),
flattened by the caller to ``[A, B, C, T]`` (forward input) and ``[A, B, C, T, T]`` (backward inputs).
Forward ``out[i, j] = exp(x[j+1] + ... + x[i])`` for ``j <= i`` (diagonal exactly 1), exactly 0 above;
backward ``grad[k] = sum_{i >= k, j < k} grad_output[i, j] * grad_self[i, j]`` (docs/cann-semantics.md,
'ExpSegsum'). fp32 sums and exp, one rounding to the output type. Memory: one length-T fp32 vector and one
output row of scratch per task.

Forward: a length-T fp32 vector ``acc`` holds the running column sums ``acc[j] = x[j+1] + ... + x[i]``,
accumulated down each column as CANN's kernel does (never a difference of cumulative sums). Unlike CANN the
sums carry a compensation term (Neumaier's, still fp32): the exponent's rounding error becomes the output's
relative error, and plain fp32 sums of large segments (|sum| up to 88, the fp32 exp range) exceed the fp32
norm-relative limit of 1e-5; compensated, what is left is about the final rounding of the sum to fp32.
nan/inf propagate as in the plain sum.
Each row is one fused loop (add x[i], exp, round) over whole 16-lane vectors through the diagonal (the columns
past it add -0.0 and give 0) into an aligned scratch row, copied out with non-temporal stores when the output
is large (:func:`.numeric.copy_row`). The exp is :func:`.numeric.exp_for`; bf16 rounds by ``narrow_ftz`` unless
the problem's column sums may fall below -87.3 (:func:`_may_be_subnormal`), where it would flush subnormals.

Backward: rows are swept from ``T-1`` down to 0 keeping a length-T fp32 running column sum of
``grad_output * grad_self`` over the strict lower triangle; after row ``i`` is added,
``grad[i] = sum_{j < i} colsum[j]``. Each row is swept in whole 16-lane vectors, the lanes past the diagonal
adding -0.0, the exact neutral element, whatever value lies there. Rows go in pairs (one pass over the column
sums for two rows), and the next problem is prefetched into the level 2 cache in ascending rows meanwhile (the
sweep reads rows in descending order, which the hardware prefetchers do not follow). With enough problems one
task per problem writes its gradient row directly, in a single parallel region per call (the calls are short).

Work splitting (``splits`` > 1, chosen by the caller when there are few problems): the forward splits
the rows of a problem into chunks, each chunk first replaying the column sums of the rows above it in
the same order (so the bits do not depend on the split); the backward splits the columns into chunks of
equal triangle area and adds the chunks' partial sums in a fixed order.

Measurements behind these choices: docs/performance.md, 'Kernel measurements'.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .numeric import (FASTMATH, aligned_empty, array_at, copy_row, exp_for, narrow, narrow_ftz, narrow_ftz_flushes,
                      prefer_512_bit_vectors, prefetch_bytes, row_address, stream_fence, widen)
from .layouts import strided_layout
from .threads import on_torch_threads


# The forward's compensated sums need IEEE addition order: no reassociation (it would cancel the compensation).
_ORDERED = FASTMATH - {"reassoc"}
_INF = np.float32(np.inf)
_NEG_ZERO = np.float32(-0.0)  # x + -0.0 == x for every x (+0.0 included): the neutral element of a masked add
_LANES = 16  # rows are swept in whole 16-lane vectors (one AVX-512 register of float32), both directions


@njit(inline="always", fastmath=_ORDERED)
def _add(acc, comp, xi, j, i32):
    """Add x[i] to the running sum of column j when j < i; from column i on, add -0.0, which leaves the column's
    sum (still zero) as it is. Returns the compensated sum ``acc[j] + comp[j]``.

    Neumaier's compensated sum in fp32: ``comp[j]`` collects the exact rounding error of every addition (Knuth's
    branch-free two-sum), whichever operand is the larger; Kahan's form loses it when an addend outweighs the
    running sum."""
    y = xi if np.int32(j) < i32 else _NEG_ZERO
    s = acc[j]
    t = s + y
    y_part = t - s
    error = (s - (t - y_part)) + (y - y_part)
    c = comp[j] + error if abs(t) < _INF else np.float32(0.0)  # inf/nan: no compensation
    comp[j] = c
    acc[j] = t
    return t + c


@njit(inline="always", fastmath=_ORDERED)
def _entry(e, j, i32):
    """Row i's value in column j: the exp ``e`` below the diagonal, exactly 1 on it, exactly 0 above."""
    j32 = np.int32(j)
    return e if j32 < i32 else (np.float32(1.0) if j32 == i32 else np.float32(0.0))


@njit(inline="always", fastmath=_ORDERED)
def _add_row(acc, comp, xi, i, width):
    """Add x[i] to the running sums of the columns j < i, sweeping ``width`` columns (:func:`_width`)."""
    i32 = np.int32(i)
    for j in range(width):
        _add(acc, comp, xi, j, i32)


@njit(inline="always", fastmath=_ORDERED)
def _add_exp_loop(rounding, acc, comp, xi, i, width, row, out):
    """:func:`_add_row`, and row[:width] = row i of the output rounded to out's element type by ``rounding``, in
    one loop."""
    i32 = np.int32(i)
    for j in range(width):
        row[j] = rounding(_entry(exp_for(_add(acc, comp, xi, j, i32), out), j, i32), out)


@njit(inline="always", fastmath=_ORDERED)
def _add_exp_row(acc, comp, xi, i, width, row, out, exact):
    """:func:`_add_exp_loop` rounding by ``narrow`` when ``exact``, else by ``narrow_ftz`` (the loop is compiled
    once per rounding)."""
    if exact:
        _add_exp_loop(narrow, acc, comp, xi, i, width, row, out)
    else:
        _add_exp_loop(narrow_ftz, acc, comp, xi, i, width, row, out)


@njit(inline="always")
def _may_be_subnormal(xs):
    """Whether an exp of a column sum ``x[j+1] + ... + x[i]`` of the problem xs may be a float32 subnormal (below
    2**-126 = exp(-87.3), where ``narrow_ftz`` differs from ``narrow``). Not when the negative x[k] sum to at
    least -80 (in float64; a nan is skipped, -inf fails the test): every column sum is then exactly >= -80, and
    its compensated fp32 value is within (2u + O(T u^2)) * sum|x| of it (u = 2**-24), so it could fall below -87
    only with sum|x| > 2**22, when the positive terms make it far larger than 0."""
    negative = 0.0
    for k in range(1, xs.shape[0]):
        v = np.float64(widen(xs[k]))
        negative += v if v < 0.0 else 0.0
    return not negative >= -80.0


@njit(inline="always")
def _width(i, padded):
    """Columns swept for row i: whole vectors through column i (``padded``: T in whole vectors)."""
    return min(padded, (i // _LANES + 1) * _LANES)


@on_torch_threads
@strided_layout
@njit(parallel=True, fastmath=_ORDERED, cache=True)
def exp_segsum_forward(x, splits, stream, out):
    """x ``[A, B, C, T]`` -> out ``[A, B, C, T, T]`` (any strides), fp32 sums and exp. ``stream``: out's rows are
    written by non-temporal stores where contiguous (:func:`.numeric.streams`)."""
    A, B, C, T = x.shape
    problems = A * B * C
    rows_per_task = (T + splits - 1) // splits
    padded = (T + _LANES - 1) // _LANES * _LANES
    for task in prange(problems * splits):
        p = task // splits
        first = (task % splits) * rows_per_task
        a, b, c = p // (B * C), (p // C) % B, p % C
        acc, comp = aligned_empty((padded,), np.float32), aligned_empty((padded,), np.float32)
        row = aligned_empty((padded,), out.dtype)
        acc[:], comp[:], row[:] = 0, 0, narrow(np.float32(0.0), out)
        for i in range(1, first):  # replay the column sums of the rows above this chunk
            _add_row(acc, comp, widen(x[a, b, c, i]), i, _width(i, padded))
        address = row_address(out, a, b, c)
        exact = narrow_ftz_flushes(out) and _may_be_subnormal(x[a, b, c])
        for i in range(first, min(T, first + rows_per_task)):
            _add_exp_row(acc, comp, widen(x[a, b, c, i]), i, _width(i, padded), row, out, exact)
            if out.strides[4] == out.itemsize:
                copy_row(address + i * out.strides[3], row.ctypes.data, T * out.itemsize, stream)
            else:
                for j in range(T):
                    out[a, b, c, i, j] = row[j]
        if stream:
            stream_fence()


@njit(fastmath=FASTMATH, cache=True)
def column_bounds(t, splits):
    """Column chunk bounds ``[0, ..., t]`` splitting the strict lower triangle into equal areas."""
    bounds = np.empty(splits + 1, dtype=np.int64)
    bounds[0] = 0
    total = t * (t - 1) // 2
    area = 0
    s = 1
    for j in range(t):
        while s < splits and area >= (total * s + splits - 1) // splits:
            bounds[s] = j
            s += 1
        area += t - 1 - j
    while s <= splits:
        bounds[s] = t
        s += 1
    return bounds


@njit(inline="always", fastmath=FASTMATH)
def _add_product_rows(colsum, g1, g2, width, h1, h2, width_next):
    """Two rows in one sweep: colsum[j] += g1[j] * g2[j] for j < width, then colsum[j] += h1[j] * h2[j] for
    j < width_next (``width_next`` 0: one row only); returns the sums of colsum[:width] after the first update
    and of colsum[:width_next] after the second.

    The loop runs over ``g1.size`` (``width`` rounded up to whole vectors by the caller, so LLVM's vector
    loop has no scalar remainder); columns from ``width`` on are read but add -0.0 (exactly nothing, even
    when the product there is nan or inf: those elements lie on or above the diagonal and must not count).
    """
    total, total_next = np.float32(0.0), np.float32(0.0)
    w32, w32_next = np.int32(width), np.int32(width_next)
    for j in range(g1.size):
        keep = np.int32(j) < w32  # 32-bit lanes: a 16-lane compare (64-bit indices halve the vector width)
        keep_next = np.int32(j) < w32_next
        v = colsum[j] + (widen(g1[j]) * widen(g2[j]) if keep else _NEG_ZERO)
        total += v if keep else _NEG_ZERO
        v = v + (widen(h1[j]) * widen(h2[j]) if keep_next else _NEG_ZERO)
        total_next += v if keep_next else _NEG_ZERO
        colsum[j] = v
    return total, total_next


@njit(inline="always")
def _row(a, address, i, j0, n):
    """``a[i, j0:j0+n]`` of a 2-D view with unit-stride rows whose data starts at ``address``
    (:func:`.numeric.array_at`: no reference counted per row)."""
    return array_at(address + i * a.strides[0] + j0 * a.itemsize, n, a.dtype)


@njit(inline="always")
def _prefetch_row(go, gs, go_address, gs_address, i, j0, j1):
    """Start loading columns ``[j0, min(j1, i))`` of row i of go and gs into the level 2 cache (nothing when that
    is empty; :func:`.numeric.prefetch_bytes`: fetched into level 1 as well, they held up the sweep)."""
    if j0 < i < go.shape[0]:
        nbytes = (min(j1, i) - j0) * go.itemsize
        prefetch_bytes(go_address + i * go.strides[0] + j0 * go.itemsize, nbytes, True)
        prefetch_bytes(gs_address + i * gs.strides[0] + j0 * gs.itemsize, nbytes, True)


@njit(inline="always", fastmath=FASTMATH)
def _sweep(go, gs, j0, j1, totals, go_next, gs_next):
    """One problem's rows ``T-1 .. 0`` over the columns ``[j0, j1)``: totals[i] = sum_{j0 <= j < min(j1, i)} of
    the column sums of rows ``>= i`` (go, gs: ``[T, T]`` views with unit-stride rows). Rows go in pairs (one
    sweep of colsum per pair); each pair prefetches the next two rows, in ascending order, of the next problem
    (go_next, gs_next; the split path, whose next task is another column chunk, passes go and gs again)."""
    T = go.shape[0]
    go_address, gs_address = go.ctypes.data, gs.ctypes.data
    next_address, next_gs_address = go_next.ctypes.data, gs_next.ctypes.data
    colsum = np.zeros(j1 - j0, dtype=np.float32)
    i = T - 1
    while i >= 0:
        width = min(j1, i) - j0
        if width <= 0:
            totals[i] = np.float32(0.0)
            i -= 1
            continue
        for r in range(T - 1 - i, T + 1 - i):
            _prefetch_row(go_next, gs_next, next_address, next_gs_address, r, j0, j1)
        padded = min(j1 - j0, (width + _LANES - 1) // _LANES * _LANES)
        width_next = max(min(j1, i - 1) - j0, 0)
        below = max(i - 1, 0)
        totals[i], total_next = _add_product_rows(
            colsum, _row(go, go_address, i, j0, padded), _row(gs, gs_address, i, j0, padded), width,
            _row(go, go_address, below, j0, padded), _row(gs, gs_address, below, j0, padded), width_next)
        if width_next > 0:
            totals[i - 1] = total_next
            i -= 1
        i -= 1


@on_torch_threads
@strided_layout
@njit(parallel=True, fastmath=FASTMATH, cache=True)
def exp_segsum_backward(grad_output, grad_self, splits, grad_input):
    """grad_output, grad_self ``[A, B, C, T, T]`` (unit-stride rows) -> grad_input ``[A, B, C, T]`` (any strides).

    ``splits == 1``: one task per problem writes its gradient row directly (one parallel region).
    """
    A, B, C, T, _ = grad_output.shape
    problems = A * B * C
    if splits == 1:
        for p in prange(problems):
            prefer_512_bit_vectors()
            a, b, c = p // (B * C), (p // C) % B, p % C
            totals = np.empty(T, dtype=np.float32)
            q = min(p + 1, problems - 1)  # the next problem (prefetched at the end of this one)
            _sweep(grad_output[a, b, c], grad_self[a, b, c], 0, T, totals,
                   grad_output[q // (B * C), (q // C) % B, q % C], grad_self[q // (B * C), (q // C) % B, q % C])
            for i in range(T):
                grad_input[a, b, c, i] = narrow(totals[i], grad_input)
    else:
        bounds = column_bounds(T, splits)
        partial = np.empty((splits, problems, T), dtype=np.float32)
        for task in prange(problems * splits):
            prefer_512_bit_vectors()
            p, s = task // splits, task % splits
            a, b, c = p // (B * C), (p // C) % B, p % C
            _sweep(grad_output[a, b, c], grad_self[a, b, c], bounds[s], bounds[s + 1], partial[s, p],
                   grad_output[a, b, c], grad_self[a, b, c])
        for p in prange(problems):
            a, b, c = p // (B * C), (p // C) % B, p % C
            for i in range(T):
                total = partial[0, p, i]
                for s in range(1, splits):
                    total += partial[s, p, i]
                grad_input[a, b, c, i] = narrow(total, grad_input)
