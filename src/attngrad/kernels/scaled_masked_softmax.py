"""Fused CPU kernels for ScaledMaskedSoftmax and its backward, at memory bandwidth.

Contract: data ``[B, N, S1, S2]`` (float32 as float32, bfloat16 as uint16, float16 as int16 kernel views, see
:mod:`.tensor_view`; any strides), mask ``[Bm, Nm, S1, S2]`` uint8 with ``Bm in {1, B}``, ``Nm in {1, N}``
(CANN's broadcast on dims 0 and 1). Forward ``y = softmax(where(mask, -10000, x * scale))`` per row, backward
``where(mask, 0, (dy - sum(dy * y)) * y * scale)``; fp32 math, one rounding to the output type, half to even
(docs/cann-semantics.md, 'ScaledMaskedSoftmax'). Memory: a few rows of scratch per task, nothing per element.

Layouts: every loop reads an input or mask row through a C-contiguous 1-D view made from the row's address
(:func:`_row_view`; a row whose last dim is not unit-stride is first copied to a scratch row), and writes the output
row by address (:func:`_put_row`). So the kernels are compiled once per dtype combination, with every array typed
as any-strided (:func:`.layouts.launch_workers`), and a strided call gives the same bits as a contiguous one.

Rows are independent; each thread runs a worker (:func:`_forward_worker`, :func:`_backward_worker`, compiled on
its own and called by address) that claims fixed blocks of ``_ROWS_PER_TASK`` rows (:func:`.threads.claim`), so
every row is computed by the same instructions for any thread count (bit-identical results). Each row is read from
memory once and written once:

* within a block the rows are software-pipelined, so the memory streams run while the core computes: the
  backward reads row ``k + 1`` in the loop that computes row ``k``; the forward reads row ``k + 1``, computes row
  ``k`` (exp) and writes row ``k - 1`` in one loop with AVX-512 (:func:`_pipelined_loop`), in one loop per stage
  with AVX2 (``_ONE_LOOP_STAGES``), while the row after next is prefetched;
* a row is rounded into a row buffer (on cache lines: ``numeric.aligned_empty``) and copied out, by non-temporal
  stores when the output is large (:func:`.numeric.streams`);
* the forward prefetches the input row after next into the level 2 cache, because the hardware prefetchers stop
  at every 4 KiB page (:func:`_forward_block`); float32 rows in two halves, bf16/fp16 rows (half as long,
  compute-bound) at once;
* the bf16/fp16 forward is compute-bound, so its row loop is kept short: ``exp_nonpositive`` (no overflow
  clamp, 2**n built from the rounding of the argument reduction, a degree-4 polynomial for bf16/fp16 outputs),
  a one-``vmaxps`` row max (``numeric.fmax_any_nan``), the fp16 scaling as one float16 multiply with
  AVX512-FP16, else by the float16 conversions or by ``numeric.float16_grid`` without conversions, whichever this
  machine runs faster (a grid row whose max says that a product may have overflowed is loaded again by
  conversions: :func:`_checked_top`), and bf16
  rounding by ``narrow_fast`` (the one-instruction ``narrow_ftz`` with AVX512-BF16, else the integer rounding
  without its nan test) when it is exact for the row: no output is a nan (a row of nans has a nan sum) and, with
  ``narrow_ftz``, none is a float32 subnormal (the exp loop tracks the row's smallest positive exp for that test,
  two integer operations per vector);
* the backward rounds bf16 by ``narrow_finite`` and sums each output row on the way (one add per vector,
  ``numeric.track_nan``): a nan sum sends the row through the exact rounding again.

Measurements behind these choices: docs/performance.md, 'Kernel measurements'.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .gemm_paths import GRID, float16_scaling
from .layouts import launch_workers
from .numeric import (FASTMATH, FLOAT16_GRID_LIMIT, HAS_AVX512_FP16, HAS_AVX512F, NO_POSITIVE, aligned_empty,
                      array_at, copy_row, exp_nonpositive, float16_grid, float16_rounded, fmax_any_nan, narrow,
                      narrow_fast, narrow_finite, narrow_ftz_exact, ordered_mul, prefer_512_bit_vectors, prefetch_bytes,
                      row_address, row_view, stream_fence, track_flushable, track_nan, unowned, widen)
from .threads import call_native, claim, on_torch_threads

MASK_VALUE = np.float32(-10000.0)  # CANN fills masked logits with -10000, not -inf
_ROWS_PER_TASK = 64
# The forward's three row stages in one loop (:func:`_pipelined_loop`) on targets with AVX-512's 32 vector
# registers; with AVX2's 16 that loop reloads its constants from memory on every pass and three loops, one per
# stage, are faster (docs/performance.md, 'What limits each operator')
_ONE_LOOP_STAGES = HAS_AVX512F


@intrinsic
def _f16_mul(typingctx, h, s):
    """float16 bits (int16) times a float16-representable float32, rounded to float16, widened to float32:
    a float16 ``fmul`` (``vmulph`` with AVX512-FP16, else LLVM computes it in float32 and rounds: the product
    of two float16 values is exact in float32, so both round the exact product once)."""
    if h != types.int16 or s != types.float32:
        return None

    def codegen(context, builder, sig, args):
        half = ir.HalfType()
        prod = builder.fmul(builder.bitcast(args[0], half), builder.fptrunc(args[1], half))
        return builder.fpext(prod, ir.FloatType())

    return types.float32(h, s), codegen


# How the forward scales the logits: a marker whose numba type selects the code at compile time (one
# specialisation each). In float32 for every dtype but CANN's float16 path, which rounds x * scale to float16: by
# numeric.float16_grid or by the float16 conversions, whichever this machine runs faster
# (gemm_paths.float16_scaling; with AVX512-FP16 both are one float16 multiply)
FLOAT32_SCALING = np.bool_(False)
GRID_SCALING = np.uint8(0)
CONVERTED_SCALING = np.int8(0)


def _rounds_on_grid(dtype, scaling) -> bool:
    """Whether float16 logits (``dtype`` int16) with the ``scaling`` marker's type are rounded by
    ``numeric.float16_grid`` (at compile time; with AVX512-FP16 never: one float16 multiply)."""
    return dtype == types.int16 and scaling == types.uint8 and not HAS_AVX512_FP16


def _scaled_logit(x, scale, scaling):  # pragma: no cover - compiled through the overload below
    """x * scale as float32. For float16 x (int16 bits) with a rounding marker, the product rounded to float16 (one
    rounding: the product of two float16 values is exact in float32): one float16 multiply with AVX512-FP16, else
    ``numeric.float16_grid`` for ``GRID_SCALING`` (an overflow stays finite: :func:`_checked_top`) or the float16
    conversions for ``CONVERTED_SCALING``. ``FLOAT32_SCALING`` and the other dtypes: the plain float32 product. No
    function call: it sits in the row loops, which LLVM vectorises only around inlined code."""
    raise NotImplementedError


@overload(_scaled_logit, inline="always")
def _scaled_logit_impl(x, scale, scaling):
    if x != types.int16 or scaling == types.boolean:
        return lambda x, scale, scaling: widen(x) * scale
    if _rounds_on_grid(x, scaling):
        return lambda x, scale, scaling: float16_grid(widen(x) * scale)
    if HAS_AVX512_FP16:
        return lambda x, scale, scaling: _f16_mul(x, scale)
    return lambda x, scale, scaling: float16_rounded(widen(x) * scale)


def scaling_of(rounded: bool):
    """The scaling marker of a forward call: ``FLOAT32_SCALING``, or with ``rounded`` (CANN's fp16 path) the
    float16 rounding this machine runs faster (:func:`.gemm_paths.float16_scaling`, measured once)."""
    if not rounded:
        return FLOAT32_SCALING
    return GRID_SCALING if float16_scaling() == GRID else CONVERTED_SCALING


def _on_grid(x, scaling):  # pragma: no cover - compiled through the overload below
    """Whether :func:`_scaled_logit` rounds the elements of array x by ``numeric.float16_grid``, as a compile-time
    constant."""
    raise NotImplementedError


@overload(_on_grid, inline="always")
def _on_grid_impl(x, scaling):
    grid = _rounds_on_grid(x.dtype, scaling)
    return lambda x, scaling: grid


# float16_grid leaves a logit that overflows float16 finite (at most -65536 where float16 has -inf): with the row
# max at least 88 above that, its exp is 0 either way (numeric.exp_nonpositive), and no logit overflowed upwards
_GRID_TOP_LOW = np.float32(-65536.0 + 88.0)


@intrinsic
def _fill_where(typingctx, masked, fill, v):
    """``fill if masked else v`` for a uint8 mask element and float32 values, as one LLVM ``select``. The Python
    conditional in the backward's fused row loop becomes a branch around v's loads, and LLVM then leaves the
    loop scalar for bf16 / fp16 (seen on AVX2: 6x slower)."""
    if not isinstance(masked, types.Integer) or fill != types.float32 or v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        is_masked = builder.icmp_unsigned("!=", args[0], ir.Constant(args[0].type, 0))
        return builder.select(is_masked, args[1], args[2])

    return types.float32(masked, fill, v), codegen


@njit(inline="always")
def _row_of(b, n, s, mask):
    """(b, n, s) of the data -> the row: (b, n, s) and (bm, nm) of the (broadcast) mask."""
    return b, n, s, b if mask.shape[0] > 1 else 0, n if mask.shape[1] > 1 else 0


@njit(inline="always")
def _row(r, N, S1, mask):
    """Row number -> its row (:func:`_row_of`): three integer divisions, so taken once per block."""
    return _row_of(r // (N * S1), (r // S1) % N, r % S1, mask)


@njit(inline="always")
def _next_row(b, n, s, N, S1):
    """(b, n, s) of the row after (b, n, s)."""
    s += 1
    if s == S1:
        s = 0
        n += 1
        if n == N:
            n = 0
            b += 1
    return b, n, s


@njit(inline="always")
def _scratch_rows(count, a):
    """Room for ``count`` rows of a 4-D array ``a`` of any kernel element type (4 bytes or less), for
    :func:`_row_view`; slot k is at :func:`_slot` (scratch, k)."""
    return aligned_empty((count, a.shape[3]), np.float32)


@njit(inline="always")
def _slot(scratch, k):
    """Address of row k of a :func:`_scratch_rows` array."""
    return scratch.ctypes.data + k * scratch.strides[0]


@njit(inline="always")
def _row_view(a, b, n, s, slot):
    """a[b, n, s, :] as a C-contiguous 1-D array: the row in place where a's last dim is unit-stride
    (:func:`.numeric.row_view`), else its elements copied to the address ``slot`` (room for a row)."""
    if a.strides[3] == a.itemsize:
        return row_view(a, b, n, s)
    gathered = array_at(slot, a.shape[3], a.dtype)
    for j in range(a.shape[3]):
        gathered[j] = a[b, n, s, j]
    return gathered


@njit(inline="always")
def _logit_rows(x, mask, row, scratch):
    """The x and mask rows of ``row`` (:func:`_row_of`) as :func:`_row_view` s, in slots 0 and 1 of scratch."""
    b, n, s, bm, nm = row
    return _row_view(x, b, n, s, _slot(scratch, 0)), _row_view(mask, bm, nm, s, _slot(scratch, 1))


@njit(inline="always", fastmath=FASTMATH)
def _logit(xr, mr, j, scale, scaling):
    """where(mask, -10000, x * scale) in fp32 at column j of the rows xr, mr, x * scale by :func:`_scaled_logit`
    (CANN's fp16 path rounds it to fp16 first)."""
    return MASK_VALUE if mr[j] else _scaled_logit(xr[j], scale, scaling)


@njit(inline="always", fastmath=FASTMATH)
def _load_row(xr, mr, scale, scaling, bufs, k):
    """bufs[k] = logits of the rows xr, mr (:func:`_logit`); returns their max."""
    top = np.float32(-np.inf)
    for j in range(bufs.shape[1]):
        z = _logit(xr, mr, j, scale, scaling)
        bufs[k, j] = z
        top = fmax_any_nan(top, z)
    return top


@njit(inline="always", fastmath=FASTMATH)
def _load_checked_row(xr, mr, scale, scaling, bufs, k):
    """:func:`_load_row` with :func:`_checked_top`: bufs[k] = the logits; returns their max."""
    top = _load_row(xr, mr, scale, scaling, bufs, k)
    return _checked_top(top, xr, mr, scale, scaling, bufs, k)


@njit(inline="always", fastmath=FASTMATH)
def _checked_top(top, xr, mr, scale, scaling, bufs, k):
    """``top``, the max of the logits in bufs[k] (rows xr, mr), or, where float16 products rounded by
    ``numeric.float16_grid`` may have overflowed in a way that changes the row (the max outside
    [``_GRID_TOP_LOW``, ``FLOAT16_GRID_LIMIT``), or a nan), the max of the row loaded again by the float16
    conversions."""
    if _on_grid(xr, scaling) and not _GRID_TOP_LOW <= top < FLOAT16_GRID_LIMIT:
        return _load_row(xr, mr, scale, CONVERTED_SCALING, bufs, k)
    return top


@njit(inline="always", fastmath=FASTMATH)
def _exp_row(bufs, k, top, y):
    """bufs[k] = exp(bufs[k] - top) in place (as precise as y's element type needs); returns the sum and the
    :func:`.numeric.track_flushable` of the exps."""
    total = np.float32(0.0)
    tiny = NO_POSITIVE
    for j in range(bufs.shape[1]):
        e = exp_nonpositive(bufs[k, j] - top, y)
        bufs[k, j] = e
        total += e
        tiny = track_flushable(tiny, e, y)
    return total, tiny


@njit(inline="always")
def _put_row(y, y_address, row, out, out_address, stream):
    """y's row = out (a row of y's element type; ``y_address`` / ``out_address``: their data addresses, taken
    once per task): one copy, by non-temporal stores with ``stream`` (:func:`.numeric.copy_row`) where y's rows
    are contiguous. No array view is made per row: taking one is an atomic reference count, and an atomic
    waits for the row's non-temporal stores to drain."""
    b, n, s, _, _ = row
    if y.strides[3] == y.itemsize:
        address = y_address + b * y.strides[0] + n * y.strides[1] + s * y.strides[2]
        copy_row(address, out_address, out.size * y.itemsize, stream)
    else:
        for j in range(out.size):
            y[b, n, s, j] = out[j]


@njit(inline="always")
def _prefetch_columns(x, mask, row, valid, j0, j1):
    """Start loading columns [j0, j1) of ``row`` (when ``valid``) of x and of the mask into the level 2 cache
    (:func:`.numeric.prefetch_bytes`; fetched into level 1 as well, they held up the row loop)."""
    if valid and x.strides[3] == x.itemsize:
        b, n, s, bm, nm = row
        prefetch_bytes(row_address(x, b, n, s) + j0 * x.itemsize, (j1 - j0) * x.itemsize, True)
        if mask.strides[3] == 1:
            prefetch_bytes(row_address(mask, bm, nm, s) + j0, j1 - j0, True)


@njit(inline="always", fastmath=FASTMATH)
def _round_row(bufs, k, inv, out, y, fast):
    """out = bufs[k] * inv rounded to y's element type (by ``narrow_fast`` when ``fast``: :func:`_fast_exact`)."""
    if fast:
        for j in range(out.size):
            out[j] = narrow_fast(bufs[k, j] * inv, y)
    else:
        for j in range(out.size):
            out[j] = narrow(bufs[k, j] * inv, y)


@njit(inline="always", fastmath=FASTMATH)
def _pipelined_row(xr, mr, scale, scaling, bufs, stages, top, inv, out, y, fast):
    """:func:`_pipelined_loop` rounding by ``narrow_fast`` when ``fast`` (:func:`_fast_exact`), else by ``narrow``:
    the loop is compiled once per rounding."""
    if fast:
        return _pipelined_loop(narrow_fast, xr, mr, scale, scaling, bufs, stages, top, inv, out, y)
    return _pipelined_loop(narrow, xr, mr, scale, scaling, bufs, stages, top, inv, out, y)


@njit(inline="always", fastmath=FASTMATH)
def _pipelined_loop(rounding, xr, mr, scale, scaling, bufs, stages, top, inv, out, y):
    """The three pipeline stages in one loop, ``stages = (cur, nxt, prv)`` rows of ``bufs``: out = bufs[prv] * inv
    rounded by ``rounding``, bufs[nxt] = logits of the next row (its x and mask rows xr, mr),
    bufs[cur] = exp(bufs[cur] - top). Returns the sum and
    :func:`.numeric.track_flushable` of the exps and the max of the logits. (The index is unsigned, so numba emits
    no negative-index wraparound in the loop.)"""
    cur, nxt, prv = stages
    total = np.float32(0.0)
    tiny = NO_POSITIVE
    top_next = np.float32(-np.inf)
    for j in range(np.uint64(bufs.shape[1])):
        out[j] = rounding(bufs[prv, j] * inv, y)
        z = _logit(xr, mr, j, scale, scaling)
        bufs[nxt, j] = z
        top_next = fmax_any_nan(top_next, z)
        e = exp_nonpositive(bufs[cur, j] - top, y)
        bufs[cur, j] = e
        total += e
        tiny = track_flushable(tiny, e, y)
    return total, top_next, tiny


@njit(inline="always")
def _fast_exact(tiny, inv):
    """Whether ``narrow_fast(e * inv)`` gives ``narrow``'s bits for every exp e of a row (``tiny``: their
    :func:`.numeric.track_flushable`, ``inv``: 1 / their sum). A nan logit, a +inf one or a row of -inf ones make
    the sum a nan; otherwise every e lies in [0, 1] and the sum is at least 1, so no output is a nan."""
    return inv == inv and narrow_ftz_exact(tiny, inv)


@njit(fastmath=FASTMATH, cache=True)
def _forward_block(x, mask, scale, scaling, y, first, last, bufs, out, scratch, stream):
    """Softmax of rows [first, last): three fp32 row buffers ``bufs[0..2]`` rotate (loaded, exponentiated,
    stored); a stored row is rounded into ``out`` and copied to y (:func:`_put_row`). x and the mask are read
    through row views (:func:`_logit_rows`, ``scratch``: two :func:`_scratch_rows`). The rows r - 1 .. r + 1 in
    flight are (b0, n0, s0) .. (b2, n2, s2), advanced by :func:`_next_row`. The row after next is prefetched: a
    float32 row of 1024 is one 4 KiB page, where the hardware prefetchers stop, so without it each row would start
    with a cold stream. Its (b, n, s) come from r by :func:`_row`, which was faster than carrying them through the
    loop as a fourth row (docs/performance.md, 'The prefetched row's index'). Compiled on its own and called by
    the worker, not inlined into it, which numba compiles slowly for a body this large (docs/performance.md, 'Test
    suite time')."""
    prefer_512_bit_vectors()
    # views that count no references: passing the arguments on took atomic counts per row on counters the threads
    # share (docs/performance.md, 'Reference counts in the softmax rows')
    x, mask, y = unowned(x), unowned(mask), unowned(y)
    N, S1, S2 = x.shape[1], x.shape[2], x.shape[3]
    y_address, out_address = y.ctypes.data, out.ctypes.data
    b1, n1, s1, _, _ = _row(first, N, S1, mask)
    b0, n0, s0 = b1, n1, s1
    b2, n2, s2 = _next_row(b1, n1, s1, N, S1)
    xr, mr = _logit_rows(x, mask, _row_of(b1, n1, s1, mask), scratch)
    top_next = _load_checked_row(xr, mr, scale, scaling, bufs, 0)
    inv = np.float32(0.0)
    fast = True
    for r in range(first, last):
        cur, nxt, prv = (r - first) % 3, (r - first + 1) % 3, (r - first + 2) % 3
        top = top_next
        top_next = np.float32(-np.inf)
        row_nxt, row_after = _row_of(b2, n2, s2, mask), _row(r + 2, N, S1, mask)
        # float32: row r + 2 in two halves, around this row's loads; the whole row at once (80 lines with its
        # mask) held up those loads
        split = S2 // 2 if x.itemsize == 4 else S2
        _prefetch_columns(x, mask, row_after, r + 2 < last, 0, split)
        if _ONE_LOOP_STAGES and r > first and r + 1 < last:
            xr, mr = _logit_rows(x, mask, row_nxt, scratch)
            total, top_next, tiny = _pipelined_row(xr, mr, scale, scaling, bufs, (cur, nxt, prv), top, inv,
                                                   out, y, fast)
            top_next = _checked_top(top_next, xr, mr, scale, scaling, bufs, nxt)
            _prefetch_columns(x, mask, row_after, r + 2 < last, split, S2)
        else:  # the three stages one after the other (always the block's first and last rows)
            if r > first:
                _round_row(bufs, prv, inv, out, y, fast)
            if r + 1 < last:
                xr, mr = _logit_rows(x, mask, row_nxt, scratch)
                top_next = _load_checked_row(xr, mr, scale, scaling, bufs, nxt)
            _prefetch_columns(x, mask, row_after, r + 2 < last, split, S2)
            total, tiny = _exp_row(bufs, cur, top, y)
        if r > first:
            _put_row(y, y_address, _row_of(b0, n0, s0, mask), out, out_address, stream)
        inv = np.float32(1.0) / total
        fast = _fast_exact(tiny, inv)
        b0, n0, s0 = b1, n1, s1
        b1, n1, s1 = b2, n2, s2
        b2, n2, s2 = _next_row(b2, n2, s2, N, S1)
    _round_row(bufs, (last - 1 - first) % 3, inv, out, y, fast)
    _put_row(y, y_address, _row_of(b0, n0, s0, mask), out, out_address, stream)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _forward_kernel(worker, x, mask, scale, scaling, stream, y, next_block, workers):
    """Runs :func:`_forward_worker` (at address ``worker``) with these arguments on ``workers`` threads at once
    (:func:`.layouts.launch_workers`)."""
    for _ in prange(workers):
        call_native(worker, (x, mask, scale, scaling, stream, y, next_block))


@njit(fastmath=FASTMATH, cache=True)
def _forward_worker(x, mask, scale, scaling, stream, y, next_block):
    """One thread of the forward: the blocks of ``_ROWS_PER_TASK`` rows it claims from ``next_block``
    (:func:`.threads.claim`), each by :func:`_forward_block` with this thread's row buffers."""
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    bufs = aligned_empty((3, x.shape[3]), np.float32)
    out = aligned_empty((x.shape[3],), y.dtype)
    scratch = _scratch_rows(2, x)
    first = claim(next_block) * _ROWS_PER_TASK
    while first < rows:
        _forward_block(x, mask, scale, scaling, y, first, min(rows, first + _ROWS_PER_TASK), bufs, out, scratch,
                       stream)
        first = claim(next_block) * _ROWS_PER_TASK
    if stream:
        stream_fence()


@on_torch_threads
def scaled_masked_softmax_forward(x, mask, scale, scaling, stream, y):
    """y = softmax(where(mask, -10000, x * scale)) over the last axis, fp32 math.

    ``scaling``: ``FLOAT32_SCALING``, or for CANN's fp16 path, which scales in fp16, ``GRID_SCALING`` or
    ``CONVERTED_SCALING`` (``x * scale`` rounded to float16, the same values by two codes; ``scale`` is then already
    the fp16-rounded value). ``stream``: y is written by non-temporal stores (:func:`.numeric.streams`).
    """
    launch_workers(_forward_kernel, _forward_worker, x, mask, scale, scaling, stream, y)


@njit(inline="always")
def _gradient_rows(grad_output, y, b, n, s, scratch, k):
    """The grad_output and y rows (b, n, s) as :func:`_row_view` s, in slots 2k and 2k + 1 of scratch (k = 0, 1:
    the rows r and r + 1 of :func:`_backward_block` alternate)."""
    return (_row_view(grad_output, b, n, s, _slot(scratch, 2 * k)),
            _row_view(y, b, n, s, _slot(scratch, 2 * k + 1)))


@njit(inline="always", fastmath=FASTMATH)
def _row_dot(gr, yr):
    acc = np.float32(0.0)
    for j in range(gr.size):
        acc += widen(gr[j]) * widen(yr[j])
    return acc


@njit(inline="always", fastmath=FASTMATH)
def _grad(gr, yr, mr, j, acc, scale):
    """CANN's ``((dy - acc) * y) * scale`` in that order (y * scale first could underflow to 0, or give
    inf * 0 = nan where dy is infinite), or 0 where masked."""
    g = ordered_mul(widen(gr[j]) - acc, widen(yr[j])) * scale
    return _fill_where(mr[j], np.float32(0.0), g)


@njit(inline="always", fastmath=FASTMATH)
def _put_grad(gr, yr, mr, j, acc, scale, row_out, probe):
    """row_out[j] = the gradient at column j rounded by ``narrow_finite``; returns ``probe`` with it tracked
    (:func:`.numeric.track_nan`)."""
    g = _grad(gr, yr, mr, j, acc, scale)
    row_out[j] = narrow_finite(g, row_out)
    return track_nan(probe, g, row_out)


@njit(fastmath=FASTMATH, cache=True)
def _backward_block(grad_output, y, mask, scale, out, first, last, row_out, scratch, stream):
    """Gradient of rows [first, last): the row sum of row r + 1 is taken while row r is rounded into
    ``row_out`` (by ``narrow_finite``, again by ``narrow`` when the row's sum of gradients is a nan), then copied
    to out (:func:`_put_row`). The inputs are read through row views (:func:`_row_view`,
    ``scratch``: five :func:`_scratch_rows`, the mask's in slot 4). Compiled on its own, as :func:`_forward_block`."""
    prefer_512_bit_vectors()
    grad_output, y, mask, out = unowned(grad_output), unowned(y), unowned(mask), unowned(out)  # as in _forward_block
    N, S1, S2 = grad_output.shape[1], grad_output.shape[2], grad_output.shape[3]
    out_address, row_out_address = out.ctypes.data, row_out.ctypes.data
    b, n, s, _, _ = _row(first, N, S1, mask)
    gr, yr = _gradient_rows(grad_output, y, b, n, s, scratch, 0)
    acc_next = _row_dot(gr, yr)
    for r in range(first, last):
        acc = acc_next
        row = _row_of(b, n, s, mask)
        mr = _row_view(mask, row[3], row[4], s, _slot(scratch, 4))
        b1, n1, s1 = _next_row(b, n, s, N, S1)
        probe = np.float32(0.0)
        if r + 1 < last:
            gr1, yr1 = _gradient_rows(grad_output, y, b1, n1, s1, scratch, (r + 1 - first) % 2)
            acc_next = np.float32(0.0)
            for j in range(S2):
                acc_next += widen(gr1[j]) * widen(yr1[j])
                probe = _put_grad(gr, yr, mr, j, acc, scale, row_out, probe)
        else:
            for j in range(S2):
                probe = _put_grad(gr, yr, mr, j, acc, scale, row_out, probe)
        if probe != probe:  # a nan among the bf16 gradients (or inf - inf in their sum): round the row exactly
            for j in range(S2):
                row_out[j] = narrow(_grad(gr, yr, mr, j, acc, scale), out)
        if r + 1 < last:
            gr, yr = gr1, yr1
        _put_row(out, out_address, row, row_out, row_out_address, stream)
        b, n, s = b1, n1, s1


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _backward_kernel(worker, grad_output, y, mask, scale, stream, out, next_block, workers):
    """Runs :func:`_backward_worker` (at address ``worker``) with these arguments on ``workers`` threads at once
    (:func:`.layouts.launch_workers`)."""
    for _ in prange(workers):
        call_native(worker, (grad_output, y, mask, scale, stream, out, next_block))


@njit(fastmath=FASTMATH, cache=True)
def _backward_worker(grad_output, y, mask, scale, stream, out, next_block):
    """One thread of the backward: the blocks of ``_ROWS_PER_TASK`` rows it claims from ``next_block``
    (:func:`.threads.claim`), each by :func:`_backward_block` with this thread's row buffers."""
    rows = grad_output.shape[0] * grad_output.shape[1] * grad_output.shape[2]
    row_out = aligned_empty((out.shape[3],), out.dtype)
    scratch = _scratch_rows(5, grad_output)
    first = claim(next_block) * _ROWS_PER_TASK
    while first < rows:
        _backward_block(grad_output, y, mask, scale, out, first, min(rows, first + _ROWS_PER_TASK), row_out, scratch,
                        stream)
        first = claim(next_block) * _ROWS_PER_TASK
    if stream:
        stream_fence()


@on_torch_threads
def scaled_masked_softmax_backward(grad_output, y, mask, scale, stream, out):
    """out = where(mask, 0, (dy - sum(dy * y)) * y * scale); the row sum runs over ALL positions. ``stream``:
    out is written by non-temporal stores (:func:`.numeric.streams`)."""
    launch_workers(_backward_kernel, _backward_worker, grad_output, y, mask, scale, stream, out)
