"""Fused, tiled CPU kernels of FlashAttentionScore (forward) and FlashAttentionScoreGrad (backward). BNSD.

Shapes: q ``[B, N1, Sq, D]``, k ``[B, N2, Skv, D]``, v ``[B, N2, Skv, Dv]``, dy / out ``[B, N1, Sq, Dv]``
(one float dtype: float32, float16 or bfloat16; any strides), softmax_max / softmax_sum ``[B, N1, Sq]``
float32. Query head n reads kv head ``n // G`` with ``G = N1 // N2``. The math (see docs/cann-semantics.md,
'FlashAttentionScoreGrad'):

* logits ``S = QK^T * scale`` (+ pse: ``(QK^T + pse) * scale`` for pse_type 1, ``QK^T * scale + pse``
  otherwise) in fp32 (the GEMMs of :mod:`.gemm` keep fp32 output for bf16/fp16 inputs); excluded
  positions (atten_mask nonzero, or key outside both the left-up band ``i - pre <= j <= i + next`` and
  the batch's prefix ``j < prefix[b]``) get ``-FLT_MAX``;
* forward: online softmax over key blocks; ``P = exp(S - m)`` times the dropout factor ``M / keep_prob``
  rounded to the input dtype before ``P V``; ``out = acc / l``; ``softmax_max = m``,
  ``softmax_sum = l = sum exp(S - m)`` (undropped);
* backward with the GIVEN stats and out: ``P = exp(S - m) / l``, ``Dr = rowsum(dy * out)``,
  ``dS = P (dP M / keep_prob - Dr)`` with ``dP = dy V^T`` in fp32; ``Pd = P M / keep_prob`` and dS are
  rounded to the input dtype before the dV, dQ and dK GEMMs (CANN casts); fp32 accumulation;
  ``dq = scale * dS K``, ``dk = scale * dS^T Q`` and ``dv = Pd^T dy`` summed over the G query heads of a
  kv head; outputs rounded once (half to even). Optionally dpse (pse_type 0/1) from the fp32 dS in the
  same tile loop, accumulated per tile into an fp32 array of pse's own shape (:func:`_add_dpse_row`; a dense
  [B, N1, Sq, Skv] pse is written straight into the output): the task split (:func:`_dpse_split`) gives every
  element one owning task, so one fixed summation order.
* rope parts (MLA, optional): ``q_rope [B, N1, Sq, Dr]`` / ``k_rope [B, N2 or 1, Skv, Dr]``: the scores are
  ``[q, q_rope] [k, k_rope]^T``, so ``[dq, dq_rope] = scale * dS [k, k_rope]`` and ``[dk, dk_rope] = scale *
  dS^T [q, q_rope]``. The forward adds ``q_rope k_rope^T`` to each fp32 score tile by a second GEMM
  (:func:`_add_rope_scores`); on the brgemm, with K_rope^T packed after K^T, the tile's one score product takes
  the task's ``[Q | Q_rope]`` rows (copied once per query block, :func:`_packed_rope`); on MKL
  the backward concatenates a tile's worth of rows (:func:`_key_rows`, :func:`_query_rows`: never the whole
  sequence) and runs the plain path's five GEMMs on them; on the brgemm the dK^T product reads a ``[Q | Q_rope]^T``
  copy made once per call, the score product adds the rope part by a second call;
  dQ and dK accumulators of width D + Dr are split when written out (a shared k_rope head gets the per-kv-head
  dk_rope summed afterwards);
* sink (optional, ``plan.sink`` float32 [N1]): the forward's running max starts at ``sink[n]`` and its sum at 1
  (one more logit without a value); the backward needs nothing new (dsink is computed by the contract).

Precision flags of the plan (docs/golden.md): ``widen_gemm`` widens q, k, v, dy to float32 once per call, so
every GEMM and scratch tile is float32 while the outputs keep the input dtype (one rounding each);
``round_probs`` rounds P and dS to the input dtype before their GEMMs (:func:`_operand`; implied without
``widen_gemm``). Golden mode (``widen_gemm`` without ``round_probs``) on bf16 / fp16 inputs takes Dr from the
float32 output of a forward pass on the widened inputs, ``Dr = rowsum(dy * out) = rowsum(P * dP)``, instead of the
given out, which is rounded; a float32 out is used as given (context parallelism passes the merged one).

Tiles and work split (both cores busy even for one head, results identical for any thread count):

* a launch runs one or more sequences (:class:`Sequence`): a BNSD call is one, a varlen call one per batch, each
  with its own rows of the S axes and its own plan (:class:`SequenceTable`, :func:`_sequence_plan`), so the
  tasks of all batches are balanced in one launch. Tasks go the costliest first (:func:`_forward_tasks`,
  :func:`_backward_tasks`), one at a time to the next free thread (:func:`.threads.claim`); a task's results
  do not depend on which thread runs it or when.

* forward: one task per (b, n1, query block); each task owns its rows, no reduction. A tile is cut to the
  columns that hold visible keys: none past its last row's reach (:func:`_visible_cols`, e.g. the causal
  diagonal), none before its first row's (:func:`_visible_tile`: a band's left edge; the packed operands are then
  read from that column on), and one across the visible region's edge runs as tiles of ``_EDGE_ROWS`` query
  rows, each cut on its own (rows of the task's scratch, :func:`_forward_visible_tile`). bfloat16 and
  float32 run its two GEMMs on torch's brgemm (:func:`.gemm.brgemm`) with K (and bfloat16 V) packed once per call
  (:func:`_pack_kv_kernel`); plain tiles fuse the scale into the exp sweep (max, exp, rounding of P and the
  row sum in two sweeps of the row).
* backward: one task per (b, n2, key chunk); a chunk is a fixed (shape-derived, thread-count
  independent) run of key blocks, the runs of about equal cost (:func:`_chunk_bounds`). A task owns dK/dV of
  its key blocks (fp32 tile accumulators over the G heads and all query blocks, in a fixed order; stored
  transposed, ``[D, BK]``) and adds its dQ contribution into its own fp32 slice ``dq_acc[chunk]``; the slices
  are summed in chunk order at the end. They are not zeroed: the first product into a group of ``_EDGE_ROWS``
  rows writes it and flags it written (:func:`_dq_adds`), and the sum skips the groups a chunk never wrote.
  A tile is cut to the columns that hold visible keys, as in the forward (the dK^T / dV^T accumulators are then
  written from that column on), and one across the visible region's edge (the causal diagonal) runs as tiles of
  ``_EDGE_ROWS`` query rows, each cut on its own (:func:`_backward_visible_tile`).
  bfloat16 and float32 run the five GEMMs on the brgemm too (:func:`_score_gemms`, :func:`_gradient_gemms`): the
  key block's K^T, V^T (and bfloat16 K) are packed once per block, bfloat16 Pd and dS once per tile, and dK^T /
  dV^T take Q^T / dY^T from transposed copies made once per call; bfloat16 tiles with an odd row or column count
  go to MKL (float16 runs on MKL throughout).

Kernel arguments come in typed bundles (namedtuples, so numba compiles them to plain values): the plan
(:class:`KernelPlan`), the operands (:class:`ForwardOperands`, :class:`BackwardOperands`), the backward's outputs
(:class:`Gradients`), a task's scratch tiles (:class:`ForwardScratch`, :class:`BackwardScratch`) and a tile's
position (:class:`Tile`). The two tile kernels run a worker per thread (:func:`_forward_worker`,
:func:`_backward_worker`, compiled on their own and called by address: :func:`.layouts.launch_workers`), which
types their operand and output arrays with any strides as :func:`.layouts.launch_strided` does (one compiled
specialisation per dtype combination, where numba's own typing compiled one per mix of contiguous and strided
arrays, up to a minute each). They read those arrays row by row through
C-contiguous views (:func:`.numeric.row_view`) or by address (the GEMMs), so contiguous, strided and varlen calls
run the same code and give the same bits wherever their GEMMs do. The small kernels (packing, row dots, the dQ sum) keep
numba's typing: they compile in seconds, and their loops give the same bits either way.

Extra memory: per thread a few [BQ, BK] tiles (allocated once per launch) plus the fp32 dQ slices
(``chunks * B*N1*Sq*D``), the packed bf16 K, V of the forward, the Q^T, dY^T copies of the backward and copies
of inputs that are not contiguous (of K or V in a varlen launch, where a GEMM reads them unpacked): O(S*D),
never an [Sq, Skv] tensor beyond the pse's own (dpse: one fp32 accumulator shaped like the pse, never the expanded
[B, N1, Sq, Skv]).

Tile classification (``_tile_kind``): a tile entirely outside the visible region (band and prefix) is
skipped; a tile entirely inside it and without an atten_mask to read takes the fast path without
per-element tests; the others go through ``_modify_scores``, the per-row score modifier (scale, pse,
band / prefix / mask). The pse is never expanded: each row reads its slice of the dense
``[Bp, N1, Sp, Skv]`` pse or of the alibi-compressed ``[Bp, N1, 1024, Skv]`` one, or the alibi terms a tile
generates from the slopes once per diagonal (``_alibi_terms``); tiles without per-element tests add those inside
the backward's exp sweep, and in the forward's sweep that also takes the row max (``_add_pse``). Dropout bits
become a row's keep factors sixteen at a time (``numeric.select_bits``).
Subnormals (below 2**-126) are flushed to zero (``numeric.flush_denormals``: results, and inputs read as zero) in
the forward's P V product, in the backward's tile sweep unless it computes dpse, and in the backward's products
that take P and dS (``_backward_visible_tile``). Far from the diagonal of a generated alibi, P runs to the end of
float32's range, and on x86 each subnormal result costs a microcode assist unless flushed (the fp32 FMAs of
widened or float32 tiles; AMX flushes them itself). A flushed term is below 2**-126 in magnitude; in a sum that
also holds normal terms (a row's P V: its max has P = 1) it would be lost anyway, and a gradient made of such terms
alone becomes 0 instead of a subnormal. The score products, on the inputs as given, are not flushed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from .flash_attention_plan import MASKED_LOGIT, AttentionPlan
from .gemm_paths import CALIBRATED_DTYPES, WIDENED, gemm_path
from .gemm import BRGEMM_DTYPES, NO_TRANS, TRANS, brgemm, brgemm_release, gemm
from .layouts import launch_strided, launch_workers
from .numeric import (FASTMATH, LOG2E, SELECT_BITS, TRANSPOSE_BLOCK, aligned_empty, array_at, copy_row, exp2_32,
                      exp32, exp_nonpositive, flush_denormals, fmaximum, narrow, narrow_ftz, prefer_512_bit_vectors,
                      prefetch_bytes, restore_float_mode, row_address, row_view, select_bits, stream_fence, streams,
                      transpose_matrix, unowned, widen)
from .tensor_view import kernel_view, new_output
from .threads import call_native, claim, on_torch_threads

_NEG = np.float32(MASKED_LOGIT)
_FLT_MAX = np.float32(-MASKED_LOGIT)
_BQ = 256  # query rows of a tile
_BK = 256  # key columns of a tile
_FWD_BK = 512  # key columns of a forward tile (fewer online-softmax rescales of the accumulator)
# bytes past each row of the forward's score and P tiles: rows 2 KiB / 1 KiB apart put a 16-row AMX tile's rows
# in few cache sets, and the brgemm's tile stores and loads conflict (docs/performance.md, 'Padding the forward's
# tiles')
_ROW_PAD = 64
_EDGE_ROWS = 64  # query rows of the tiles across the visible region's edge (forward and backward)
_ROWS_AHEAD = 2  # a dense pse or atten_mask row is prefetched this many rows ahead of its use
_TARGET_TASKS = 16  # the backward splits keys into chunks until B*N2*chunks reaches this (when it can)
_OUTSIDE, _INSIDE, _PARTIAL = 0, 1, 2

# pse kinds: none, dense [Bp,N1,Sp,Skv], alibi-compressed [Bp,N1,1024,Skv], generated |d|, generated sqrt|d|
_PSE_NONE, _PSE_DENSE, _PSE_COMPRESSED, _PSE_ALIBI, _PSE_ALIBI_SQRT = range(5)

_KERNEL = dict(parallel=True, fastmath=FASTMATH, cache=True, nogil=True)


class KernelPlan(NamedTuple):
    """An :class:`AttentionPlan` as the kernels read it (:func:`_kernel_plan`); an absent array is a placeholder."""

    mask: np.ndarray  # bool/uint8 [Bm, Nm, Sq, Skv], read when has_mask
    pse: np.ndarray  # dense [Bp, N1, Sp, Skv] or compressed [Bp, N1, 1024, Skv], read when pse_kind says so
    slopes: np.ndarray  # float32 [Bs, N1, 1, 1]: the generated alibi's slopes (pse_type 2/3)
    prefix: np.ndarray  # int64 [B]: keys j < prefix[b] are visible whatever the band
    drop: np.ndarray  # uint8: the flat bit-packed keep mask, read when dropout
    pre: int  # the left-up band i - pre <= j <= i + nxt
    nxt: int
    has_mask: bool
    pse_kind: int  # _PSE_NONE .. _PSE_ALIBI_SQRT
    pse_first: bool  # pse_type 1: (QK^T + pse) * scale
    shift: int  # kv_start_idx - q_start_idx of the generated alibi
    dropout: bool
    dpse: bool  # the backward accumulates dpse
    invalid_rows: bool  # fully masked rows: out = 0, max = -FLT_MAX, sum = +FLT_MAX (forward)
    n1: int  # N1, Sq, Skv: the dropout bit index and the compressed pse's rule
    sq: int
    skv: int
    scale: np.float32
    keep_factor: np.float32  # 1 / keep_prob: the dropout factor of a kept element (0 for a dropped one)
    probs_like: np.ndarray  # 1 element of the type P and dS are rounded to before their GEMMs (:func:`_operand`)
    sink: np.ndarray  # float32 [N1]: the sink logit of each head, read when has_sink
    has_sink: bool


@njit(inline="always")
def _unowned_plan(plan):
    """``plan`` with :func:`.numeric.unowned` views of its arrays: the tile functions pass the plan to their row
    helpers, which otherwise took an atomic reference count on each of its arrays per row (and the arrays are
    shared by every thread)."""
    return KernelPlan(unowned(plan.mask), unowned(plan.pse), unowned(plan.slopes), unowned(plan.prefix),
                      unowned(plan.drop), plan.pre,
                      plan.nxt, plan.has_mask, plan.pse_kind, plan.pse_first, plan.shift, plan.dropout, plan.dpse,
                      plan.invalid_rows, plan.n1, plan.sq, plan.skv, plan.scale, plan.keep_factor,
                      unowned(plan.probs_like), unowned(plan.sink), plan.has_sink)


class Sequence(NamedTuple):
    """One attention problem of a launch: query rows ``[q0, q1)`` and key rows ``[k0, k1)`` of the S axes of the
    operands, with its own plan. A BNSD call is one sequence over all of S; a varlen (TND) call one per batch, so
    that all of them run as one set of tasks (:func:`_order_tasks`)."""

    q0: int
    q1: int
    k0: int
    k1: int
    plan: AttentionPlan


_PLAN_INTS = ("pre", "nxt", "has_mask", "pse_kind", "pse_first", "shift", "dropout", "dpse", "invalid_rows", "n1",
              "sq", "skv")  # the KernelPlan fields a sequence sets (the others are common to a launch)
_PLAN_ARRAYS = ("mask", "pse", "slopes", "prefix", "drop")
_MAX_RANK = 5


class SequenceTable(NamedTuple):
    """The sequences of a launch as the kernels read them (:func:`_sequence_table`): sequence s's rows and its
    plan's own fields (:func:`_sequence_plan`), arrays by address (the caller keeps them alive)."""

    rows: np.ndarray  # int64 [S, 6]: q0, q1, k0, k1, the first packed key block, the backward's batch tasks
    ints: np.ndarray  # int64 [S, len(_PLAN_INTS)]
    arrays: np.ndarray  # int64 [S, len(_PLAN_ARRAYS) + extras, 1 + _MAX_RANK]: address and shape of the plan's
    # arrays, then of the backward's dQ slices, their written flags and dpse target


