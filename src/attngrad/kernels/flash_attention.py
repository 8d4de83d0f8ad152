"""Fused, tiled CPU kernels of FlashAttentionScore (forward) and FlashAttentionScoreGrad (backward). BNSD.

Shapes: q ``[B, N1, Sq, D]``, k ``[B, N2, Skv, D]``, v ``[B, N2, Skv, Dv]``, dy / out ``[B, N1, Sq, Dv]``
(one float dtype: float32, float16 or bfloat16; any strides), softmax_max / softmax_sum ``[B, N1, Sq]``
float32. Query head n reads kv head ``n // G`` with ``G = N1 // N2``. The math is the spec's section 0:

* logits ``S = QK^T * scale`` in fp32 (the GEMMs of :mod:`.gemm` keep fp32 output for bf16/fp16 inputs),
  excluded positions (atten_mask nonzero, or key outside the left-up band ``i - pre <= j <= i + next``)
  get ``-FLT_MAX``;
* forward: online softmax over key blocks; ``P = exp(S - m)`` rounded to the input dtype before
  ``P V``; ``out = acc / l``; ``softmax_max = m``, ``softmax_sum = l = sum exp(S - m)``;
* backward with the GIVEN stats and out: ``P = exp(S - m) / l``, ``Dr = rowsum(dy * out)``,
  ``dS = P (dP - Dr)`` with ``dP = dy V^T`` in fp32; P and dS are rounded to the input dtype before
  the dV, dQ and dK GEMMs (CANN casts); fp32 accumulation; ``dq = scale * dS K``,
  ``dk = scale * dS^T Q`` and ``dv = P^T dy`` summed over the G query heads of a kv head; outputs
  rounded once (half to even).

Tiles and work split (both cores busy even for one head, results identical for any thread count):

* forward: one task per (b, n1, query block); each task owns its rows, no reduction.
* backward: one task per (b, n2, key chunk); a chunk is a fixed (shape-derived, thread-count
  independent) range of key blocks. A task owns dK/dV of its key blocks (fp32 tile accumulators over
  the G heads and all query blocks, in a fixed order) and adds its dQ contribution into its own fp32
  slice ``dq_acc[chunk]``; the slices are summed in chunk order at the end.

Extra memory: per task a few [BQ, BK] tiles plus the fp32 dQ slices (``chunks * B*N1*Sq*D``): O(S*D),
never an [Sq, Skv] tensor.

Tile classification (``_tile_kind``): a tile entirely outside the band is skipped; a tile entirely
inside it and without atten_mask takes the fast path without per-element tests; the others go through
``_modify_scores``, the per-row "score modifier" where pse / dropout of later issues plug in.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, set_parallel_chunksize

from .flash_attention_plan import MASKED_LOGIT, AttentionPlan
from .gemm import NO_TRANS, TRANS, gemm
from .numeric import FASTMATH, exp32, narrow, widen
from .tensor_view import kernel_view

_NEG = np.float32(MASKED_LOGIT)
_FLT_MAX = np.float32(-MASKED_LOGIT)
_BQ = 256  # query rows of a tile
_BK = 256  # key columns of a tile
_FWD_BK = 512  # key columns of a forward tile (fewer online-softmax rescales of the accumulator)
_LANES = 16  # independent partial maxima of a row
_TARGET_TASKS = 8  # the backward splits keys into chunks until B*N2*chunks reaches this (when it can)
_OUTSIDE, _INSIDE, _PARTIAL = 0, 1, 2

_KERNEL = dict(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)


@njit(inline="always")
def _tile_kind(i0, rows, j0, cols, pre, nxt):
    """Where the tile [i0, i0+rows) x [j0, j0+cols) lies relative to the band i - pre <= j <= i + nxt."""
    i1 = i0 + rows - 1
    j1 = j0 + cols - 1
    if j0 > i1 + nxt or j1 < i0 - pre:
        return _OUTSIDE
    if j0 >= i1 - pre and j1 <= i0 + nxt:
        return _INSIDE
    return _PARTIAL


@njit(inline="always", fastmath=FASTMATH)
def _modify_scores(s, r, cols, scale, i, j0, general, mask, bm, nm, has_mask, pre, nxt):
    """Score modifier of row r of a tile (query i, keys j0..j0+cols): raw QK^T -> logit, in place.

    ``S = QK^T * scale``; keys outside the band or set in atten_mask get -FLT_MAX. ``general`` False
    (tile inside the band, no mask) skips the tests. pse / dropout of later issues plug in here.
    """
    lo, hi = 0, cols
    if general:
        lo = min(max(i - pre - j0, 0), cols)
        hi = max(min(i + nxt - j0 + 1, cols), 0)
    for c in range(cols):
        z = s[r, c] * scale
        s[r, c] = z if (c >= lo) & (c < hi) else _NEG
    if has_mask:
        for c in range(cols):
            if mask[bm, nm, i, j0 + c] != 0:
                s[r, c] = _NEG


@njit(inline="always")
def _ptr(a, i0, i1, i2):
    """Address of a[i0, i1, i2, 0] of a C-contiguous 4-D array."""
    return a.ctypes.data + ((i0 * a.shape[1] + i1) * a.shape[2] + i2) * a.shape[3] * a.itemsize


@njit(inline="always")
def _dead_row(smax, b, n, i0, rows):
    """True when a row of the block has the max of a fully masked row: exp(S - max) is then not 0 outside."""
    for r in range(rows):
        if not smax[b, n, i0 + r] > _NEG:
            return True
    return False


@njit(inline="always", fastmath=FASTMATH)
def _row_max(s, r, cols, lanes):
    """max of s[r, :cols] (nan-free rows) through 16 independent lanes, which vectorise (a plain max
    reduction does not without the no-nan fastmath flag). A nan row is caught later by its nan sum."""
    lanes[:] = -np.inf
    full = cols - cols % _LANES
    for c0 in range(0, full, _LANES):
        for t in range(_LANES):
            x = s[r, c0 + t]
            lanes[t] = x if x > lanes[t] else lanes[t]
    top = np.float32(-np.inf)
    for c in range(full, cols):
        top = max(top, s[r, c])
    for t in range(_LANES):
        top = max(top, lanes[t])
    return top


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _forward_tile(s, p, acc, m, l, rows, cols, general, mask, bm, nm, i0, j0, has_mask, scale, pre, nxt):
    """Online-softmax update of one tile: s holds QK^T, gets the logits; p gets exp(S - m_new)."""
    dv = acc.shape[1]
    lanes = np.empty(_LANES, np.float32)
    for r in range(rows):
        i = i0 + r
        _modify_scores(s, r, cols, scale, i, j0, general, mask, bm, nm, has_mask, pre, nxt)
        new = max(m[r], _row_max(s, r, cols, lanes))
        alpha = exp32(m[r] - new)
        total = np.float32(0.0)
        for c in range(cols):
            e = exp32(s[r, c] - new)
            p[r, c] = narrow(e, p)
            total += e
        l[r] = l[r] * alpha + total
        m[r] = new
        for d in range(dv):
            acc[r, d] *= alpha


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _forward_block(q, k, v, b, n, i0, rows, mask, has_mask, scale, pre, nxt, allow_skip, s, p, acc, m, l):
    """One query block over all key blocks; returns True when a tile outside the band was skipped."""
    n2 = n // (q.shape[1] // k.shape[1])
    D, Skv, Dv = q.shape[3], k.shape[2], v.shape[3]
    BK = s.shape[1]
    bm = b if mask.shape[0] > 1 else 0
    nm = n if mask.shape[1] > 1 else 0
    m[:] = -np.inf
    l[:] = 0.0
    acc[:] = 0.0
    skipped = False
    for j0 in range(0, Skv, BK):
        cols = min(BK, Skv - j0)
        kind = _tile_kind(i0, rows, j0, cols, pre, nxt)
        if kind == _OUTSIDE and allow_skip:
            skipped = True
            continue
        gemm(q, NO_TRANS, TRANS, rows, cols, D, 1.0, _ptr(q, b, n, i0), D, _ptr(k, b, n2, j0), D,
             0.0, s.ctypes.data, BK)
        general = has_mask or kind != _INSIDE
        _forward_tile(s, p, acc, m, l, rows, cols, general, mask, bm, nm, i0, j0, has_mask, scale, pre, nxt)
        gemm(q, NO_TRANS, NO_TRANS, rows, Dv, cols, 1.0, p.ctypes.data, BK, _ptr(v, b, n2, j0), Dv,
             1.0, acc.ctypes.data, Dv)
    return skipped


@njit(**_KERNEL)
def _forward_kernel(q, k, v, mask, has_mask, scale, pre, nxt, invalid_rows, out, smax, ssum):
    B, N1, Sq, _ = q.shape
    Dv = v.shape[3]
    nqb = (Sq + _BQ - 1) // _BQ
    for task in prange(B * N1 * nqb):
        b = task // (N1 * nqb)
        n = (task // nqb) % N1
        i0 = (task % nqb) * _BQ
        rows = min(_BQ, Sq - i0)
        s = np.empty((_BQ, _FWD_BK), np.float32)
        p = np.empty((_BQ, _FWD_BK), q.dtype)
        acc = np.empty((_BQ, Dv), np.float32)
        m = np.empty(_BQ, np.float32)
        l = np.empty(_BQ, np.float32)
        if (_forward_block(q, k, v, b, n, i0, rows, mask, has_mask, scale, pre, nxt, True, s, p, acc, m, l)
                and not invalid_rows):
            for r in range(rows):  # a fully masked row sums exp(0) over ALL keys: redo without skipping
                if not m[r] > _NEG:
                    _forward_block(q, k, v, b, n, i0, rows, mask, has_mask, scale, pre, nxt, False,
                                   s, p, acc, m, l)
                    break
        for r in range(rows):
            dead = not m[r] > _NEG
            if dead and invalid_rows:
                smax[b, n, i0 + r] = _NEG
                ssum[b, n, i0 + r] = _FLT_MAX
                for d in range(Dv):
                    out[b, n, i0 + r, d] = narrow(np.float32(0.0), out)
                continue
            smax[b, n, i0 + r] = m[r]
            ssum[b, n, i0 + r] = l[r]
            inv = np.float32(1.0) / l[r]
            for d in range(Dv):
                out[b, n, i0 + r, d] = narrow(acc[r, d] * inv, out)


@njit(**_KERNEL)
def _row_dot_kernel(dy, out, dr):
    """dr[b, n, i] = sum_d dy[b, n, i, d] * out[b, n, i, d] in fp32."""
    B, N, S, Dv = dy.shape
    for row in prange(B * N * S):
        b = row // (N * S)
        n = (row // S) % N
        i = row % S
        acc = np.float32(0.0)
        for d in range(Dv):
            acc += widen(dy[b, n, i, d]) * widen(out[b, n, i, d])
        dr[b, n, i] = acc


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _backward_tile(s, dp, pt, dst, rows, cols, general, mask, bm, nm, i0, j0, has_mask, scale, pre, nxt,
                   smax, ssum, dr, b, n):
    """P = exp(S - max) / sum -> pt (input dtype); dS = P (dP - Dr) -> dst (input dtype)."""
    for r in range(rows):
        i = i0 + r
        mr = smax[b, n, i]
        lr = ssum[b, n, i]
        dri = dr[b, n, i]
        _modify_scores(s, r, cols, scale, i, j0, general, mask, bm, nm, has_mask, pre, nxt)
        for c in range(cols):
            pr = exp32(s[r, c] - mr) / lr
            pt[r, c] = narrow(pr, pt)
            dst[r, c] = narrow(pr * (dp[r, c] - dri), dst)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _backward_key_block(q, k, v, dy, smax, ssum, dr, mask, has_mask, scale, pre, nxt, b, n2, j0, chunk,
                        dq_acc, s, dp, pt, dst, dk_acc, dv_acc):
    """dK/dV of keys [j0, j0+BK) over the G query heads and all query blocks; dQ into dq_acc[chunk]."""
    N1, Sq, D = q.shape[1], q.shape[2], q.shape[3]
    G = N1 // k.shape[1]
    Skv, Dv = k.shape[2], v.shape[3]
    BQ, BK = s.shape
    cols = min(BK, Skv - j0)
    dk_acc[:] = 0.0
    dv_acc[:] = 0.0
    bm = b if mask.shape[0] > 1 else 0
    for n in range(n2 * G, n2 * G + G):
        nm = n if mask.shape[1] > 1 else 0
        for i0 in range(0, Sq, BQ):
            rows = min(BQ, Sq - i0)
            kind = _tile_kind(i0, rows, j0, cols, pre, nxt)
            if kind == _OUTSIDE and not _dead_row(smax, b, n, i0, rows):
                continue  # P = exp(-FLT_MAX - max) = 0 on the whole tile
            qp, dyp = _ptr(q, b, n, i0), _ptr(dy, b, n, i0)
            gemm(q, NO_TRANS, TRANS, rows, cols, D, 1.0, qp, D, _ptr(k, b, n2, j0), D, 0.0, s.ctypes.data, BK)
            gemm(q, NO_TRANS, TRANS, rows, cols, Dv, 1.0, dyp, Dv, _ptr(v, b, n2, j0), Dv, 0.0, dp.ctypes.data, BK)
            general = has_mask or kind != _INSIDE
            _backward_tile(s, dp, pt, dst, rows, cols, general, mask, bm, nm, i0, j0, has_mask, scale, pre, nxt,
                           smax, ssum, dr, b, n)
            gemm(q, TRANS, NO_TRANS, cols, Dv, rows, 1.0, pt.ctypes.data, BK, dyp, Dv, 1.0, dv_acc.ctypes.data, Dv)
            gemm(q, TRANS, NO_TRANS, cols, D, rows, 1.0, dst.ctypes.data, BK, qp, D, 1.0, dk_acc.ctypes.data, D)
            dq_ptr = dq_acc.ctypes.data + (((chunk * dq_acc.shape[1] + b) * N1 + n) * Sq + i0) * D * 4
            gemm(q, NO_TRANS, NO_TRANS, rows, D, cols, 1.0, dst.ctypes.data, BK, _ptr(k, b, n2, j0), D, 1.0,
                 dq_ptr, D)


@njit(**_KERNEL)
def _backward_kernel(q, k, v, dy, smax, ssum, dr, mask, has_mask, scale, pre, nxt, dq_acc, dk, dv):
    B, N2, Skv, D = k.shape
    Dv = v.shape[3]
    chunks = dq_acc.shape[0]
    nkb = (Skv + _BK - 1) // _BK
    for task in prange(B * N2 * chunks):
        b = task // (N2 * chunks)
        n2 = (task // chunks) % N2
        chunk = task % chunks
        s = np.empty((_BQ, _BK), np.float32)
        dp = np.empty((_BQ, _BK), np.float32)
        pt = np.empty((_BQ, _BK), q.dtype)
        dst = np.empty((_BQ, _BK), q.dtype)
        dk_acc = np.empty((_BK, D), np.float32)
        dv_acc = np.empty((_BK, Dv), np.float32)
        for kb in range(chunk * nkb // chunks, (chunk + 1) * nkb // chunks):
            j0 = kb * _BK
            _backward_key_block(q, k, v, dy, smax, ssum, dr, mask, has_mask, scale, pre, nxt, b, n2, j0,
                                chunk, dq_acc, s, dp, pt, dst, dk_acc, dv_acc)
            for r in range(min(_BK, Skv - j0)):
                for d in range(D):
                    dk[b, n2, j0 + r, d] = narrow(dk_acc[r, d] * scale, dk)
                for d in range(Dv):
                    dv[b, n2, j0 + r, d] = narrow(dv_acc[r, d], dv)


@njit(**_KERNEL)
def _finish_dq_kernel(dq_acc, scale, dq):
    """dq = scale * sum over chunks (in chunk order) of dq_acc, rounded once to dq's dtype."""
    chunks, B, N, S, D = dq_acc.shape
    for row in prange(B * N * S):
        b = row // (N * S)
        n = (row // S) % N
        i = row % S
        for d in range(D):
            acc = dq_acc[0, b, n, i, d]
            for c in range(1, chunks):
                acc += dq_acc[c, b, n, i, d]
            dq[b, n, i, d] = narrow(acc * scale, dq)


def _dynamic(kernel, *args) -> None:
    """Run a task-parallel kernel with chunk size 1 (tasks handed out one by one: balanced when costs differ)."""
    previous = set_parallel_chunksize(1)
    try:
        kernel(*args)
    finally:
        set_parallel_chunksize(previous)


def _check_plan(plan: AttentionPlan) -> None:
    unsupported = [f for f in plan.unsupported_features()
                   if f not in ("atten_mask", "pre_tokens/next_tokens band", "invalid_rows")]
    if unsupported:
        raise NotImplementedError(f"flash attention kernel: {', '.join(unsupported)} not implemented yet")


def _view(t: torch.Tensor) -> np.ndarray:
    return kernel_view(t.contiguous())


def _mask_args(plan: AttentionPlan) -> tuple:
    """(mask view, has_mask, scale, pre, next) as the kernels take them."""
    if plan.atten_mask is None:
        mask, has_mask = np.zeros((1, 1, 1, 1), np.uint8), False
    else:
        mask, has_mask = kernel_view(plan.atten_mask.to(torch.uint8) if plan.atten_mask.dtype != torch.bool
                                     else plan.atten_mask), True
    return mask, has_mask, np.float32(plan.scale), int(plan.pre_tokens), int(plan.next_tokens)


def flash_attention_forward(q, k, v, plan: AttentionPlan):
    """Returns ``(out [B,N1,Sq,Dv] input dtype, softmax_max [B,N1,Sq] fp32, softmax_sum [B,N1,Sq] fp32)``.

    Fully masked rows: max = -FLT_MAX and sum = Skv (uniform P over all keys), or with
    ``plan.invalid_rows`` out = 0, max = -FLT_MAX, sum = +FLT_MAX (spec section 6).
    """
    _check_plan(plan)
    B, N1, Sq, _ = q.shape
    out = torch.empty(B, N1, Sq, v.shape[3], dtype=q.dtype)
    smax = torch.empty(B, N1, Sq, dtype=torch.float32)
    ssum = torch.empty(B, N1, Sq, dtype=torch.float32)
    _dynamic(_forward_kernel, _view(q), _view(k), _view(v), *_mask_args(plan), bool(plan.invalid_rows),
             kernel_view(out), smax.numpy(), ssum.numpy())
    return out, smax, ssum


def backward_chunks(batch_kv_heads: int, skv: int) -> int:
    """Key chunks per (b, n2) of the backward: a function of the shape only (so of no thread count)."""
    key_blocks = max(1, -(-skv // _BK))
    return max(1, min(key_blocks, -(-_TARGET_TASKS // batch_kv_heads)))


def flash_attention_backward(q, k, v, dy, out, softmax_max, softmax_sum, plan: AttentionPlan):
    """Returns ``(dq, dk, dv)`` shaped like q, k, v in the input dtype (module docstring for the math).

    softmax_max / softmax_sum ``[B, N1, Sq]`` fp32 and out (attentionIn) are used as given.
    """
    _check_plan(plan)
    B, N1, Sq, D = q.shape
    N2, Skv = k.shape[1], k.shape[2]
    dyv = _view(dy)
    dr = np.empty((B, N1, Sq), np.float32)
    _row_dot_kernel(dyv, _view(out), dr)
    chunks = backward_chunks(B * N2, Skv)
    dq_acc = np.zeros((chunks, B, N1, Sq, D), np.float32)
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.empty(k.shape, dtype=q.dtype)
    dv = torch.empty(v.shape, dtype=q.dtype)
    smax = softmax_max.detach().float().contiguous().numpy()
    ssum = softmax_sum.detach().float().contiguous().numpy()
    mask_args = _mask_args(plan)
    _dynamic(_backward_kernel, _view(q), _view(k), _view(v), dyv, smax, ssum, dr, *mask_args, dq_acc,
             kernel_view(dk), kernel_view(dv))
    _finish_dq_kernel(dq_acc, mask_args[2], kernel_view(dq))
    return dq, dk, dv