class Tile(NamedTuple):
    """Rows [i0, i0 + rows) x columns [j0, j0 + cols) of the scores of batch b, query head n."""

    b: int
    n: int
    i0: int
    rows: int
    j0: int
    cols: int


class ForwardOperands(NamedTuple):
    """q, k, v (kernel views), K^T, V packed per key block by :func:`_pack_kv_kernel` when ``packed``, and the
    rope parts q_rope ``[B, N1, Sq, Dr]``, k_rope ``[B, N2 or 1, Skv, Dr]`` when ``rope`` (:func:`_add_rope_scores`)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kt: np.ndarray  # [B, N2, blocks, _FWD_BK * (D + Dr or D) / per]: the B operands of QK^T (:func:`_pack_kv_kernel`)
    vt: np.ndarray  # bfloat16: [B, N2, blocks, _FWD_BK * Dv / 2] VNNI pairs, the B operands of PV
    packed: bool
    qr: np.ndarray
    kr: np.ndarray
    rope: bool


class ForwardScratch(NamedTuple):
    """A forward task's tiles: fp32 scores s, P p (input dtype), fp32 accumulator acc, running max m and sum l,
    and with the rope product on the brgemm the task's ``[Q | Q_rope]`` rows qq."""

    s: np.ndarray  # [_BQ, _FWD_BK + _ROW_PAD / 4]: the padding is never read
    p: np.ndarray  # [_BQ, _FWD_BK + _ROW_PAD / itemsize]
    acc: np.ndarray  # [_BQ, Dv]
    m: np.ndarray  # [_BQ]
    l: np.ndarray  # [_BQ]
    qq: np.ndarray  # [1, 1, _BQ, D + Dr] (:func:`_packed_rope`), else [1, 1, 1, 1]


class BackwardOperands(NamedTuple):
    """q, k, v, dy (kernel views), the copies ``[Q | Q_rope]^T`` ``[B, N1, D + Dr, Sq]`` and dY^T ``[B, N1, Dv, Sq]``
    of the brgemm path (``packed``), the given softmax stats and ``dr = rowsum(dy * out)`` ``[B, N1, Sq]`` fp32."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dy: np.ndarray
    qt: np.ndarray
    dyt: np.ndarray
    smax: np.ndarray
    ssum: np.ndarray
    dr: np.ndarray
    packed: bool
    qr: np.ndarray  # the rope parts, as in :class:`ForwardOperands`
    kr: np.ndarray
    rope: bool


class Gradients(NamedTuple):
    """The backward's outputs: fp32 dQ slices ``[chunks, B, N1, Sq, D + Dr]`` (Dr = 0 without rope: columns D.. are
    dQ_rope) and which of their row groups hold sums, dk, dv and dpse (or a placeholder); with rope dK_rope per kv
    head ``[B, N2, Skv, Dr]`` fp32."""

    dq_acc: np.ndarray  # not zeroed: a group of _EDGE_ROWS rows is written by its first dQ product (:func:`_dq_adds`)
    dq_written: np.ndarray  # uint8 [chunks, B, N1, ceil(Sq / _EDGE_ROWS)]: 1 where that group of dq_acc was written
    dk: np.ndarray
    dv: np.ndarray
    dpse: np.ndarray
    dkr: np.ndarray


class BackwardScratch(NamedTuple):
    """A backward task's tiles (:func:`_backward_scratch`) and the packed brgemm operands of its key block."""

    s: np.ndarray  # fp32 [_BQ, _BK]: scores, then dS
    dp: np.ndarray  # fp32 [_BQ, _BK]: dY V^T
    pt: np.ndarray  # input dtype [_BQ, _BK]: Pd
    dst: np.ndarray  # input dtype [_BQ, _BK]: dS as the GEMMs take it (a placeholder where they take s: _ds_tile)
    dkt: np.ndarray  # fp32 [D + Dr, _BK]: dK^T (rows D..: dK_rope^T) of the key block
    dvt: np.ndarray  # fp32 [Dv, _BK]: dV^T of the key block
    kt: np.ndarray  # the key block's K^T, V^T (:func:`_pack_transposed`) and bfloat16 K (:func:`_pack_rows`)
    vt: np.ndarray
    k_pairs: np.ndarray
    pt_pairs: np.ndarray  # bfloat16 Pd and dS as VNNI pairs (:func:`_pack_tile`)
    dst_pairs: np.ndarray
    kk: np.ndarray  # rope: [1, 1, _BK, D + Dr] the key block's [K | K_rope] rows (:func:`_key_rows`)
    qq: np.ndarray  # rope on MKL: [1, 1, _BQ, D + Dr] the tile's [Q | Q_rope] rows (:func:`_query_rows`)


def _table_array(like, row):  # pragma: no cover - compiled through the overload below
    """The array at a :class:`SequenceTable` row ``(address, shape padded to _MAX_RANK)``: C-contiguous, with
    like's dtype, rank and layout (the same memory typed any-strides when like is)."""
    raise NotImplementedError


@overload(_table_array, inline="always")
def _table_array_impl(like, row):
    shape = {1: _shape1, 4: _shape4, 5: _shape5}[like.ndim]
    if like.layout == "C":
        return lambda like, row: array_at(row[0], _size(shape(row)), like.dtype).reshape(shape(row))
    return lambda like, row: unowned(array_at(row[0], _size(shape(row)), like.dtype).reshape(shape(row)))


@njit(inline="always")
def _shape1(row):
    return (row[1],)


@njit(inline="always")
def _shape4(row):
    return row[1], row[2], row[3], row[4]


@njit(inline="always")
def _shape5(row):
    return row[1], row[2], row[3], row[4], row[5]


@njit(inline="always")
def _size(shape):
    n = 1
    for extent in shape:
        n *= extent
    return n


@njit(inline="always")
def _sequence_plan(plan, table, s):
    """Sequence s's :class:`KernelPlan`: its own fields (``_PLAN_INTS``, ``_PLAN_ARRAYS``) from the table, the
    launch's common ones (scale, dropout factor, rounding type, sink) from ``plan``."""
    v, a = table.ints[s], table.arrays[s]
    return KernelPlan(_table_array(plan.mask, a[0]), _table_array(plan.pse, a[1]), _table_array(plan.slopes, a[2]),
                      _table_array(plan.prefix, a[3]), _table_array(plan.drop, a[4]), v[0], v[1], v[2] != 0, v[3],
                      v[4] != 0, v[5], v[6] != 0, v[7] != 0, v[8] != 0, v[9], v[10], v[11], plan.scale,
                      plan.keep_factor, plan.probs_like, plan.sink, plan.has_sink)


def _operand(v, like, tile):  # pragma: no cover - compiled through the overload below
    """float32 P or dS -> an element of the GEMM operand ``tile``, rounded (``narrow_ftz``) through the element type
    of ``like`` first: ``like`` float32 or of tile's type rounds once to tile's type (float32: no rounding); a
    float32 tile with a bfloat16 / float16 ``like`` holds the rounded value widened back (exact)."""
    raise NotImplementedError


@overload(_operand, inline="always")
def _operand_impl(v, like, tile):
    if like.dtype == tile.dtype or like.dtype == types.float32:
        return lambda v, like, tile: narrow_ftz(v, tile)
    return lambda v, like, tile: narrow_ftz(widen(narrow_ftz(v, like)), tile)


@njit(inline="always")
def _tile_kind(i0, rows, j0, cols, pre, nxt, pfx):
    """Where the tile [i0, i0+rows) x [j0, j0+cols) lies relative to the visible region
    (band ``i - pre <= j <= i + nxt``, or ``j < pfx``)."""
    i1 = i0 + rows - 1
    j1 = j0 + cols - 1
    if j1 < pfx or (j0 >= i1 - pre and j1 <= i0 + nxt):
        return _INSIDE
    if (j0 > i1 + nxt or j1 < i0 - pre) and j0 >= pfx:
        return _OUTSIDE
    return _PARTIAL


@njit(inline="always")
def _visible_cols(i0, rows, j0, cols, nxt, pfx):
    """Leading columns of the tile [i0, i0+rows) x [j0, j0+cols) that hold every visible key (the keys after
    ``i0 + rows - 1 + nxt`` and the prefix are excluded for all its rows), rounded up to even (AMX pairs)."""
    last = max(i0 + rows + nxt, pfx) - j0
    return max(min(cols, last + last % 2), 0)


@njit(inline="always")
def _visible_tile(b, n, i0, rows, j0, cols, pre, nxt, pfx):
    """``(tile, kind, lead)``: the tile [i0, i0+rows) x [j0, j0+cols) of (b, n) without its ``lead`` leading
    columns that no row sees (keys before ``i0 - pre`` and past the prefix ``pfx``: a band's left edge), an even
    count (bfloat16 operands go in VNNI pairs of keys), and its :func:`_tile_kind`."""
    lead = 0
    if pfx <= j0:
        lead = max(min(i0 - pre - j0, cols), 0)
        lead -= lead % 2
    kind = _tile_kind(i0, rows, j0 + lead, cols - lead, pre, nxt, pfx)
    return Tile(b, n, i0, rows, j0 + lead, cols - lead), kind, lead


@njit(inline="always")
def _compressed_source(i, sq, h, skv):
    """(row, col offset) of query row i in the alibi-compressed pse ``[.., h, Skv]``
    (:func:`~.flash_attention_plan.alibi_source`): key j reads column ``j + offset`` of that row."""
    if i >= sq - h:
        return i - (sq - h), 0
    row = i % h
    return row, skv - i - h + row


@njit(inline="always")
def _row_part(a, b, n, i, j0, count):
    """``a[b, n, i, j0:j0 + count]`` of a 4-D array with unit-stride rows, as a C array indexed from 0. A loop over
    it vectorises, where an index ``j0 + c`` (sign unknown to the compiler) takes numba's negative-index
    wraparound per element and stays scalar."""
    return array_at(row_address(a, b, n, i) + j0 * a.itemsize, count, a.dtype)


@njit(inline="always")
def _prefetch_row_part(a, b, n, i, j0, count):
    """Start loading the :func:`_row_part` of row ``i + _ROWS_AHEAD`` (when a has it). A row of a dense pse or
    atten_mask ``[.., Sq, Skv]`` is a page or more apart from the last one, and the hardware prefetchers stop at
    each 4 KiB page, so without it each row of a tile starts with a cold stream."""
    if _ROWS_AHEAD < a.shape[2] - i:
        prefetch_bytes(row_address(a, b, n, i + _ROWS_AHEAD) + j0 * a.itemsize, count * a.itemsize)


@njit(inline="always", fastmath=FASTMATH)
def _alibi_terms(tile, plan):
    """The generated alibi terms of a tile, one per diagonal (an empty array for the other pse kinds): float32
    ``[rows + cols]``, ``t[u] = -slope * |d|`` (``-slope * sqrt|d|`` for pse_type 3) where
    ``d = j - i + shift = j0 - i0 - (rows - 1) + shift + u``, so row r of the tile reads ``t[rows - 1 - r:]``;
    see docs/cann-semantics.md, 'Position shift (pse)'."""
    b, n, i0, rows, j0, cols = tile
    slopes = plan.slopes
    if plan.pse_kind < _PSE_ALIBI:
        return aligned_empty((0,), np.float32)
    out = aligned_empty((rows + cols,), np.float32)
    slope = slopes[b if slopes.shape[0] > 1 else 0, n, 0, 0]
    d0 = np.float32(j0 - i0 - (rows - 1) + plan.shift)  # float32 sums of integers: exact below 2^24, and they vectorise
    for u in range(rows + cols):
        dist = abs(d0 + np.float32(np.int32(u)))
        out[u] = -slope * (np.sqrt(dist) if plan.pse_kind == _PSE_ALIBI_SQRT else dist)
    return out


@njit(inline="always")
def _dense_pse_row(tile, r, plan):
    """The keys' part of a dense pse row for row r of the tile (``[Bp, N1, Sp, Skv]``, broadcast over b and rows
    of size 1), its row ``_ROWS_AHEAD`` further down prefetched."""
    b, n, i0, _, j0, cols = tile
    pse = plan.pse
    bp, row = (b if pse.shape[0] > 1 else 0), (i0 + r if pse.shape[2] > 1 else 0)
    _prefetch_row_part(pse, bp, n, row, j0, cols)
    return _row_part(pse, bp, n, row, j0, cols)


@njit(inline="always", fastmath=FASTMATH)
def _pse_logit(score, x, scale, first):
    """The logit of raw score QK^T with the stored pse term x: ``(QK^T + pse) * scale`` for pse_type 1 (``first``),
    else ``QK^T * scale + pse``."""
    return (score + x) * scale if first else score * scale + x


@njit(inline="always", fastmath=FASTMATH)
def _add_pse(s, r, tile, plan, alibi):
    """Row r of the tile: raw QK^T -> ``QK^T * scale`` with the pse term of pse_type 0-3, in place; returns the
    max of the row's new values (``fmaximum``), which the forward takes from this sweep on tiles without a mask
    to test (a caller that ignores it compiles without it).

    The pse is read for this row's keys only: dense ``[Bp, N1, Sp, Skv]`` broadcast over b and rows,
    alibi-compressed (:func:`_compressed_source`), or the tile's generated :func:`_alibi_terms` ``alibi``.
    """
    b, n, i0, rows, j0, cols = tile
    i = i0 + r
    kind, pse, scale = plan.pse_kind, plan.pse, plan.scale
    top = np.float32(-np.inf)
    if kind == _PSE_NONE:
        for c in range(cols):
            s[r, c] = s[r, c] * scale
            top = fmaximum(top, s[r, c])
        return top
    if kind >= _PSE_ALIBI:
        terms = alibi[rows - 1 - r:]
        for c in range(cols):
            s[r, c] = s[r, c] * scale + terms[c]
            top = fmaximum(top, s[r, c])
        return top
    first = plan.pse_first
    if kind == _PSE_DENSE:
        source = _dense_pse_row(tile, r, plan)
        for c in range(cols):
            x = widen(source[c])
            s[r, c] = _pse_logit(s[r, c], x, scale, first)
            top = fmaximum(top, s[r, c])
        return top
    bp = b if pse.shape[0] > 1 else 0
    row, off = _compressed_source(i, plan.sq, pse.shape[2], pse.shape[3])
    last = pse.shape[3] - 1
    source = row_view(pse, bp, n, row)
    for c in range(cols):
        x = widen(source[min(max(j0 + c + off, 0), last)])
        s[r, c] = _pse_logit(s[r, c], x, scale, first)
        top = fmaximum(top, s[r, c])
    return top


@njit(inline="always", fastmath=FASTMATH)
def _modify_scores(s, r, tile, general, plan, alibi):
    """Score modifier of row r of a tile: raw QK^T -> logit, in place.

    scale and pse (:func:`_add_pse`); keys outside both the band and the prefix, or set in atten_mask, get
    -FLT_MAX. ``general`` False (tile entirely visible, no mask to read) skips the tests. ``alibi``: the tile's
    :func:`_alibi_terms`.
    """
    if not general:
        _add_pse(s, r, tile, plan, alibi)
        return
    b, n, i0, _, j0, cols = tile
    i = i0 + r
    lo = min(max(i - plan.pre - j0, 0), cols)
    hi = max(min(i + plan.nxt - j0 + 1, cols), 0)
    pl = min(max(plan.prefix[b] - j0, 0), cols)
    if plan.pse_kind == _PSE_NONE:
        scale = plan.scale
        if not plan.has_mask:  # scale and band in one sweep (the diagonal tiles of causal attention)
            for c in range(cols):
                s[r, c] = s[r, c] * scale if ((c >= lo) & (c < hi)) | (c < pl) else _NEG
            return
        excluded = _mask_row(plan, b, n, i, j0, cols)
        for c in range(cols):  # scale, band and mask in one sweep
            visible = (((c >= lo) & (c < hi)) | (c < pl)) & (excluded[c] == 0)
            s[r, c] = s[r, c] * scale if visible else _NEG
        return
    _add_pse(s, r, tile, plan, alibi)
    for c in range(cols):
        if not (((c >= lo) & (c < hi)) | (c < pl)):
            s[r, c] = _NEG
    if plan.has_mask:
        excluded = _mask_row(plan, b, n, i, j0, cols)
        for c in range(cols):
            if excluded[c] != 0:
                s[r, c] = _NEG


@njit(inline="always")
def _mask_row(plan, b, n, i, j0, cols):
    """atten_mask row i of (b, n) (broadcast over B and N where it has one of them) at columns [j0, j0 + cols),
    as a :func:`_row_part`; starts loading the row ``_ROWS_AHEAD`` further on."""
    mask = plan.mask
    bm = b if mask.shape[0] > 1 else 0
    nm = n if mask.shape[1] > 1 else 0
    _prefetch_row_part(mask, bm, nm, i, j0, cols)
    return _row_part(mask, bm, nm, i, j0, cols)


@njit(inline="always")
def _keep_factors(drop, e0, cols, keep, f):
    """f[c] = dropout factor of flat element e0 + c from the LSB-first packed keep mask: ``keep`` (1 / keep_prob)
    where its bit is set, else 0; 16 at a time by :func:`.numeric.select_bits` while its 4-byte read stays inside
    the mask, the last few bit by bit."""
    last = drop.size * 8 - 32
    c = 0
    while c + SELECT_BITS <= cols and e0 + c <= last:
        e = e0 + c
        select_bits(drop.ctypes.data + (e >> 3), e & 7, keep, f.ctypes.data + c * 4)
        c += SELECT_BITS
    while c < cols:
        e = e0 + c
        f[c] = keep if (drop[e >> 3] >> (e & 7)) & 1 else np.float32(0.0)
        c += 1


@njit(inline="always")
def _row_keep_factors(plan, tile, r, f):
    """:func:`_keep_factors` of row r of the tile (flat keep-mask element ``((b*N1 + n)*Sq + i)*Skv + j``)."""
    b, n, i0, _, j0, cols = tile
    _keep_factors(plan.drop, ((b * plan.n1 + n) * plan.sq + i0 + r) * plan.skv + j0, cols, plan.keep_factor, f)


@njit(inline="always")
def _row_index(row, a):
    """(b, n, i) of the row-th ``a[b, n, i, :]`` counted in a's memory order (:func:`_grid_index`)."""
    return _grid_index(row, a.shape[1], a.shape[2], a.strides[1] < a.strides[2])


@njit(inline="always")
def _grid_index(index, N, S, heads_inner):
    """(b, n, i) of the index-th cell of a ``[B, N, S]`` grid: heads inner (``heads_inner``: an array whose heads
    lie closer than its rows, a TND batch seen as BNSD), else rows inner, so that a loop streams through memory."""
    if heads_inner:
        return index // (N * S), index % N, (index // N) % S
    return index // (N * S), (index // S) % N, index % S


@njit(inline="always")
def _ld(a):
    """Leading dimension (row stride in elements) of the [S, D] matrices of a 4-D array with unit last stride
    (:func:`_view`); at least D (a single row may carry any stride)."""
    return max(a.strides[2] // a.itemsize, a.shape[3])


@njit(inline="always")
def _matrix(a, b, n, i):
    """GEMM operand (:mod:`.gemm`: address, leading dim) of the ``[S - i, D]`` matrix ``a[b, n, i:]``."""
    return row_address(a, b, n, i), _ld(a)


@njit(inline="always")
def _columns(at, b, n, i):
    """GEMM operand of ``at[b, n, :, i:]`` (``[D, S - i]``) of a transposed copy ``at`` ``[B, N, D, S]``."""
    return row_address(at, b, n, 0) + i * at.itemsize, _ld(at)


@njit(inline="always")
def _scratch(t):
    """GEMM operand of a 2-D scratch tile (row-major, C-contiguous)."""
    return t.ctypes.data, t.shape[1]


@njit(inline="always")
def _rows_from(a, r0):
    """``a[:, :, r0:]`` of a C-contiguous ``[1, 1, R, W]`` array, still typed C-contiguous (a plain slice is typed
    any-strided, and a function taking it would compile once more)."""
    rows = a[0, 0, r0:]
    return rows.reshape((1, 1) + rows.shape)


@njit(inline="always")
def _dead_row(maxima, rows):
    """True when one of the row maxima ``maxima[:rows]`` is a fully masked row's: exp(S - max) is then not 0
    outside the visible keys."""
    for r in range(rows):
        if not maxima[r] > _NEG:
            return True
    return False


@njit(inline="always", fastmath=FASTMATH)
def _row_max(s, r, cols):
    """max of s[r, :cols] (``fmaximum``: vectorises; a nan in the row makes it nan)."""
    top = np.float32(-np.inf)
    for c in range(cols):
        top = fmaximum(top, s[r, c])
    return top


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _forward_tile(work, tile, general, plan):
    """Online-softmax update of one tile: work.s holds QK^T; work.p gets exp(S - m_new), times the dropout factor
    M / keep_prob (the sum l takes the undropped values); work.acc is rescaled to the new max.

    Plain tiles (no score modifier, scale > 0) keep s raw: ``max(S) = max(QK^T) * scale`` (rounding is
    monotonic) and ``exp(QK^T * scale - m)`` in the same sweep as the rounding of P and the row sum.
    Other tiles get their logits first (then the scale factor is 1): from :func:`_add_pse`, which also returns
    their max, where no mask is to be tested, else from :func:`_modify_scores`.
    """
    prefer_512_bit_vectors()
    s, p, acc, m, l = work.s, work.p, work.acc, work.m, work.l
    rows, cols = tile.rows, tile.cols
    dv = acc.shape[1]
    dropout = plan.dropout
    raw = not general and plan.pse_kind == _PSE_NONE and plan.scale > 0
    scale = plan.scale if raw else np.float32(1.0)
    f = aligned_empty((cols,), np.float32)
    alibi = _alibi_terms(tile, plan)
    for r in range(rows):
        if raw:
            top = _row_max(s, r, cols) * scale
        elif general:
            _modify_scores(s, r, tile, general, plan, alibi)
            top = _row_max(s, r, cols)
        else:  # the logits and their max in one sweep
            top = _add_pse(s, r, tile, plan, alibi)
        new = max(m[r], top)
        alpha = exp32(m[r] - new)
        total = np.float32(0.0)
        if dropout:
            _row_keep_factors(plan, tile, r, f)
            for c in range(cols):
                e = exp_nonpositive(s[r, c] * scale - new, plan.probs_like)
                p[r, c] = _operand(e * f[c], plan.probs_like, p)
                total += e
        else:
            for c in range(cols):
                e = exp_nonpositive(s[r, c] * scale - new, plan.probs_like)
                p[r, c] = _operand(e, plan.probs_like, p)
                total += e
        l[r] = l[r] * alpha + total
        m[r] = new
        if alpha != np.float32(1.0):
            for d in range(dv):
                acc[r, d] *= alpha


@njit(inline="always")
def _pairs(x):
    """True when x's brgemm B operands are VNNI pairs (bfloat16, 2-byte elements); float32 ones are plain."""
    return x.itemsize == 2


@njit(inline="always")
def _pack_transposed(x, b, n, j0, cols, out, stream=False):
    """B operand of ``A x[b, n, j0:j0+cols]^T`` (:func:`.gemm.brgemm`), ``[D, cols]`` with row stride cols: float32
    plain (``out[d * cols + j] = x[.., j0+j, d]``), bfloat16 in VNNI pairs (one uint32 each):
    ``out[d2 * cols + j] = (x[.., j0+j, 2*d2], x[.., j0+j, 2*d2+1])``, i.e. x's rows read as uint32 pairs and
    transposed. x's rows are unit-stride (kernel views from :func:`_view`, scratch rows). ``stream``: as
    :func:`.numeric.transpose_matrix` takes it."""
    width = x.shape[3] * x.itemsize // out.itemsize  # elements of out's type per row of x
    transpose_matrix(row_address(x, b, n, j0), x.strides[2], out.ctypes.data, cols * out.itemsize, cols, width, out,
                     stream)


@njit(inline="always")
def _interleave(even, odd, out, start, n):
    """out[start + t] = (even[t], odd[t]) for t < n: a bf16 pair as one uint32 (a VNNI pair)."""
    sixteen = np.uint32(16)
    for t in range(n):
        out[start + t] = np.uint32(even[t]) | (np.uint32(odd[t]) << sixteen)


@njit(inline="always")
def _pack_rows(x, b, n, j0, cols, out):
    """VNNI B operand of ``A x[b, n, j0:j0+cols]`` (cols even): ``out[j2 * D + d] = (x[.., j0+2*j2, d],
    x[.., j0+2*j2+1, d])``, i.e. ``[cols/2, D]`` with row stride D."""
    D = x.shape[3]
    for j2 in range(cols // 2):
        _interleave(row_view(x, b, n, j0 + 2 * j2), row_view(x, b, n, j0 + 2 * j2 + 1), out, j2 * D, D)


@njit(inline="always")
def _rows_operand(x, b, n, j0, packed):
    """GEMM operand (address, ldb) of the B ``x[b, n, j0:j0+cols]`` (``[cols, D]``): float32 read in place,
    bfloat16 from its VNNI packing at address ``packed`` (:func:`_pack_rows`, row stride D)."""
    if not _pairs(x):
        return _matrix(x, b, n, j0)
    return packed, x.shape[3]


@njit(inline="always")
def _tile_operand(t, rows, cols, out):
    """GEMM operand (address, ldb) of the B ``t[:rows, :cols]`` of a 2-D tile: float32 in place, bfloat16 packed
    into out (:func:`_pack_tile`)."""
    if not _pairs(t):
        return _scratch(t)
    _pack_tile(t, rows, cols, out)
    return out.ctypes.data, cols


@njit(inline="always")
def _pack_tile(t, rows, cols, out):
    """VNNI B operand of ``A t[:rows, :cols]`` (a 2-D tile, rows even): ``[rows/2, cols]`` with row stride cols."""
    address, pitch = t.ctypes.data, t.strides[0]
    for r2 in range(rows // 2):  # rows from addresses (:func:`.numeric.array_at`), not views t[r]
        _interleave(array_at(address + 2 * r2 * pitch, cols, t.dtype),
                    array_at(address + (2 * r2 + 1) * pitch, cols, t.dtype), out, r2 * cols, cols)


@njit(**_KERNEL)
def _pack_kv_kernel(k, v, kr, rope, kt, vt, table, stream):
    """K and V key blocks (``_FWD_BK`` keys of a sequence of ``table``) packed for the forward's brgemm:
    ``kt[b, n2, g]`` the B of QK^T (:func:`_pack_transposed`; with ``rope`` the B of ``[Q | Q_rope] [K |
    K_rope]^T``: K_rope^T's rows after K^T's, a single k_rope head serving every head) and, for bfloat16,
    ``vt[b, n2, g]`` the B of PV (:func:`_pack_rows`; a block with an odd column count is left out: MKL takes
    it; float32 reads V in place); g counts the blocks of all sequences, sequence s's from ``table.rows[s, 4]``.
    ``stream``: K^T written around the caches where it can (a varlen batch's, too large for them)."""
    B, N2 = k.shape[:2]
    blocks = kt.shape[2]
    starts = np.ascontiguousarray(table.rows[:, 4])
    for task in prange(B * N2 * blocks):  # heads inner: a thread's tasks read a TND batch's K rows in memory order
        b, n2, g = _grid_index(task, N2, blocks, True)
        s = np.searchsorted(starts, g, side="right") - 1
        k0, k1 = table.rows[s, 2], table.rows[s, 3]
        j0 = (g - starts[s]) * _FWD_BK
        cols = min(_FWD_BK, k1 - k0 - j0)
        _pack_transposed(k, b, n2, k0 + j0, cols, kt[b, n2, g], stream)
        if rope:
            rope_rows = kt[b, n2, g][k.shape[3] * cols // _per_packed(k, kt):]
            _pack_transposed(kr, b, n2 if kr.shape[1] > 1 else 0, k0 + j0, cols, rope_rows, stream)
        if _pairs(v) and cols % 2 == 0:
            _pack_rows(v, b, n2, k0 + j0, cols, vt[b, n2, g])
        if stream:
            stream_fence()


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _forward_block(ops, plan, b, n, i0, rows, allow_skip, work):
    """Query rows [i0, i0 + rows) of (b, n) over all key blocks, into work.acc / m / l; returns True when keys
    were left out (``allow_skip``: tiles outside the visible region skipped, or cut to their visible columns,
    the edge tiles' included), so that a fully masked row must be redone over all keys. With ``allow_skip`` a
    tile across the visible region's edge (the causal diagonal) runs as tiles of _EDGE_ROWS rows, each cut to its
    visible columns."""
    plan = _unowned_plan(plan)
    k = ops.k
    acc = work.acc
    n2 = n // (ops.q.shape[1] // k.shape[1])
    Skv = k.shape[2]
    BK = _FWD_BK
    work.m[:] = -np.inf
    work.l[:] = 0.0
    skipped = False
    first = True  # the first computed tile sets acc: its old content is never read (its rescale by alpha = 0 is moot)
    if plan.has_sink:  # the sink: one more logit of every row, with no value (max starts at it, sum at 1)
        work.m[:] = plan.sink[n]
        work.l[:] = 1.0
        acc[:] = 0.0
        first = False
    for j0 in range(0, Skv, BK):
        block = min(BK, Skv - j0)  # the key block's width (the row stride of its packed K^T)
        cols = _visible_cols(i0, rows, j0, block, plan.nxt, plan.prefix[b]) if allow_skip else block
        skipped |= cols < block
        kind = _tile_kind(i0, rows, j0, cols, plan.pre, plan.nxt, plan.prefix[b])
        if cols == 0 or (kind == _OUTSIDE and allow_skip):
            skipped = True
            continue
        if kind != _PARTIAL or not allow_skip or rows <= _EDGE_ROWS:
            tile = Tile(b, n, i0, rows, j0, cols)
            if kind == _PARTIAL and allow_skip:
                tile, kind, lead = _visible_tile(b, n, i0, rows, j0, cols, plan.pre, plan.nxt, plan.prefix[b])
                skipped |= lead > 0
            _forward_visible_tile(ops, plan, work, tile, n2, block, kind, first)
            first = False
            continue
        if first:  # the edge tiles may leave rows of acc unwritten
            acc[:rows] = 0.0
            first = False
        for g0 in range(0, rows, _EDGE_ROWS):
            part = min(_EDGE_ROWS, rows - g0)
            part_cols = _visible_cols(i0 + g0, part, j0, block, plan.nxt, plan.prefix[b])
            part_tile, part_kind, lead = _visible_tile(b, n, i0 + g0, part, j0, part_cols, plan.pre, plan.nxt,
                                                       plan.prefix[b])
            skipped |= part_cols < block or lead > 0
            if part_tile.cols == 0 or part_kind == _OUTSIDE:
                skipped = True
                continue
            part_work = ForwardScratch(work.s[g0:], work.p[g0:], acc[g0:], work.m[g0:], work.l[g0:],
                                       _rows_from(work.qq, g0))
            _forward_visible_tile(ops, plan, part_work, part_tile, n2, block, part_kind, False)
    return skipped


@njit(inline="always")
def _forward_visible_tile(ops, plan, work, tile, n2, block, kind, first):
    """One tile of :func:`_forward_block` (rows from work's first, ``block``: the key block's width): S = QK^T
    (+ the rope part), the online-softmax update, acc (+)= P V (``first``: overwrite acc).

    ``ops.packed``: the two GEMMs run on the brgemm (bfloat16: key blocks with an even column count), the others
    on MKL."""
    q, v = ops.q, ops.v
    b, n, i0, rows, j0, cols = tile
    s, p, acc = work.s, work.p, work.acc
    BK = _FWD_BK
    on_brgemm = ops.packed and (block % 2 == 0 or not _pairs(q))
    lead = j0 % BK  # the key block's columns before the tile's first (:func:`_visible_tile`)
    kt = (row_address(ops.kt, b, n2, j0 // BK) + lead * ops.kt.itemsize, block)
    with_rope = on_brgemm and _packed_rope(ops)
    if with_rope:  # one product [Q | Q_rope] [K | K_rope]^T: K_rope^T is packed after K^T
        brgemm(q, rows, cols, work.qq.shape[3], _matrix(work.qq, 0, 0, 0), kt, _scratch(s), False)
    elif on_brgemm:
        brgemm(q, rows, cols, q.shape[3], _matrix(q, b, n, i0), kt, _scratch(s), False)
    else:
        gemm(q, NO_TRANS, TRANS, rows, cols, q.shape[3], _matrix(q, b, n, i0), _matrix(ops.k, b, n2, j0), _scratch(s),
             False)
    if ops.rope and not with_rope:
        _add_rope_scores(ops, tile, n2, s)
    _forward_tile(work, tile, plan.has_mask or kind != _INSIDE, plan)
    Dv = v.shape[3]
    mode = flush_denormals()  # P V with subnormals flushed: see the module docstring
    if on_brgemm:
        vp = _rows_operand(v, b, n2, j0, row_address(ops.vt, b, n2, j0 // BK) + lead * v.shape[3] * v.itemsize)
        brgemm(q, rows, Dv, cols, _scratch(p), vp, _scratch(acc), not first)
    else:
        gemm(q, NO_TRANS, NO_TRANS, rows, Dv, cols, _scratch(p), _matrix(v, b, n2, j0), _scratch(acc), not first)
    restore_float_mode(mode)


@njit(inline="always")
def _packed_rope(ops):
    """Whether the forward's packed key blocks hold K_rope^T after K^T (:func:`_forward_operands`): the tiles on
    the brgemm then take the rope part in their one score product, from the task's ``[Q | Q_rope]`` rows."""
    return ops.rope and ops.packed and ops.kt.shape[3] > _FWD_BK * ops.q.shape[3] // _per_packed(ops.q, ops.kt)


@njit(inline="always")
def _add_rope_scores(ops, tile, n2, s):
    """s += q_rope k_rope^T over the tile (the rope parts' share of the scores, a second GEMM into the same fp32
    tile: no concatenated copy of Q and K); a single k_rope head serves every head."""
    qr, kr = ops.qr, ops.kr
    b, n, i0, rows, j0, cols = tile
    nr = n2 if kr.shape[1] > 1 else 0
    gemm(qr, NO_TRANS, TRANS, rows, cols, qr.shape[3], _matrix(qr, b, n, i0), _matrix(kr, b, nr, j0), _scratch(s),
         True)


@njit(inline="always")
def _add_packed_rope_scores(ops, tile, kt, s):
    """:func:`_add_rope_scores` on the brgemm: K_rope^T from the rows after K^T's in the packed ``[K | K_rope]^T``
    block ``kt`` (address, width; :func:`_pack_key_block`)."""
    q, qr = ops.q, ops.qr
    b, n, i0, rows, _, cols = tile
    address, block = kt
    brgemm(q, rows, cols, qr.shape[3], _matrix(qr, b, n, i0), (address + q.shape[3] * q.itemsize * block, block),
           _scratch(s), True)


@njit(inline="always")
def _forward_task(ops, plan, out, smax, ssum, b, n, i0, work):
    """Query rows ``[i0, i0 + _BQ)`` of (b, n) into out ``[B, N1, Sq, Dv]``, smax / ssum ``[B, N1, Sq]`` fp32, on
    the thread's scratch ``work`` (:func:`_forward_scratch`)."""
    rows = min(_BQ, ops.q.shape[2] - i0)
    Dv = ops.v.shape[3]
    m, l, acc = work.m, work.l, work.acc
    if _packed_rope(ops):
        _concatenate_rows(ops.q, ops.qr, b, n, n, i0, rows, work.qq)
    # once skipping keys, then (redo) over all keys where a row turned out fully masked: it sums exp(0) over ALL
    # keys. ``not redo`` is a bool, not a bool literal: _forward_block compiles once for both passes
    redo = False
    while (_forward_block(ops, plan, b, n, i0, rows, not redo, work) and not redo and not plan.invalid_rows
           and _dead_row(m, rows)):
        redo = True
    if ops.packed:
        brgemm_release()
    for r in range(rows):
        outr = row_view(out, b, n, i0 + r)  # a C row: the loops vectorise for any strides of out
        dead = not m[r] > _NEG
        if dead and plan.invalid_rows:
            smax[b, n, i0 + r] = _NEG
            ssum[b, n, i0 + r] = _FLT_MAX
            for d in range(Dv):
                outr[d] = narrow(np.float32(0.0), out)
            continue
        smax[b, n, i0 + r] = m[r]
        ssum[b, n, i0 + r] = l[r]
        inv = np.float32(1.0) / l[r]
        for d in range(Dv):
            outr[d] = narrow(acc[r, d] * inv, out)


@njit(inline="always")
def _forward_scratch(ops):
    """A thread's :class:`ForwardScratch`, reused by its tasks."""
    q = ops.q
    qq = (1, 1, _BQ, q.shape[3] + ops.qr.shape[3]) if _packed_rope(ops) else (1, 1, 1, 1)
    return ForwardScratch(aligned_empty((_BQ, _FWD_BK + _ROW_PAD // 4), np.float32),
                          aligned_empty((_BQ, _FWD_BK + _ROW_PAD // q.itemsize), q.dtype),
                          aligned_empty((_BQ, ops.v.shape[3]), np.float32), aligned_empty((_BQ,), np.float32),
                          aligned_empty((_BQ,), np.float32), aligned_empty(qq, q.dtype))


@njit(inline="always")
def _forward_sequence(ops, table, s):
    """The :class:`ForwardOperands` of sequence s of ``table``: views of its rows and packed key blocks."""
    q0, q1, k0, k1, kb0 = table.rows[s, 0], table.rows[s, 1], table.rows[s, 2], table.rows[s, 3], table.rows[s, 4]
    return ForwardOperands(ops.q[:, :, q0:q1], ops.k[:, :, k0:k1], ops.v[:, :, k0:k1], ops.kt[:, :, kb0:],
                           ops.vt[:, :, kb0:], ops.packed, ops.qr[:, :, q0:q1], ops.kr[:, :, k0:k1], ops.rope)


@njit(**_KERNEL)
def _forward_kernel(worker, ops, plan, out, smax, ssum, table, tasks, next_task, workers):
    """Runs :func:`_forward_worker` (at address ``worker``) with these arguments on ``workers`` threads at once
    (:func:`.layouts.launch_workers`)."""
    for _ in prange(workers):
        call_native(worker, (ops, plan, out, smax, ssum, table, tasks, next_task))


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _forward_worker(ops, plan, out, smax, ssum, table, tasks, next_task):
    """The forward on one thread of :func:`_forward_kernel`: out ``[B, N1, S, Dv]``, smax / ssum ``[B, N1, S]`` fp32
    (written in place) for the sequences of ``table`` (:class:`SequenceTable`, the packed K / V blocks of
    :func:`_pack_kv_kernel`); ``tasks`` int64 ``[T, 4]``: (sequence, b, n1, first row of a query block), claimed in
    that order from ``next_task`` by the threads until none is left (:func:`.threads.claim`;
    :func:`_forward_tasks`)."""
    work = _forward_scratch(ops)
    t = claim(next_task)
    while t < tasks.shape[0]:
        s = tasks[t, 0]
        q0, q1 = table.rows[s, 0], table.rows[s, 1]
        _forward_task(_forward_sequence(ops, table, s), _sequence_plan(plan, table, s), out[:, :, q0:q1],
                      smax[:, :, q0:q1], ssum[:, :, q0:q1], tasks[t, 1], tasks[t, 2], tasks[t, 3], work)
        t = claim(next_task)


@njit(**_KERNEL)
def _row_dot_kernel(dy, out, dr):
    """dr[b, n, i] = sum_d dy[b, n, i, d] * out[b, n, i, d] in fp32 (over :func:`.numeric.row_view` views: the same
    vectorised summation order for any strides of dy and out)."""
    B, N, S, Dv = dy.shape
    for row in prange(B * N * S):
        b, n, i = _row_index(row, dy)
        dyr, outr = row_view(dy, b, n, i), row_view(out, b, n, i)
        acc = np.float32(0.0)
        for d in range(Dv):
            acc += widen(dyr[d]) * widen(outr[d])
        dr[b, n, i] = acc


@njit(**_KERNEL)
def _copy_kernel(x, out, stream):
    """out[b, n, s, :] = x[b, n, s, :] (out C-contiguous, of x's type or float32: widened; x's rows unit-stride,
    any other strides), in tasks of 64 rows, each row written by :func:`.numeric.copy_row` (``stream``: around the
    caches), a widened one from a row buffer of the task's."""
    B, N, S, D = x.shape
    rows, step = B * N * S, 4 * TRANSPOSE_BLOCK
    for task in prange((rows + step - 1) // step):
        buffer = aligned_empty((D,), np.float32)
        for row in range(task * step, min(rows, task * step + step)):
            b, n, i = _row_index(row, x)
            if x.itemsize == out.itemsize:
                copy_row(row_address(out, b, n, i), row_address(x, b, n, i), D * x.itemsize, stream)
            else:
                source = row_view(x, b, n, i)
                for d in range(D):
                    buffer[d] = widen(source[d])
                copy_row(row_address(out, b, n, i), buffer.ctypes.data, D * 4, stream)
        if stream:
            stream_fence()


@njit(**_KERNEL)
def _transpose_kernel(x, out, stream):
    """out[b, n, d, s] = x[b, n, s, d] (out: unit-stride rows; x any strides), in tasks of ``stripe`` rows of one
    (b, n): by :func:`.numeric.transpose_matrix` where x's rows are unit-stride (``stream``: written around the
    caches where it can), else element by element."""
    B, N, S, D = x.shape
    stripe = 4 * TRANSPOSE_BLOCK
    stripes = (S + stripe - 1) // stripe
    for task in prange(B * N * stripes):  # in x's memory order
        b, n, t = _grid_index(task, N, stripes, x.strides[1] < x.strides[2])
        s0 = t * stripe
        rows = min(stripe, S - s0)
        if x.strides[3] == x.itemsize:
            transpose_matrix(row_address(x, b, n, s0), x.strides[2], row_address(out, b, n, 0) + s0 * out.itemsize,
                             out.strides[2], rows, D, x, stream)
            if stream:
                stream_fence()
        else:
            for d in range(D):
                for i in range(s0, s0 + rows):
                    out[b, n, d, i] = x[b, n, i, d]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _backward_tile(work, tile, general, plan, ops, dpse):
    """work.s holds QK^T, work.dp dY V^T: P = exp(S - max) * (1 / sum); Pd = P M / keep_prob -> work.pt and
    dS = P (dP M / keep_prob - Dr) -> work.s (fp32) and work.dst (input dtype, :func:`_store_ds`); with
    ``plan.dpse`` dS (times scale for pse_type 1) is added by :func:`_add_dpse_row`. Tiles without a mask to
    test keep s raw and form the logit inside the exp sweep (scale, and a dense pse's or a generated alibi's term:
    :func:`_dense_pse_row`, :func:`_alibi_terms`); the others get it from :func:`_modify_scores`. Runs with
    subnormals flushed unless it computes dpse (:func:`_backward_visible_tile`)."""
    prefer_512_bit_vectors()
    s, dp, pt, dst = work.s, work.dp, work.pt, work.dst
    smax, ssum, dr = ops.smax, ops.ssum, ops.dr
    b, n, i0, rows, _, cols = tile
    alibi = _alibi_terms(tile, plan)
    raw = not general and plan.pse_kind != _PSE_COMPRESSED
    scale = plan.scale if raw else np.float32(1.0)
    f = aligned_empty((cols,), np.float32)
    if not plan.dropout:
        f[:] = np.float32(1.0)
    for r in range(rows):
        i = i0 + r
        mr = smax[b, n, i]
        inv_l = np.float32(1.0) / ssum[b, n, i]
        dri = dr[b, n, i]
        if not raw:
            _modify_scores(s, r, tile, general, plan, alibi)
        if plan.dropout:
            _row_keep_factors(plan, tile, r, f)
        if raw and alibi.size > 0:
            terms = alibi[rows - 1 - r:]
            for c in range(cols):
                _score_gradient(s, dp, pt, dst, r, c, s[r, c] * scale + terms[c], f[c], mr, inv_l, dri, plan)
        elif raw and plan.pse_kind == _PSE_DENSE:
            source = _dense_pse_row(tile, r, plan)
            for c in range(cols):
                z = _pse_logit(s[r, c], widen(source[c]), scale, plan.pse_first)
                _score_gradient(s, dp, pt, dst, r, c, z, f[c], mr, inv_l, dri, plan)
        elif plan.dropout:
            for c in range(cols):
                _score_gradient(s, dp, pt, dst, r, c, s[r, c] * scale, f[c], mr, inv_l, dri, plan)
        else:
            for c in range(cols):
                _score_gradient(s, dp, pt, dst, r, c, s[r, c] * scale, np.float32(1.0), mr, inv_l, dri, plan)
        if plan.dpse and mr > _NEG:
            _add_dpse_row(s, r, tile, plan, dpse)


@njit(inline="always", fastmath=FASTMATH)
def _score_gradient(s, dp, pt, dst, r, c, z, keep, mr, inv_l, dri, plan):
    """Element (r, c) of :func:`_backward_tile` from its logit z and dropout factor ``keep``."""
    pr = exp2_32((z - mr) * LOG2E) * inv_l
    pt[r, c] = _operand(pr * keep, plan.probs_like, pt)
    s[r, c] = pr * (dp[r, c] * keep - dri)
    _store_ds(s, r, c, plan.probs_like, dst)


def _store_ds(s, r, c, like, dst):  # pragma: no cover - compiled through the overload below
    """``dst[r, c]`` = dS ``s[r, c]`` as the GEMMs take it (:func:`_operand`); nothing where they take s itself
    (:func:`_ds_tile`)."""
    raise NotImplementedError


@overload(_store_ds, inline="always")
def _store_ds_impl(s, r, c, like, dst):
    if _ds_in_place(like, dst):
        return lambda s, r, c, like, dst: None

    def store(s, r, c, like, dst):
        dst[r, c] = _operand(s[r, c], like, dst)
    return store


def _ds_in_place(like, dst):
    """(Typing time) whether the gradient GEMMs take dS from the fp32 tile s itself: float32 operands (dst) that
    are not rounded to another type (``like``), so that a copy would hold the same bits."""
    return dst.dtype == types.float32 and like.dtype == types.float32


def _ds_tile(work, like):  # pragma: no cover - compiled through the overload below
    """The dS operand tile of the gradient GEMMs: work.s where :func:`_ds_in_place`, else work.dst."""
    raise NotImplementedError


@overload(_ds_tile, inline="always")
def _ds_tile_impl(work, like):
    if _ds_in_place(like, work.types[work.fields.index("dst")]):
        return lambda work, like: work.s
    return lambda work, like: work.dst


def _ds_scratch(q, like):  # pragma: no cover - compiled through the overload below
    """A backward task's dS operand tile (``[_BQ, _BK]`` of q's type), a placeholder where :func:`_ds_in_place`."""
    raise NotImplementedError


@overload(_ds_scratch, inline="always")
def _ds_scratch_impl(q, like):
    if _ds_in_place(like, q):
        return lambda q, like: aligned_empty((1, 1), q.dtype)
    return lambda q, like: aligned_empty((_BQ, _BK), q.dtype)


@njit(inline="always", fastmath=FASTMATH)
def _add_dpse_row(s, r, tile, plan, dpse):
    """dS of row r of the tile (times scale for pse_type 1) added into the fp32 accumulator of pse's own shape
    (or the dpse output itself, see :func:`_dpse_target`), where logit (b, n, i, j) read its pse:
    ``dpse[b or 0, n, i or 0, j]``, or for the alibi-compressed form the stored element of
    :func:`_compressed_source`, keys ``j <= i`` only (the causal part; the others are masked). Rows whose max is
    the fully-masked fill are skipped by the caller (their logits do not depend on pse)."""
    b, n, i0, _, j0, cols = tile
    i = i0 + r
    factor = plan.scale if plan.pse_first else np.float32(1.0)
    bp = b if dpse.shape[0] > 1 else 0
    if plan.pse_kind == _PSE_COMPRESSED:
        row, off = _compressed_source(i, plan.sq, dpse.shape[2], dpse.shape[3])
        out = row_view(dpse, bp, n, row)
        for c in range(max(min(cols, i - j0 + 1), 0)):
            out[j0 + c + off] += s[r, c] * factor
        return
    out = _row_part(dpse, bp, n, i if dpse.shape[2] > 1 else 0, j0, cols)
    for c in range(cols):  # widen/narrow: identity on an fp32 accumulator; rounding on a direct output
        out[c] = narrow(widen(out[c]) + s[r, c] * factor, dpse)


@njit(inline="always")
def _concatenate_rows(x, xr, b, n, nr, r0, count, out):
    """``out[0, 0, t] = [x[b, n, r0 + t], xr[b, nr, r0 + t]]`` for t < count: rows of ``[x | x_rope]``, each
    part by :func:`.numeric.copy_row` (wide moves; see docs/performance.md, 'MLA rope and attention sink')."""
    head, tail = x.shape[3] * x.itemsize, xr.shape[3] * xr.itemsize
    for t in range(count):
        to = row_address(out, 0, 0, t)
        copy_row(to, row_address(x, b, n, r0 + t), head, False)
        copy_row(to + head, row_address(xr, b, nr, r0 + t), tail, False)


@njit(inline="always")
def _key_rows(ops, work, b, n2, j0, cols):
    """``(x, b, n, j)``: the key block's rows as the backward's GEMMs read them, ``x[b, n, j:j + cols]``: k itself, or
    with rope the block's ``[K | K_rope]`` rows copied into work.kk (a single k_rope head serves every head)."""
    if not ops.rope:
        return ops.k, b, n2, j0
    _concatenate_rows(ops.k, ops.kr, b, n2, n2 if ops.kr.shape[1] > 1 else 0, j0, cols, work.kk)
    return work.kk, 0, 0, 0


@njit(inline="always")
def _query_rows(ops, work, tile, on_brgemm):
    """``(x, b, n, i)``: the tile's query rows as :func:`_key_rows` gives the keys: q itself, or with rope on MKL
    the tile's ``[Q | Q_rope]`` rows copied into work.qq. The brgemm reads operands packed or copied once instead
    (:func:`_score_gemms`: a second call adds the rope scores; :func:`_gradient_gemms`: ``[Q | Q_rope]^T``), where a
    per-tile copy, and the transposed one its dK^T needs, would cost more than the call."""
    b, n, i0, rows, _, _ = tile
    if not ops.rope or on_brgemm:
        return ops.q, b, n, i0
    _concatenate_rows(ops.q, ops.qr, b, n, n, i0, rows, work.qq)
    return work.qq, 0, 0, 0


@njit(inline="always")
def _pack_key_block(keys, v, b, n2, j0, cols, work):
    """The key block's B operands of the backward's brgemm (:func:`_score_gemms`, :func:`_gradient_gemms`): K^T
    for S, V^T for dP and (bfloat16) K for dQ; ``keys`` from :func:`_key_rows`."""
    x, kb, kn, kj = keys
    _pack_transposed(x, kb, kn, kj, cols, work.kt)
    _pack_transposed(v, b, n2, j0, cols, work.vt)
    if _pairs(x):
        _pack_rows(x, kb, kn, kj, cols, work.k_pairs)


@njit(inline="always")
def _score_gemms(ops, tile, n2, queries, keys, lead, on_brgemm, work):
    """work.s = Q K^T and work.dp = dY V^T of the tile (fp32, row stride BK); Q and K as :func:`_query_rows` and
    :func:`_key_rows` give them (with rope ``[Q | Q_rope] [K | K_rope]^T``); the tile starts ``lead`` columns into
    the key block (:func:`_visible_tile`)."""
    q, v, dy = ops.q, ops.v, ops.dy
    b, n, i0, rows, j0, cols = tile
    x, qb, qn, qi = queries
    y, kb, kn, kj = keys
    dqk = x.shape[3]
    qp, dyp = _matrix(x, qb, qn, qi), _matrix(dy, b, n, i0)
    if on_brgemm:
        block = min(work.s.shape[1], v.shape[2] - j0 + lead)  # the packed K^T / V^T row stride: the block's width
        kt = (work.kt.ctypes.data + lead * work.kt.itemsize, block)
        brgemm(q, rows, cols, dqk, qp, kt, _scratch(work.s), False)
        if ops.rope:
            _add_packed_rope_scores(ops, tile, kt, work.s)
        brgemm(q, rows, cols, v.shape[3], dyp, (work.vt.ctypes.data + lead * work.vt.itemsize, block),
               _scratch(work.dp), False)
    else:
        gemm(q, NO_TRANS, TRANS, rows, cols, dqk, qp, _matrix(y, kb, kn, kj + lead), _scratch(work.s), False)
        gemm(q, NO_TRANS, TRANS, rows, cols, v.shape[3], dyp, _matrix(v, b, n2, j0), _scratch(work.dp), False)


@njit(inline="always")
def _per_packed(q, packed):
    """Input elements per element of a packed brgemm operand (2: bfloat16 VNNI pairs in uint32)."""
    return packed.itemsize // q.itemsize


@njit(inline="always")
def _gradient_gemms(ops, tile, queries, keys, lead, on_brgemm, work, dq_ptr, dq_adds, like):
    """dV^T += dY^T Pd, dK^T += Q^T dS (fp32 ``[D, BK]`` accumulators work.dvt / work.dkt, from their column
    ``lead``) and dQ (+)= dS K (fp32 at dq_ptr, row stride D; ``dq_adds`` False: written), Q, K and ``lead`` as in
    :func:`_score_gemms` (with rope dK^T and dQ have D + Dr rows / columns); dS from :func:`_ds_tile` (``like``:
    the plan's ``probs_like``).

    On the brgemm the A operands dY^T and ``[Q | Q_rope]^T`` come from the transposed copies ``ops.dyt``, ``ops.qt``
    (one dK^T product of depth D + Dr); bfloat16 Pd, dS are packed (:func:`_tile_operand`) and K comes packed by
    :func:`_pack_key_block`."""
    q, dy = ops.q, ops.dy
    b, n, i0, rows, _, cols = tile
    pt, dst = work.pt, _ds_tile(work, like)
    dkt = (work.dkt.ctypes.data + lead * work.dkt.itemsize, work.dkt.shape[1])
    dvt = (work.dvt.ctypes.data + lead * work.dvt.itemsize, work.dvt.shape[1])
    x, qb, qn, qi = queries
    y, kb, kn, kj = keys
    Dv, dqk = dy.shape[3], y.shape[3]
    dq = (dq_ptr, dqk)
    if on_brgemm:
        pd_operand = _tile_operand(pt, rows, cols, work.pt_pairs)
        ds_operand = _tile_operand(dst, rows, cols, work.dst_pairs)
        brgemm(q, Dv, cols, rows, _columns(ops.dyt, b, n, i0), pd_operand, dvt, True)
        brgemm(q, dqk, cols, rows, _columns(ops.qt, b, n, i0), ds_operand, dkt, True)
        k_rows = _rows_operand(y, kb, kn, kj + lead, work.k_pairs.ctypes.data + lead * dqk * y.itemsize)
        brgemm(q, rows, dqk, cols, _scratch(dst), k_rows, dq, dq_adds)
    else:
        gemm(q, TRANS, NO_TRANS, Dv, cols, rows, _matrix(dy, b, n, i0), _scratch(pt), dvt, True)
        gemm(q, TRANS, NO_TRANS, dqk, cols, rows, _matrix(x, qb, qn, qi), _scratch(dst), dkt, True)
        gemm(q, NO_TRANS, NO_TRANS, rows, dqk, cols, _scratch(dst), _matrix(y, kb, kn, kj + lead), dq, dq_adds)


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _backward_key_block(ops, plan, grads, work, b, n2, j0, chunk):
    """dK^T / dV^T of keys [j0, j0+BK) of (b, n2) into work.dkt / work.dvt, over the G query heads and all query
    blocks; dQ into grads.dq_acc[chunk], dpse into grads.dpse.

    ``ops.packed``: on torch's brgemm (:func:`_use_brgemm`; bfloat16: tiles with even rows and columns, VNNI
    pairs), MKL for the others."""
    plan = _unowned_plan(plan)
    q, k = ops.q, ops.k
    N1, Sq = q.shape[1], q.shape[2]
    G = N1 // k.shape[1]
    Skv = k.shape[2]
    BQ, BK = work.s.shape
    cols = min(BK, Skv - j0)
    work.dkt[:] = 0.0
    work.dvt[:] = 0.0
    packed = ops.packed and (cols % 2 == 0 or not _pairs(q))
    keys = _key_rows(ops, work, b, n2, j0, cols)
    if packed:
        _pack_key_block(keys, ops.v, b, n2, j0, cols, work)
    for n in range(n2 * G, n2 * G + G):
        for i0 in range(0, Sq, BQ):
            rows = min(BQ, Sq - i0)
            # a tile across the visible region's edge (the causal diagonal) runs as tiles of _EDGE_ROWS rows, each
            # cut to its visible columns (3/8 of a causal diagonal tile is then skipped)
            kind = _tile_kind(i0, rows, j0, cols, plan.pre, plan.nxt, plan.prefix[b])
            step = _EDGE_ROWS if kind == _PARTIAL else rows
            for g0 in range(i0, i0 + rows, step):
                tile = Tile(b, n, g0, min(step, i0 + rows - g0), j0, cols)
                _backward_visible_tile(ops, plan, grads, work, keys, packed, tile, n2, chunk)


@njit(inline="always")
def _backward_visible_tile(ops, plan, grads, work, keys, packed, tile, n2, chunk):
    """The five GEMMs and the dS of a tile of :func:`_backward_key_block`, cut to the columns that hold visible
    keys (:func:`_visible_cols`, :func:`_visible_tile`) and skipped when none is, unless a row of it is fully masked
    (its P is then exp(0) / sum over all keys, :func:`_dead_row`)."""
    b, n, i0, rows, j0, cols = tile
    dead = _dead_row(ops.smax[b, n, i0:], rows)
    lead = 0
    if dead:
        kind = _tile_kind(i0, rows, j0, cols, plan.pre, plan.nxt, plan.prefix[b])
    else:
        cols = _visible_cols(i0, rows, j0, cols, plan.nxt, plan.prefix[b])
        if cols == 0:
            return
        tile, kind, lead = _visible_tile(b, n, i0, rows, j0, cols, plan.pre, plan.nxt, plan.prefix[b])
        if kind == _OUTSIDE or tile.cols == 0:
            return  # P = exp(-FLT_MAX - max) = 0 on the whole tile
    on_brgemm = packed and (rows % 2 == 0 or not _pairs(ops.q))
    queries = _query_rows(ops, work, tile, on_brgemm)
    _score_gemms(ops, tile, n2, queries, keys, lead, on_brgemm, work)
    # subnormals flushed (:func:`.numeric.flush_denormals`) from the sweep on, or from its products on when the
    # sweep computes dpse, a user-visible output
    mode = flush_denormals() if not plan.dpse else np.uint32(0)
    _backward_tile(work, tile, plan.has_mask or kind != _INSIDE, plan, ops, grads.dpse)
    if plan.dpse:
        mode = flush_denormals()
    dq_ptr = _accumulator_row(grads.dq_acc, chunk, b, n, i0).ctypes.data
    _gradient_gemms(ops, tile, queries, keys, lead, on_brgemm, work, dq_ptr, _dq_adds(grads, chunk, b, n, i0, rows),
                    plan.probs_like)
    restore_float_mode(mode)


@njit(inline="always")
def _dq_adds(grads, chunk, b, n, i0, rows):
    """Whether the dQ product of query rows [i0, i0 + rows) of (b, n) adds into ``grads.dq_acc[chunk]`` (True) or
    writes it (False: no group of _EDGE_ROWS rows it covers holds a sum yet). A tile that covers written and unwritten
    groups zeroes the unwritten ones' rows first. Marks the groups written."""
    written = grads.dq_written
    g0, g1 = i0 // _EDGE_ROWS, (i0 + rows - 1) // _EDGE_ROWS + 1
    count = 0
    for g in range(g0, g1):
        count += written[chunk, b, n, g]
    if 0 < count < g1 - g0:
        for g in range(g0, g1):
            if written[chunk, b, n, g] == 0:
                for i in range(max(g * _EDGE_ROWS, i0), min((g + 1) * _EDGE_ROWS, i0 + rows)):
                    _accumulator_row(grads.dq_acc, chunk, b, n, i)[:] = 0.0
    written[chunk, b, n, g0:g1] = 1
    return count > 0


@njit(inline="always")
def _backward_scratch(q, d, dv, dr, packed, pack_like, probs_like):
    """A backward task's :class:`BackwardScratch` (``dr``: the rope dim, 0 without rope); the packed operands have
    ``pack_like``'s element type (uint32 VNNI pairs for bfloat16, else float32); ``probs_like``: the type P and dS
    are rounded to (:class:`KernelPlan`); unused buffers are 1-element placeholders."""
    dqk = d + dr
    per = _per_packed(q, pack_like)
    block = max(dqk, dv) * _BK // per if packed else 1
    pairs = block if per == 2 else 1  # K rows and the Pd / dS tiles are packed for VNNI pairs only
    tile = _BQ * _BK // per if packed and per == 2 else 1
    like = pack_like.dtype
    # the rope copies kk, qq; qq serves the tiles on MKL, in a packed bfloat16 call too (odd rows or columns)
    rows = (_BK, _BQ) if dr else (1, 1)
    return BackwardScratch(aligned_empty((_BQ, _BK), np.float32), aligned_empty((_BQ, _BK), np.float32),
                           aligned_empty((_BQ, _BK), q.dtype), _ds_scratch(q, probs_like),
                           aligned_empty((dqk, _BK), np.float32), aligned_empty((dv, _BK), np.float32),
                           aligned_empty((block,), like), aligned_empty((block,), like),
                           aligned_empty((pairs,), like), aligned_empty((tile,), like), aligned_empty((tile,), like),
                           aligned_empty((1, 1, rows[0], dqk), q.dtype), aligned_empty((1, 1, rows[1], dqk), q.dtype))


@njit(inline="always")
def _backward_operands(ops, table, s):
    """Sequence s's :class:`BackwardOperands`: views of its rows."""
    q0, q1, k0, k1 = table.rows[s, 0], table.rows[s, 1], table.rows[s, 2], table.rows[s, 3]
    return BackwardOperands(ops.q[:, :, q0:q1], ops.k[:, :, k0:k1], ops.v[:, :, k0:k1], ops.dy[:, :, q0:q1],
                            ops.qt[..., q0:q1], ops.dyt[..., q0:q1], ops.smax[:, :, q0:q1], ops.ssum[:, :, q0:q1],
                            ops.dr[:, :, q0:q1], ops.packed, ops.qr[:, :, q0:q1], ops.kr[:, :, k0:k1], ops.rope)


@njit(inline="always")
def _sequence_gradients(grads, table, s):
    """Sequence s's :class:`Gradients`: views of its key rows, its dQ slices, their written flags and dpse target
    from the table."""
    k0, k1 = table.rows[s, 2], table.rows[s, 3]
    arrays = table.arrays[s]
    e = len(_PLAN_ARRAYS)  # the backward's arrays follow the plan's
    return Gradients(_table_array(grads.dq_acc, arrays[e]), _table_array(grads.dq_written, arrays[e + 1]),
                     grads.dk[:, :, k0:k1], grads.dv[:, :, k0:k1], _table_array(grads.dpse, arrays[e + 2]),
                     grads.dkr[:, :, k0:k1])


@njit(inline="always")
def _backward_task(ops, plan, grads, work, bt, batch_tasks, n2, chunk, kb0, kb1):
    """Key chunk ``chunk`` (key blocks kb0 to kb1 - 1) of kv head n2 for the batches ``bt, bt + batch_tasks, ...``
    in order, key block by key block: dk / dv written, dQ (into ``grads.dq_acc[chunk]``) and dpse summed into."""
    B, _, Skv, _ = ops.k.shape
    for kb in range(kb0, kb1):
        j0 = kb * _BK
        for b in range(bt, B, batch_tasks):
            _backward_key_block(ops, plan, grads, work, b, n2, j0, chunk)
            cols = min(_BK, Skv - j0)
            _write_transposed(work.dkt, cols, plan.scale, grads.dk, grads.dkr, ops.rope, b, n2, j0, work.s)
            _write_transposed(work.dvt, cols, np.float32(1.0), grads.dv, grads.dkr, False, b, n2, j0, work.s)


@njit(inline="always")
def _write_transposed(acc, cols, scale, out, tail, has_tail, b, n, j0, scratch):
    """Rows j0 .. j0 + cols of ``out[b, n]`` = the fp32 accumulator ``acc`` ``[W, BK]`` transposed, times scale,
    rounded to out's dtype; with ``has_tail`` its rows past out's D go unrounded into ``tail[b, n]`` (dK_rope).
    Keys go 16 at a time through ``scratch`` (room for ``[16, W]`` fp32) by :func:`.numeric.transpose_matrix`,
    where reading acc's columns one by one would take a strided load per element."""
    W, D = acc.shape[0], out.shape[3]
    for r0 in range(0, cols, TRANSPOSE_BLOCK):
        count = min(TRANSPOSE_BLOCK, cols - r0)
        transpose_matrix(acc.ctypes.data + r0 * acc.itemsize, acc.strides[0], scratch.ctypes.data, W * 4, W, count,
                         acc)
        for r in range(count):
            source = array_at(scratch.ctypes.data + r * W * 4, W, np.float32)
            row = row_view(out, b, n, j0 + r0 + r)
            for d in range(D):
                row[d] = narrow(source[d] * scale, out)
            if has_tail:
                rope = row_view(tail, b, n, j0 + r0 + r)
                for d in range(W - D):
                    rope[d] = source[D + d] * scale


@njit(**_KERNEL)
def _backward_kernel(worker, ops, plan, grads, pack_like, table, tasks, next_task, workers):
    """Runs :func:`_backward_worker` (at address ``worker``) with these arguments on ``workers`` threads at once
    (:func:`.layouts.launch_workers`)."""
    for _ in prange(workers):
        call_native(worker, (ops, plan, grads, pack_like, table, tasks, next_task))


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _backward_worker(ops, plan, grads, pack_like, table, tasks, next_task):
    """The backward on one thread of :func:`_backward_kernel`: grads.dk / grads.dv (written in place) and the dQ
    slices / dpse of the sequences of ``table`` (summed into). ``tasks`` int64 ``[T, 6]``: (sequence, bt, n2, chunk,
    first key block, end key block), claimed in that order from ``next_task`` by the threads until none is left
    (:func:`.threads.claim`; :func:`_backward_tasks`); a task runs :func:`_backward_task` with the sequence's
    batch_tasks (1: a batch-broadcast dpse is summed over b in one task). ``pack_like``: an array of the packed
    operands' element type."""
    work = _backward_scratch(ops.q, ops.k.shape[3], ops.v.shape[3], ops.qr.shape[3] if ops.rope else 0, ops.packed,
                             pack_like, plan.probs_like)
    t = claim(next_task)
    while t < tasks.shape[0]:
        s = tasks[t, 0]
        _backward_task(_backward_operands(ops, table, s), _sequence_plan(plan, table, s),
                       _sequence_gradients(grads, table, s), work, tasks[t, 1], table.rows[s, 5], tasks[t, 2],
                       tasks[t, 3], tasks[t, 4], tasks[t, 5])
        t = claim(next_task)
    if ops.packed:
        brgemm_release()


@njit(inline="always")
def _accumulator_row(dq_acc, c, b, n, i):
    """``dq_acc[c, b, n, i, :]`` of the C-contiguous dQ slices as a C row."""
    _, B, N, S, W = dq_acc.shape
    return array_at(dq_acc.ctypes.data + (((c * B + b) * N + n) * S + i) * W * dq_acc.itemsize, W, dq_acc.dtype)


@njit(**_KERNEL)
def _finish_dq_kernel(dq_acc, written, scale, dq, dq_rope):
    """dq = scale * sum over chunks (in chunk order) of dq_acc's first D columns, dq_rope (with rope: its trailing
    columns; else a placeholder) from the others, each rounded once to its dtype; a chunk whose row group was not
    written (``written``, :class:`Gradients`) adds nothing. The sums are taken in place in the first written slice,
    vectorised along the row; a row no chunk wrote is 0."""
    chunks, B, N, S, W = dq_acc.shape
    D = dq.shape[3]
    for row in prange(B * N * S):
        b, n, i = _row_index(row, dq)
        g = i // _EDGE_ROWS
        first = 0
        while first < chunks and written[first, b, n, g] == 0:
            first += 1
        total = _accumulator_row(dq_acc, min(first, chunks - 1), b, n, i)
        if first == chunks:  # no chunk wrote the row (every tile of it skipped): its dQ is 0
            total[:] = 0.0
        for c in range(first + 1, chunks):
            if written[c, b, n, g] != 0:
                part = _accumulator_row(dq_acc, c, b, n, i)
                for d in range(W):
                    total[d] += part[d]
        dqr = row_view(dq, b, n, i)
        for d in range(D):
            dqr[d] = narrow(total[d] * scale, dq)
        if W > D:
            ropes = row_view(dq_rope, b, n, i)
            for d in range(W - D):
                ropes[d] = narrow(total[D + d] * scale, dq_rope)


def _view(t: torch.Tensor, in_place: bool = False) -> np.ndarray:
    """Kernel view of t: a C-contiguous copy unless t already is one (on :func:`.tensor_view.new_output` memory: a
    large copy reuses pages of the previous call's), or, with ``in_place``, t itself when its rows are unit-stride
    and do not overlap (a TND batch seen as BNSD: the GEMMs read ``[S, D]`` matrices with leading dimension
    stride(-2)). In-place views are for the varlen layer and preallocated outputs; the kernels compile one
    specialisation for any strides (:func:`.layouts.launch_strided`)."""
    unit_rows = t.stride(-1) == 1 or t.shape[-1] == 1
    if not (in_place and unit_rows and (t.shape[-2] == 1 or t.stride(-2) >= t.shape[-1])) and not t.is_contiguous():
        t = _contiguous_copy(t, t.dtype)
    return kernel_view(t)


def _contiguous_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A C-contiguous copy of t in ``dtype`` (t's own or float32) on :func:`.tensor_view.new_output` memory. One too
    large for the caches (:func:`.numeric.streams`) of a ``[B, N, S, D]`` t with unit-stride rows is written by
    :func:`_copy_kernel` with non-temporal stores (a varlen batch's TND rows), others by torch."""
    out = new_output(t.shape, dtype)
    if t.dim() == 4 and t.stride(-1) == 1 and streams(out.nbytes):
        _copy_kernel(kernel_view(t), kernel_view(out), True)
    else:
        out.copy_(t)
    return out


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """A preallocated output: any strides but a unit-stride last dim (the kernels write its rows as
    :func:`.numeric.row_view`)."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"an output's last dim must be unit-stride, got strides {t.stride()}")
    return t


def _pse_kind(plan: AttentionPlan) -> int:
    if plan.pse is None:
        return _PSE_NONE
    if plan.pse_type in (2, 3):
        return _PSE_ALIBI if plan.pse_type == 2 else _PSE_ALIBI_SQRT
    return _PSE_COMPRESSED if plan.pse_compressed else _PSE_DENSE


def _placeholder(like: torch.Tensor) -> np.ndarray:
    """A [1, 1, 1, 1] kernel array of like's dtype for an absent pse or dpse: a call without one then compiles to
    the same types as a call with one (a dense pse and its gradient have the query's dtype)."""
    return kernel_view(like.new_zeros(1, 1, 1, 1))


def _kernel_plan(plan: AttentionPlan, q: torch.Tensor, sq: int, skv: int, dpse: bool = False) -> KernelPlan:
    """The plan of a sequence of sq x skv scores as the kernels take it (placeholders for absent arrays; Python
    ints and bools, float32 scalars, C-contiguous arrays, so every plan compiles to the same argument type). q:
    the input before widening: its dtype is the one P and dS are rounded to with ``plan.round_probs``, and that
    of an absent pse's placeholder (:func:`_placeholder`)."""
    b, n1 = q.shape[:2]
    mask = plan.atten_mask
    mask = np.zeros((1, 1, 1, 1), np.uint8) if mask is None else _view(mask)
    alibi = plan.pse is not None and plan.pse_type in (2, 3)
    pse = _placeholder(q) if plan.pse is None or alibi else _view(plan.pse)
    slopes = (plan.pse.float().reshape(plan.pse.shape[0], plan.pse.shape[1], 1, 1).numpy() if alibi
              else np.zeros((1, 1, 1, 1), np.float32))
    prefix = np.zeros(b, np.int64) if plan.prefix is None else np.asarray(plan.prefix, np.int64)
    drop = (plan.drop_mask.reshape(-1).contiguous().numpy() if plan.has_dropout
            else np.zeros(1, np.uint8))
    scale = np.array([plan.scale], np.float32)[0]  # (an out-of-range scale becomes inf without a warning)
    sink = np.zeros(1, np.float32) if plan.sink is None else plan.sink.detach().float().contiguous().numpy()
    return KernelPlan(mask, pse, slopes, prefix, drop, pre=int(plan.pre_tokens), nxt=int(plan.next_tokens),
                      has_mask=plan.atten_mask is not None, pse_kind=_pse_kind(plan),
                      pse_first=bool(plan.pse_type == 1), shift=int(plan.kv_start_idx - plan.q_start_idx),
                      dropout=bool(plan.has_dropout), dpse=bool(dpse), invalid_rows=bool(plan.invalid_rows),
                      n1=int(n1), sq=int(sq), skv=int(skv), scale=scale,
                      keep_factor=np.float32(1.0) / np.float32(plan.keep_prob),
                      probs_like=kernel_view(q.new_zeros(1, dtype=q.dtype if plan.round_probs else torch.float32)),
                      sink=sink, has_sink=plan.sink is not None)


def _sequence_table(sequences: list[Sequence], kplans: list[KernelPlan], key_block: int,
                    extra: tuple[list[np.ndarray], ...] = (), batch_tasks: list[int] | None = None) -> SequenceTable:
    """The :class:`SequenceTable` of ``sequences`` and their kernel plans; key blocks of ``key_block`` keys are
    counted over all sequences (the forward's packed K / V); ``extra``: per-sequence arrays after the plan's (the
    backward's dQ slices, their written flags and dpse target)."""
    count = len(sequences)
    rows = np.zeros((count, 6), np.int64)
    rows[:, :4] = [seq[:4] for seq in sequences]
    blocks = -(-(rows[:, 3] - rows[:, 2]) // key_block)
    rows[:, 4] = np.cumsum(blocks) - blocks
    rows[:, 5] = batch_tasks or 0
    ints = np.array([[int(getattr(p, f)) for f in _PLAN_INTS] for p in kplans], np.int64).reshape(count, -1)
    arrays = np.ones((count, len(_PLAN_ARRAYS) + len(extra), 1 + _MAX_RANK), np.int64)
    for s, p in enumerate(kplans):
        for f, a in enumerate([getattr(p, name) for name in _PLAN_ARRAYS] + [e[s] for e in extra]):
            arrays[s, f, 0] = a.ctypes.data
            arrays[s, f, 1:1 + a.ndim] = a.shape
    return SequenceTable(rows, ints, arrays)


def _band_count(i: np.ndarray, extent: int, before: int, after: int) -> np.ndarray:
    """How many of ``extent`` positions j satisfy ``i - before <= j <= i + after``, for each i: the keys a query row
    sees under the band (before = pre, after = next) or the query rows that see a key (before = next, after = pre);
    prefix and atten_mask ignored."""
    return np.clip(np.minimum(extent, i + after + 1) - np.maximum(0, i - before), 0, extent)


def _forward_tasks(sequences: list[Sequence], batches: int, heads: int) -> np.ndarray:
    """int64 ``[T, 4]`` (sequence, b, n1, i0): the query blocks of every sequence, batch and head. A head's blocks
    are consecutive (the threads share its K and V in cache), its last block first (under a causal mask the blocks
    grow with the row); the heads go the costliest first (rows times the keys their band sees; a stable order
    among equals), so the tasks handed out last are small ones and the threads finish together."""
    units, costs = [], []
    for s, (q0, q1, k0, k1, plan) in enumerate(sequences):
        i0 = np.arange(0, q1 - q0, _BQ)[::-1]
        rows = np.minimum(_BQ, q1 - q0 - i0)
        band = (k1 - k0, plan.pre_tokens, plan.next_tokens)
        cost = rows * (_band_count(i0, *band) + _band_count(i0 + rows - 1, *band))
        b, n = np.divmod(np.arange(batches * heads), heads)
        unit = np.empty((b.size, i0.size, 4), np.int64)
        unit[:, :, 0], unit[:, :, 1], unit[:, :, 2], unit[:, :, 3] = s, b[:, None], n[:, None], i0
        units.append(unit.reshape(-1, 4))
        costs.append(np.repeat(cost.sum(), b.size * i0.size))
    return np.ascontiguousarray(np.concatenate(units)[np.argsort(-np.concatenate(costs), kind="stable")])


def _use_brgemm(q: torch.Tensor, d: int, dv: int, dr: int = 0) -> bool:
    """torch's brgemm serves float32, and bfloat16 with even head dims (VNNI pairs; ``dr``: the rope dim of the
    backward's ``[K | K_rope]`` rows, packed in pairs too), where it is usable (:data:`.gemm.BRGEMM_DTYPES`)."""
    return q.dtype in BRGEMM_DTYPES and (q.dtype == torch.float32 or d % 2 == dv % 2 == dr % 2 == 0)


def _pooled(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An uninitialised array of a 4-byte dtype, from the output pool when large (:func:`.tensor_view.new_output`):
    a varlen call's packed K and V, tens of MiB, would otherwise be fresh pages on every call."""
    return new_output(shape, torch.float32).numpy().view(dtype)


def _pack_like(q: torch.Tensor) -> np.ndarray:
    """An array of the element type of q's packed brgemm operands: uint32 VNNI pairs (bfloat16), else float32."""
    return np.empty(1, np.uint32 if q.dtype == torch.bfloat16 else np.float32)


def _rope_views(q: torch.Tensor, rope: tuple | None, in_place: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(q_rope, k_rope, rope)`` kernel views of the rope parts (BNSD), or placeholders of q's type."""
    if rope is None:
        placeholder = _placeholder(q)
        return placeholder, placeholder, False
    return (*(_view(t, in_place) for t in rope), True)


def _forward_operands(q: torch.Tensor, qv: np.ndarray, kv: np.ndarray, vv: np.ndarray, rope: tuple,
                      table: SequenceTable) -> ForwardOperands:
    """The forward's operands: K and V packed for the brgemm (:func:`_use_brgemm`; float32 needs K^T only, V is
    read in place), the key blocks of the sequences of ``table``, else placeholders; ``rope``: :func:`_rope_views`.

    With rope on the brgemm (bfloat16: an even Dr) K_rope^T is packed after K^T, so that each score tile is one
    product of depth D + Dr, the concatenated tensors' (see docs/performance.md, 'MLA rope and attention sink')."""
    b, n2, _, d = kv.shape
    like = _pack_like(q)
    placeholder = np.zeros((1, 1, 1, 1), like.dtype)
    if not _use_brgemm(q, d, vv.shape[3]):
        return ForwardOperands(qv, kv, vv, placeholder, placeholder, False, *rope)
    blocks = int(table.rows[-1, 4] + -(-(table.rows[-1, 3] - table.rows[-1, 2]) // _FWD_BK))
    per = like.itemsize // q.element_size()  # input elements per packed element (2: VNNI pairs)
    dr = rope[0].shape[3] if rope[2] and _use_brgemm(q, d, vv.shape[3], rope[0].shape[3]) else 0
    kt = _pooled((b, n2, blocks, _FWD_BK * (d + dr) // per), like.dtype)
    vt = _pooled((b, n2, blocks, _FWD_BK * vv.shape[3] // per), like.dtype) if per == 2 else placeholder
    launch_strided(_pack_kv_kernel, kv, vv, rope[1], dr > 0, kt, vt, table, streams(kt.nbytes), exact=(4, 5, 6))
    return ForwardOperands(qv, kv, vv, kt, vt, True, *rope)


@on_torch_threads
def flash_attention_forward(q, k, v, plan: AttentionPlan, out=None, softmax_max=None, softmax_sum=None,
                            rope=None, sequences: list[Sequence] | None = None):
    """Returns ``(out [B,N1,Sq,Dv] input dtype, softmax_max [B,N1,Sq] fp32, softmax_sum [B,N1,Sq] fp32)``.

    ``rope = (q_rope [B,N1,Sq,Dr], k_rope [B,N2|1,Skv,Dr])``: the scores are ``[q, q_rope] [k, k_rope]^T``.
    ``plan.sink``: every row's softmax has one more logit ``sink[n]`` without a value (max and sum include it).

    out / softmax_max / softmax_sum: optional preallocated outputs of those shapes and dtypes (any strides,
    e.g. views into TND tensors), written in place and returned. q, k, v (and the rope parts) are read from
    contiguous copies unless they are contiguous: every query tile reads all of K and V, and MKL packs its
    operands from TND rows (a row stride of N * D elements, a power of two) more slowly than from copies
    (docs/performance.md, 'Flash attention: varlen and launch costs'). Fully masked rows:
    max = -FLT_MAX and sum = Skv (uniform P over all keys), or with ``plan.invalid_rows`` out = 0,
    max = -FLT_MAX, sum = +FLT_MAX (see docs/cann-semantics.md, 'Fully masked rows').

    ``sequences`` (B = 1, a varlen call): several problems on rows of the S axes, each with its own plan (``plan``
    gives the fields they share: scale, keep_prob, sink, the precision flags), run as one launch whose tasks are
    balanced over all of them (:func:`_forward_tasks`); every sequence gets the bits it gets alone. q (and the
    rope parts) are then read in place (views of the packed TND tensors), K and V too where only the brgemm's
    packing reads them (else from copies), and rows of no sequence are left as they are.
    """
    B, N1, Sq, _ = q.shape
    in_place = sequences is not None
    sequences = sequences or [Sequence(0, Sq, 0, k.shape[2], plan)]
    out = new_output((B, N1, Sq, v.shape[3]), q.dtype) if out is None else _unit_rows(out)
    smax = new_output((B, N1, Sq), torch.float32) if softmax_max is None else softmax_max
    ssum = new_output((B, N1, Sq), torch.float32) if softmax_sum is None else softmax_sum
    kplans = [_kernel_plan(seq.plan, q, seq.q1 - seq.q0, seq.k1 - seq.k0) for seq in sequences]
    table = _sequence_table(sequences, kplans, _FWD_BK)
    q, k, v = _widened(plan, q, k, v)
    rope = rope and _widened(plan, *rope)
    # on the brgemm K^T and bfloat16's V are packed per key block (_pack_kv_kernel) straight from TND rows, which
    # costs less than copying the rows first; the float32 GEMMs read V itself, so from a copy
    packs = in_place and _use_brgemm(q, k.shape[3], v.shape[3])
    kv, vv = _view(k, packs), _view(v, packs and q.dtype != torch.float32)
    operands = _forward_operands(q, _view(q, in_place), kv, vv, _rope_views(q, rope, in_place), table)
    launch_workers(_forward_kernel, _forward_worker, operands, kplans[0], kernel_view(out), kernel_view(smax),
                   kernel_view(ssum), table, _forward_tasks(sequences, B, N1), exact=(1, 5, 6))
    return out, smax, ssum


def _widened(plan: AttentionPlan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inputs as the GEMMs take them: float32 copies (once per call) with ``plan.widen_gemm`` or where this
    machine multiplies bfloat16 / float16 faster on widened tiles (:func:`.gemm_paths.gemm_path`; P and dS are
    still rounded as ``plan.round_probs`` says, so only the accumulation order differs), else as given.

    The copies are C-contiguous ``[B, N, S, D]`` (so the kernels read them as they are, whatever t's layout) on
    :func:`.tensor_view.new_output` memory: a fresh copy of a whole varlen batch was faulted in page by page on every
    call (docs/performance.md, 'Varlen on widened tiles')."""
    dtype = tensors[0].dtype
    widen = plan.widen_gemm or (dtype in CALIBRATED_DTYPES and gemm_path(dtype) == WIDENED)
    return tuple(_contiguous_copy(t, torch.float32) for t in tensors) if widen else tensors


def _transposed(parts: tuple, packed: bool, like: torch.Tensor) -> np.ndarray:
    """``[t0 | t1 | ...]^T`` ``[B, N, D0 + D1 + ..., S]`` (a contiguous copy) of tensors ``[B, N, S, Di]``: an A
    operand of the backward's dK (``[Q | Q_rope]^T``) and dV (dY^T) brgemm (``packed``, :func:`_use_brgemm`), else a
    placeholder of like's type."""
    if not packed:
        return _placeholder(like)
    B, N, S = parts[0].shape[:3]
    out = kernel_view(new_output((B, N, sum(t.shape[3] for t in parts), S), parts[0].dtype))
    d0 = 0
    for t in parts:
        _transpose_kernel(kernel_view(t), out[:, :, d0:d0 + t.shape[3]], streams(out.nbytes))
        d0 += t.shape[3]
    return out


def backward_chunks(batch_kv_heads: int, skv: int) -> int:
    """Key chunks per (b, n2) of the backward: a function of the shape only (so of no thread count)."""
    key_blocks = max(1, -(-skv // _BK))
    return max(1, min(key_blocks, -(-_TARGET_TASKS // batch_kv_heads)))


def _dpse_target(plan: AttentionPlan, b: int, sq: int) -> tuple[torch.Tensor | None, np.ndarray]:
    """(output or None, kernel array) of dpse: a dense ``[B, N1, Sq, Skv]`` pse (nothing to sum: each element
    gets one dS) is written straight into its zero-filled output in pse's dtype; the broadcast and compressed
    forms sum into an fp32 accumulator of pse's shape (output None: rounded once afterwards)."""
    shape = tuple(plan.pse.shape)
    if not plan.pse_compressed and (shape[0], shape[2]) == (b, sq):
        out = new_output(shape, plan.pse.dtype).zero_()
        return out, kernel_view(out)
    return None, _dpse_accumulator(plan)


def _dpse_accumulator(plan: AttentionPlan) -> np.ndarray:
    return new_output(tuple(plan.pse.shape), torch.float32).zero_().numpy()


def _dpse_targets(sequences: list[Sequence], b: int) -> list[tuple[torch.Tensor | None, np.ndarray]]:
    """:func:`_dpse_target` of each sequence; fp32 accumulators for all when their kinds differ (one launch
    takes one array type; each element still gets the same sum, rounded once when it is read out)."""
    targets = [_dpse_target(seq.plan, b, seq.q1 - seq.q0) for seq in sequences]
    if len({a.dtype for _, a in targets}) > 1:
        targets = [(None, _dpse_accumulator(seq.plan)) for seq in sequences]
    return targets


def _dpse_split(plan: AttentionPlan, b: int) -> tuple[int, bool]:
    """(batch_tasks, single_chunk) of a backward with dpse: a batch-broadcast pse (Bp == 1) puts all batches in
    one task (batch order), the alibi-compressed form keeps all key blocks in one task (a stored element
    gathers keys of many blocks), so every accumulator element has one owner and one summation order."""
    return (b if plan.pse.shape[0] > 1 else 1), plan.pse_compressed


def _backward_split(seq: Sequence, b: int, n2: int, dpse: bool) -> tuple[int, int]:
    """(batch_tasks, chunks) of a sequence's backward tasks (:func:`_dpse_split`, :func:`backward_chunks`)."""
    batch_tasks, single_chunk = _dpse_split(seq.plan, b) if dpse else (b, False)
    return batch_tasks, 1 if single_chunk else backward_chunks(batch_tasks * n2, seq.k1 - seq.k0)


def _dq_slices(shapes: list[tuple[int, ...]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """fp32 dQ slices of these shapes ``[chunks, B, N1, Sq, W]``, C-contiguous, one after the other in one buffer
    from :func:`.tensor_view.new_output` (a large one reuses the pages of the previous call's: fresh pages would
    each cost a fault, and a varlen launch holds the slices of all its batches at once), not zeroed; and their
    zeroed written flags (:class:`Gradients`)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = new_output((sum(sizes),), torch.float32).numpy()
    starts = np.cumsum(sizes) - sizes
    return ([flat[a:a + n].reshape(shape) for a, n, shape in zip(starts, sizes, shapes)],
            [np.zeros((*shape[:3], -(-shape[3] // _EDGE_ROWS)), np.uint8) for shape in shapes])


def _key_block_costs(seq: Sequence) -> np.ndarray:
    """Estimated cost of each key block of a sequence's backward: its keys times the query rows their band sees
    (counted at its first and last key; atten_mask and prefix ignored)."""
    sq, skv = seq.q1 - seq.q0, seq.k1 - seq.k0
    j0 = np.arange(0, skv, _BK)
    j1 = np.minimum(j0 + _BK, skv)
    band = (sq, seq.plan.next_tokens, seq.plan.pre_tokens)
    return (j1 - j0) * (_band_count(j0, *band) + _band_count(j1 - 1, *band))


def _chunk_bounds(costs: np.ndarray, chunks: int) -> np.ndarray:
    """int64 ``[chunks + 1]``: the first key block of each chunk, then the block count. The chunks are runs of
    blocks of about equal cost: each chunk ends where its cost comes nearest an equal share of the cost left
    (the fewer blocks on a tie; no chunk empty unless there are more chunks than blocks). Under a causal band
    the first blocks, which every later row sees, cost the most, and equal runs of blocks would leave threads
    waiting for them. Equal costs give equal runs."""
    running = np.cumsum(costs)
    bounds = [0]
    for c in range(1, chunks):
        done = running[bounds[-1] - 1] if bounds[-1] else 0
        target = done + (running[-1] - done) / (chunks - c + 1)
        j = int(np.searchsorted(running, target))  # running[j] >= target: end after block j, or before it
        j += 1 if j == 0 or running[j] - target < target - running[j - 1] else 0
        bounds.append(min(len(costs), max(bounds[-1] + 1, min(j, len(costs) - chunks + c))))
    return np.array(bounds + [len(costs)], np.int64)


def _backward_tasks(sequences: list[Sequence], splits: list[tuple[int, int]], kv_heads: int) -> np.ndarray:
    """int64 ``[T, 6]`` (sequence, bt, n2, chunk, first key block, end key block): every key chunk
    (:func:`_chunk_bounds`) of every sequence, batch task and kv head, the costliest first (a stable order among
    equals)."""
    tasks, costs = [], []
    for s, (seq, (batch_tasks, chunks)) in enumerate(zip(sequences, splits)):
        block_costs = _key_block_costs(seq)
        bounds = _chunk_bounds(block_costs, chunks)
        cost = np.diff(np.concatenate([[0], np.cumsum(block_costs)])[bounds])
        bt, n2, c = (a.ravel() for a in np.meshgrid(np.arange(batch_tasks), np.arange(kv_heads), np.arange(chunks),
                                                    indexing="ij"))
        tasks.append(np.stack([np.full(c.size, s), bt, n2, c, bounds[c], bounds[c + 1]], 1))
        costs.append(cost[c])
    order = np.argsort(-np.concatenate(costs), kind="stable")
    return np.ascontiguousarray(np.concatenate(tasks)[order], dtype=np.int64)


@on_torch_threads
def flash_attention_backward(q, k, v, dy, out, softmax_max, softmax_sum, plan: AttentionPlan,
                             with_dpse: bool = False, dq=None, dk=None, dv=None, rope=None, rope_into=None,
                             sequences: list[Sequence] | None = None):
    """Returns ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``: dq/dk/dv shaped like q, k, v in the input dtype (module
    docstring for the math); dpse shaped like ``plan.pse`` in its dtype when ``with_dpse`` (pse_type 0/1), else
    None; with ``rope = (q_rope, k_rope)`` (as in :func:`flash_attention_forward`) their gradients (a single
    k_rope head gets the sum over all heads), else None. ``rope_into``: preallocated (dq_rope, dk_rope). dsink
    float32 ``[N1]`` with ``plan.sink`` (:func:`_sink_gradient`), else None.

    softmax_max / softmax_sum ``[B, N1, Sq]`` fp32 and out (attentionIn) are used as given (any strides); out is
    not read in the golden order (``plan.widen_gemm`` without ``plan.round_probs``) on bf16 / fp16 inputs, which
    recomputes it in float32.
    dq / dk / dv: optional preallocated outputs (any strides, e.g. views into TND tensors), written in place;
    the inputs are then read in place too, as in :func:`flash_attention_forward`.

    ``sequences``: as in :func:`flash_attention_forward`, one launch over all of them (B = 1); the rows of the
    sequences are written, the others left as they are; dpse is then a list (each sequence's, shaped like its
    plan's pse) and dsink the sum over the sequences.
    """
    B, N1, Sq, D = q.shape
    N2, Skv = k.shape[1], k.shape[2]
    want_dpse = with_dpse and plan.pse is not None and plan.pse_type in (0, 1)
    in_place = dq is not None or sequences is not None
    several, sequences = sequences is not None, sequences or [Sequence(0, Sq, 0, Skv, plan)]
    kplans = [_kernel_plan(seq.plan, q, seq.q1 - seq.q0, seq.k1 - seq.k0, want_dpse) for seq in sequences]
    dtype = q.dtype
    q, k, v, dy = _widened(plan, q, k, v, dy)
    rope_operands = rope and _widened(plan, *rope)
    if plan.widen_gemm and not plan.round_probs and dtype != torch.float32:  # D from the unrounded output
        out = flash_attention_forward(q, k, v, plan, rope=rope_operands, sequences=sequences if several else None)[0]
    packed = _use_brgemm(q, D, v.shape[3], rope_operands[0].shape[3] if rope_operands else 0)
    # on the brgemm V^T and bfloat16's K are packed per key block (_pack_key_block) straight from TND rows; the
    # float32 dQ GEMM reads K itself, so from a copy
    kv, vv = _view(k, in_place and packed and q.dtype != torch.float32), _view(v, in_place and packed)
    qv, dyv = _view(q, in_place), _view(dy, in_place)
    dr = np.empty((B, N1, Sq), np.float32)
    _row_dot_kernel(dyv, _view(out, in_place), dr)
    dq, dk, dv = (new_output(like.shape, dtype) if t is None else _unit_rows(t)
                  for t, like in ((dq, q), (dk, k), (dv, v)))
    smax, ssum = (_view(t.detach().float(), in_place) for t in (softmax_max, softmax_sum))
    qr, kr, has_rope = _rope_views(q, rope_operands, in_place)
    qt = _transposed((q, rope_operands[0]) if rope_operands else (q,), packed, q)
    operands = BackwardOperands(qv, kv, vv, dyv, qt, _transposed((dy,), packed, q), smax, ssum, dr, packed, qr, kr,
                                has_rope)
    splits = [_backward_split(seq, B, N2, want_dpse) for seq in sequences]
    width = D + (qr.shape[3] if has_rope else 0)
    dq_accs, dq_written = _dq_slices([(chunks, B, N1, seq.q1 - seq.q0, width)
                                      for seq, (_, chunks) in zip(sequences, splits)])
    dpse = _dpse_targets(sequences, B) if want_dpse else [(None, _placeholder(dq))] * len(sequences)
    dkr = np.empty((B, N2, Skv, width - D) if has_rope else (1, 1, 1, 1), np.float32)
    table = _sequence_table(sequences, kplans, _BK, (dq_accs, dq_written, [a for _, a in dpse]),
                            [batch_tasks for batch_tasks, _ in splits])
    grads = Gradients(dq_accs[0], dq_written[0], kernel_view(dk), kernel_view(dv), dpse[0][1], dkr)
    launch_workers(_backward_kernel, _backward_worker, operands, kplans[0], grads, _pack_like(q), table,
                   _backward_tasks(sequences, splits, N2), exact=(1, 3, 4, 5))
    dq_rope, dk_rope = _rope_outputs(rope, rope_into) if has_rope else (None, None)
    for seq, dq_acc, written in zip(sequences, dq_accs, dq_written):
        rows = slice(seq.q0, seq.q1)
        _finish_dq_kernel(dq_acc, written, kplans[0].scale, kernel_view(dq[:, :, rows]),
                          kernel_view(dq_rope[:, :, rows] if has_rope else dq[:1, :1, :1]))
        if has_rope:
            keys = slice(seq.k0, seq.k1)
            dk_rope[:, :, keys].copy_(_kv_head_sum(torch.from_numpy(dkr[:, :, keys]), dk_rope.shape[1]))
    dpse_out = [out if out is not None else torch.from_numpy(a).to(seq.plan.pse.dtype)
                for seq, (out, a) in zip(sequences, dpse)] if want_dpse else [None]
    dsink = None if plan.sink is None else sum(
        _sink_gradient(plan.sink, *(a[:, :, seq.q0:seq.q1] for a in (dr, smax, ssum))) for seq in sequences)
    return dq, dk, dv, dpse_out if several else dpse_out[0], dq_rope, dk_rope, dsink


def _sink_gradient(sink: torch.Tensor, dr: np.ndarray, smax: np.ndarray, ssum: np.ndarray) -> torch.Tensor:
    """dsink float32 ``[N1]`` = ``-sum_{b,i} Psink * Dr`` with ``Psink = exp(sink - max) / sum`` from the given
    statistics and the backward's own ``Dr = rowsum(dy * out)`` ``[B, N1, Sq]`` (the dP of dS, dropout included).
    Rows whose max is the fully-masked fill (no sink in their forward) contribute 0."""
    m, s, d = (torch.from_numpy(a) for a in (smax, ssum, dr))
    p_sink = (torch.exp(sink.view(1, -1, 1) - m) / s).masked_fill(~(m > _NEG), 0.0)
    return -(p_sink * d).sum((0, 2))


def _rope_outputs(rope: tuple, into: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq_rope, dk_rope): ``into`` (unit-stride rows) or new tensors shaped and typed like (q_rope, k_rope)."""
    if into:
        return _unit_rows(into[0]), into[1]
    return tuple(new_output(t.shape, t.dtype) for t in rope)


def _kv_head_sum(dkr: torch.Tensor, heads: int) -> torch.Tensor:
    """The per-kv-head fp32 dK_rope ``[B, N2, Skv, Dr]``, summed over the heads for a single shared k_rope head."""
    return dkr.sum(1, keepdim=True) if heads == 1 and dkr.shape[1] > 1 else dkr
