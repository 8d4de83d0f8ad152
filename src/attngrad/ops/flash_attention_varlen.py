"""Contract of the varlen (TND) FlashAttentionScore / FlashAttentionScoreGrad (see docs/cann-semantics.md,
'Varlen (TND)').

Layout TND: query ``[T1, N1, D]``, key ``[T2, N2, D]``, value ``[T2, N2, Dv]``, dy / attention_in / out
``[T1, N1, Dv]``. ``actual_seq_qlen`` / ``actual_seq_kvlen`` are CUMULATIVE end offsets (list of int or 1-D
integer tensor), equal length: batch b owns query rows ``[cum_q[b-1], cum_q[b])`` and key rows
``[cum_kv[b-1], cum_kv[b])`` and is its own ``Sq_b x Skv_b`` attention problem. Zero-length batches are
allowed; trailing entries where both arrays are 0 disable those batches; T may exceed the totals (when
both T1 and T2 do, the last entries of both arrays must be 0). Rows beyond the totals get zero output and
zero gradient.

Each batch is its own problem for the BNSD kernels of :mod:`attngrad.ops.flash_attention_core` on rows of the
packed tensors (``query[q0:q1]`` is ``[Sq_b, N1, D]`` -> ``[1, N1, Sq_b, D]``), and all of them run as one
launch whose tasks are balanced over the batches (:class:`.kernels.flash_attention.Sequence`); nothing is padded
to the longest sequence, and each batch gets the bits it gets alone. The per-batch :class:`AttentionPlan` comes
from the core's ``resolve_plan`` with the batch's own geometry, so masks, sparse modes (right-down shifts by
``Skv_b - Sq_b``), pse and dropout follow the core exactly and are supported (or refused with 161002 "not
supported yet") exactly as the core does.
The TND-only rules live here: the SS / compressed mask forms, sparse modes 7 and 8 (the band batch is
the last (7) / first (8) batch with ``Sq_b != 0``; it runs as mode 4, the others as mode 3 / 2), the
flattened 1-D pse forms and per-batch slopes, the per-batch dropout bit blocks (batch b starts at bit
``N1 * sum_{b'<b} Sq_b' Skv_b'``), and the sequence-length checks.

softmax_max / softmax_sum: float32 ``[T1, N1, 8]`` (8 equal copies). ``softmax_layout`` selects the data
order: ``""`` (CANN's default) stores batch b as a contiguous ``[N1, Sq_b, 8]`` block at row offset
``cum_q[b-1] * N1`` of the flattened ``[T1 * N1, 8]``; ``"TND"`` stores row t, head n at ``[t, n]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..errors import ACLNN_ERR_PARAM_NULLPTR, AclnnError
from ..kernels.flash_attention import Sequence
from ..kernels.flash_attention_plan import ALIBI_ROWS, AttentionPlan
from ..kernels.tensor_view import new_output
from ..validation import (MASK_DTYPES, check_choice, check_dtype, check_float, check_int, check_int_list,
                          check_int_tensor, check_range, check_rank, invalid, require_tensor)
from .flash_attention_core import (COMPRESSED_MASK, STATS_COPIES, AttentionAttrs, AttentionTensors, Geometry,
                                   Grads, Problem, backward_kernel, degenerate, forward_kernel, geometry,
                                   has_float_pse, resolve_plan, stats8)
from .flash_attention_checks import (NO_OUTPUTS, absent, check_cann_sizes, check_drop_mask, check_dy_and_attention_in,
                                     check_forward_outputs, check_grad_outputs, check_head_num, check_input_layout,
                                     check_pse_type, check_tensors, require_forward_tensors,
                                     require_grad_tensors, saved_stats)
from .flash_attention_sink_rope import check_rope, check_sink

FORWARD = "FlashAttentionVarLenScore"
BACKWARD = "FlashAttentionUnpaddingScoreGrad"
SOFTMAX_LAYOUTS = ("", "TND")
CANN_MAX_BATCHES = 2048                 # actualSeqQLen length 1~2K (unpadding V1-V3)
SPLIT_MODES = {7: (3, -1), 8: (2, 0)}   # varlen split mode -> (mode of the other batches, band batch: last/first)
BAND_MODE = 4


# ------------------------------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class VarlenGeometry:
    """TND sizes: T1/T2 rows, N1/N2 heads, D/Dv head dims and the active batches' cumulative ends."""

    t1: int
    t2: int
    n1: int
    n2: int
    d: int
    dv: int
    cum_q: tuple[int, ...]
    cum_kv: tuple[int, ...]

    @property
    def batch_count(self) -> int:
        return len(self.cum_q)

    def rows(self, b: int) -> tuple[int, int, int, int]:
        """``(q0, q1, k0, k1)``: the query and key rows of batch b."""
        q0 = self.cum_q[b - 1] if b else 0
        k0 = self.cum_kv[b - 1] if b else 0
        return q0, self.cum_q[b], k0, self.cum_kv[b]

    def lengths(self, b: int) -> tuple[int, int]:
        """``(Sq_b, Skv_b)``."""
        q0, q1, k0, k1 = self.rows(b)
        return q1 - q0, k1 - k0

    def batch_geometry(self, b: int) -> Geometry:
        """Batch b as a one-batch BNSD problem of the core."""
        sq, skv = self.lengths(b)
        return Geometry("BNSD", 1, self.n1, self.n2, sq, skv, self.d, self.dv)

    @property
    def max_lengths(self) -> tuple[int, int]:
        lens = [self.lengths(b) for b in range(self.batch_count)]
        return max((q for q, _ in lens), default=0), max((k for _, k in lens), default=0)

    @cached_property
    def _score_starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.n1 * math.prod(self.lengths(b)) for b in range(self.batch_count))]

    def score_offset(self, b: int) -> int:
        """Flat index of batch b's first score in the concatenated [N1, Sq_b, Skv_b] blocks (b = B: the total)."""
        return self._score_starts[b]

    @cached_property
    def cann_stats_order(self) -> torch.Tensor:
        """int64 [sum Sq_b * N1]: entry ``q0 * N1 + n * Sq_b + i`` of CANN's default softmax order (batch b a
        contiguous ``[N1, Sq_b]`` block at row offset ``q0 * N1``) holds the true TND element ``(q0 + i) * N1 + n``."""
        blocks = [torch.arange(q0 * self.n1, q1 * self.n1).view(q1 - q0, self.n1).T.reshape(-1)
                  for q0, q1, _, _ in map(self.rows, range(self.batch_count))]
        return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)

    stats_rule = "[T1, N1, 8]"

    @property
    def stats_shape(self) -> tuple[int, int, int]:
        return (self.t1, self.n1, STATS_COPIES)


def _check_softmax_layout(op: str, softmax_layout) -> str:
    """softmaxLayout "" (CANN's default order; None reads as "") or "TND"."""
    softmax_layout = "" if softmax_layout is None else softmax_layout
    check_choice(op, "softmaxLayout", softmax_layout, SOFTMAX_LAYOUTS)
    return softmax_layout


def _seq_list(op: str, name: str, values) -> list[int]:
    """actualSeqQLen / actualSeqKvLen: required (161001) and non-empty for TND."""
    if values is None:
        raise AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{op}: {name} must not be null (None) for inputLayout TND", name)
    values = check_int_list(op, name, values)
    if not values:
        raise invalid(op, name, "must not be empty for inputLayout TND", values)
    return values


def _check_cumulative(op: str, name: str, cum: list[int]) -> None:
    """Cumulative lengths: non-negative and non-decreasing."""
    previous = 0
    for i, value in enumerate(cum):
        if value < previous:
            raise invalid(op, name, f"must be cumulative lengths: non-negative and non-decreasing (entry {i} is "
                                    f"{value} < {previous})", cum)
        previous = value


def _check_seq_lens(op: str, t1: int, t2: int, actual_seq_qlen, actual_seq_kvlen,
                    cann_limits: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Equal counts, cumulative, totals within T, tail rule. Returns the active ends.

    Trailing entries where both arrays are 0 disable their batches (stripped). T1 >= sum Sq_b and
    T2 >= sum Skv_b; when BOTH exceed their totals the last entries of both arrays must be 0.
    """
    q = _seq_list(op, "actualSeqQLen", actual_seq_qlen)
    kv = _seq_list(op, "actualSeqKvLen", actual_seq_kvlen)
    if len(kv) != len(q):
        raise invalid(op, "actualSeqKvLen", f"must have as many entries as actualSeqQLen ({len(q)})", len(kv))
    if cann_limits:
        check_range(op, "actualSeqQLen length (batch count)", len(q), 1, CANN_MAX_BATCHES)
    active = len(q)
    while active and q[active - 1] == 0 and kv[active - 1] == 0:
        active -= 1
    _check_cumulative(op, "actualSeqQLen", q[:active])
    _check_cumulative(op, "actualSeqKvLen", kv[:active])
    total_q, total_kv = (q[active - 1], kv[active - 1]) if active else (0, 0)
    if t1 < total_q:
        raise invalid(op, "query", f"T axis cannot be less than the total query length {total_q}", t1)
    if t2 < total_kv:
        raise invalid(op, "key", f"T axis cannot be less than the total key/value length {total_kv}", t2)
    if t1 > total_q and t2 > total_kv and (q[-1] != 0 or kv[-1] != 0):
        raise invalid(op, "actualSeqQLen", f"and actualSeqKvLen must end with 0 when both T axes ({t1}, {t2}) "
                                           f"exceed the totals ({total_q}, {total_kv})", (q[-1], kv[-1]))
    return tuple(q[:active]), tuple(kv[:active])


def _check_tnd_tensors(op: str, head_num: int, inputs: tuple, attention_in=None, cann_limits: bool = False):
    """dtype, rank 3, shape agreement and head geometry of ``inputs`` = (query, key, value) or (query, key,
    value, dy): the core's rules on TND seen as BSND with B = 1. Returns that BSND geometry."""
    query, key, value, dy = inputs if len(inputs) == 4 else (*inputs, None)
    check_tensors(op, 3, query, key, value, dy, attention_in)
    base = geometry(op, "BSND", head_num, query[None], key[None], value[None])
    check_dy_and_attention_in(op, query, dy, attention_in, (query.shape[0], base.n1, base.dv))
    if cann_limits:
        check_cann_sizes(op, base.n1, base.d)
    return base


def _check_tnd_inputs(op: str, head_num: int, inputs: tuple, attrs: AttentionAttrs, attention_in=None,
                      cann_limits: bool = False) -> VarlenGeometry:
    """:func:`_check_tnd_tensors`, then the sequence lengths of ``attrs``."""
    query, key, value = inputs[:3]
    base = _check_tnd_tensors(op, head_num, inputs, attention_in, cann_limits)
    cum_q, cum_kv = _check_seq_lens(op, query.shape[0], key.shape[0], attrs.actual_seq_qlen,
                                    attrs.actual_seq_kvlen, cann_limits)
    return VarlenGeometry(query.shape[0], key.shape[0], base.n1, base.n2, base.d, base.dv, cum_q, cum_kv)


def check_without_lengths(query, key, value, dy, attrs: AttentionAttrs, tensors: AttentionTensors,
                          seq_lengths: tuple) -> tuple[int, int, int]:
    """The checks that do not read the values of the sequence lengths, in CANN's order, for the custom ops' fake
    kernels (under torch.compile the lengths are graph inputs without values): the layouts, the tensors and
    their geometry, and the lengths as 1-D integer tensors of equal size. Returns ``(T1, N1, Dv)``."""
    op = FORWARD if dy is None else BACKWARD
    check_input_layout(op, attrs.input_layout, ("TND",))
    if dy is None:
        inputs = require_forward_tensors(op, query, key, value, NO_OUTPUTS, False)
    else:
        saved = (tensors.softmax_max, tensors.softmax_sum, tensors.attention_in)
        inputs, _, _ = require_grad_tensors(op, (query, key, value, dy), saved, NO_OUTPUTS, False)
    head_num = check_head_num(op, attrs.head_num)
    _check_softmax_layout(op, attrs.softmax_layout)
    base = _check_tnd_tensors(op, head_num, inputs, tensors.attention_in)
    check_rope(op, "TND", base.n1, base.n2, query, key, tensors.query_rope, tensors.key_rope)
    for name, t in (("pse", tensors.pse), ("attenMask", tensors.atten_mask), ("dropMask", tensors.drop_mask)):
        if t is not None:
            require_tensor(op, name, t)  # a CPU tensor (its shape rules read the lengths)
    for name, lengths in zip(("actualSeqQLen", "actualSeqKvLen"), seq_lengths):
        if lengths is None:
            _seq_list(op, name, None)
        check_int_tensor(op, name, lengths)
    if seq_lengths[0].numel() != seq_lengths[1].numel():
        raise invalid(op, "actualSeqKvLen", f"must have as many entries as actualSeqQLen "
                      f"({seq_lengths[0].numel()})", seq_lengths[1].numel())
    check_sink(op, tensors.sink, base.n1)
    return query.shape[0], base.n1, base.dv


# ----------------------------------------------------------------------------- per-batch plan inputs
def _check_sparse_mode(op: str, sparse_mode) -> int:
    """TND sparse modes: 0~8 except 5 (prefix mode 5 has no TND form)."""
    sparse_mode = check_int(op, "sparseMode", sparse_mode)
    check_range(op, "sparseMode", sparse_mode, 0, 8)
    if sparse_mode == 5:
        raise invalid(op, "sparseMode", "5 (uncompressed prefix) is not supported with inputLayout TND",
                      sparse_mode)
    return sparse_mode


def _check_tnd_mask(op: str, mask: torch.Tensor, geo: VarlenGeometry, sparse_mode: int) -> torch.Tensor:
    """TND attenMask: the SS form ``[maxSq, maxSkv]`` (modes 0/1) or the compressed ``[2048, 2048]``
    (``[3072, 2048]`` for mode 6), 2-D or ``[1, 1, ., .]``. Returns it as a [1, 1, ., .] view."""
    check_dtype(op, "attenMask", mask, MASK_DTYPES)
    check_rank(op, "attenMask", mask, (2, 4))
    expected = COMPRESSED_MASK.get(sparse_mode, geo.max_lengths)
    if tuple(mask.shape[-2:]) != expected or (mask.dim() == 4 and tuple(mask.shape[:2]) != (1, 1)):
        raise invalid(op, "attenMask", f"must be {list(expected)} or [1, 1, {expected[0]}, {expected[1]}] for "
                                       f"sparseMode {sparse_mode} with inputLayout TND", list(mask.shape))
    return mask[None, None] if mask.dim() == 2 else mask


def _batch_mask(mask, geo: VarlenGeometry, b: int, sparse_mode: int):
    """Modes 0/1: the top-left [Sq_b, Skv_b] block of the SS mask; compressed modes: the mask itself."""
    if mask is None or sparse_mode in COMPRESSED_MASK:
        return mask
    sq, skv = geo.lengths(b)
    return mask[..., :sq, :skv]


def _band_batch(geo: VarlenGeometry, sparse_mode: int) -> int | None:
    """Modes 7/8: the last (7) / first (8) batch with Sq_b != 0."""
    nonempty = [b for b in range(geo.batch_count) if geo.lengths(b)[0]]
    return nonempty[SPLIT_MODES[sparse_mode][1]] if nonempty and sparse_mode in SPLIT_MODES else None


def _batch_mode(b: int, sparse_mode: int, band_batch: int | None, has_mask: bool) -> int:
    """Mode 7 (8): the band batch is a right-down band (mode 4), the others right-down (left-up) causal
    (modes 3 / 2). Without attenMask every mode means full attention, as mode 0."""
    if sparse_mode not in SPLIT_MODES:
        return sparse_mode
    if not has_mask:
        return 0
    return BAND_MODE if b == band_batch else SPLIT_MODES[sparse_mode][0]


def _check_tnd_pse(op: str, pse: torch.Tensor, geo: VarlenGeometry, pse_type: int, sparse_mode: int,
                   start_shift: int) -> None:
    """TND pse forms. pseType 0/1: 1-D ``[N1 * sum Skv_b]`` (per batch [N1, Skv_b], rows
    broadcast), 1-D ``[N1 * sum Sq_b Skv_b]`` (per batch [N1, Sq_b, Skv_b]) or the alibi-compressed
    ``[B|1, N1, 1024, maxSkv]`` (needs Sq_b == Skv_b); pseType 2/3: slopes ``[N1]`` / ``[B, N1]``. Not with
    sparse mode 7 nor a zero-length query batch; mode 8 with slopes needs ``actualSeqQLen[0] -
    actualSeqKvLen[0] + qStartIdx - kvStartIdx == 0`` (``start_shift``: the last two)."""
    if sparse_mode == 7:
        raise invalid(op, "pse", "is not supported with sparseMode 7", list(pse.shape))
    lengths = [geo.lengths(b) for b in range(geo.batch_count)]
    if any(sq == 0 for sq, _ in lengths):
        raise invalid(op, "pse", "is not supported when a batch has query length 0", list(pse.shape))
    if pse_type in (2, 3):
        allowed = [(geo.n1,), (geo.batch_count, geo.n1)]
        if sparse_mode == 8 and lengths and lengths[0][0] - lengths[0][1] + start_shift != 0:
            raise invalid(op, "qStartIdx", "sparseMode 8 with a generated alibi needs actualSeqQLen[0] - "
                          "actualSeqKvLen[0] + qStartIdx - kvStartIdx == 0", start_shift)
    else:
        max_skv = geo.max_lengths[1]
        allowed = [(geo.n1 * geo.cum_kv[-1],) if lengths else (0,), (geo.score_offset(geo.batch_count),),
                   (1, geo.n1, ALIBI_ROWS, max_skv), (geo.batch_count, geo.n1, ALIBI_ROWS, max_skv)]
        if pse.dim() == 4 and any(sq != skv for sq, skv in lengths):
            raise invalid(op, "pse", "the alibi-compressed form needs Sq_b == Skv_b in every batch", lengths)
    if tuple(pse.shape) not in allowed:
        raise invalid(op, "pse", f"shape must be one of {[list(s) for s in allowed]} for pseType {pse_type} "
                                 f"with inputLayout TND", list(pse.shape))


def _batch_pse(pse: torch.Tensor, geo: VarlenGeometry, b: int, pse_type: int) -> torch.Tensor:
    """Batch b's pse in the core's form: slopes ``[N1]`` / ``[1, N1]``; ``[1, N1, Sq_b, Skv_b]`` /
    ``[1, N1, 1, Skv_b]`` cut from the 1-D forms (BNSS first when both sizes coincide); from the compressed
    alibi the bottom-right window (rows 1024 - Sq_b.., columns maxSkv - Skv_b..) as a BNSS block, or for
    Sq_b > 1024 its last Skv_b columns as the core's compressed form."""
    if pse_type in (2, 3):
        return pse if pse.dim() == 1 else pse[b:b + 1]
    q0, q1, k0, k1 = geo.rows(b)
    sq, skv = q1 - q0, k1 - k0
    if pse.dim() == 4:
        window = (pse[b:b + 1] if pse.shape[0] > 1 else pse)[..., pse.shape[3] - skv:]
        return window[:, :, ALIBI_ROWS - sq:] if sq <= ALIBI_ROWS else window
    if pse.shape[0] == geo.score_offset(geo.batch_count):
        start = geo.score_offset(b)
        return pse[start:start + geo.n1 * sq * skv].view(1, geo.n1, sq, skv)
    return pse[geo.n1 * k0:geo.n1 * k1].view(1, geo.n1, 1, skv)


def _batch_drop_mask(drop_mask: torch.Tensor, geo: VarlenGeometry, b: int) -> torch.Tensor:
    """Batch b's bits (LSB first, starting at bit N1 * sum_{b'<b} Sq_b' Skv_b') repacked from bit 0."""
    start = geo.score_offset(b)
    count = geo.score_offset(b + 1) - start
    packed = drop_mask.reshape(-1)[start // 8: math.ceil((start + count) / 8)].numpy()
    bits = np.unpackbits(packed, bitorder="little")[start % 8: start % 8 + count]
    return torch.from_numpy(np.packbits(bits, bitorder="little"))


def _resolve_plans(op: str, geo: VarlenGeometry, dtype: torch.dtype, attrs: AttentionAttrs,
                   tensors: AttentionTensors) -> list[AttentionPlan]:
    """The TND rules, then the core's ``resolve_plan`` once per batch on that batch's own geometry and
    slices. With no active batch, one empty batch validates the attributes."""
    sparse_mode = _check_sparse_mode(op, attrs.sparse_mode)
    pse_type = check_pse_type(op, attrs.pse_type)
    keep_prob = check_float(op, "keepProb", attrs.keep_prob)
    atten_mask, pse, drop_mask = tensors.atten_mask, tensors.pse, tensors.drop_mask
    mask = None
    if not absent(atten_mask):
        mask = _check_tnd_mask(op, require_tensor(op, "attenMask", atten_mask), geo, sparse_mode)
    if not absent(pse):
        starts = [(check_int_list(op, n, v) or [0])[0] for n, v in (("qStartIdx", attrs.q_start_idx),
                                                                   ("kvStartIdx", attrs.kv_start_idx))]
        _check_tnd_pse(op, require_tensor(op, "pse", pse), geo, pse_type, sparse_mode, starts[0] - starts[1])
    dropout = keep_prob < 1.0
    if dropout:
        check_drop_mask(op, drop_mask, geo.score_offset(geo.batch_count), "N1 * sum Sq_b*Skv_b / 8")
    prefix = check_int_list(op, "prefix", attrs.prefix)
    if prefix is not None and mask is not None and sparse_mode == 6 and len(prefix) < geo.batch_count:
        raise invalid(op, "prefix", f"must have an entry per batch ({geo.batch_count}) for sparseMode 6",
                      len(prefix))
    if geo.batch_count == 0:
        geo = VarlenGeometry(geo.t1, geo.t2, geo.n1, geo.n2, geo.d, geo.dv, (0,), (0,))
    band_batch = _band_batch(geo, sparse_mode)
    checked = dataclasses.replace(attrs, keep_prob=keep_prob, pse_type=pse_type)
    return [resolve_plan(op, geo.batch_geometry(b), dtype, dataclasses.replace(
                checked, sparse_mode=_batch_mode(b, sparse_mode, band_batch, mask is not None),
                prefix=None if prefix is None or b >= len(prefix) else (prefix[b],)),
            tensors._replace(atten_mask=_batch_mask(mask, geo, b, sparse_mode),
                             pse=None if absent(pse) else _batch_pse(pse, geo, b, pse_type).contiguous(),
                             drop_mask=_batch_drop_mask(drop_mask, geo, b) if dropout else drop_mask))
            for b in range(geo.batch_count)]


# ------------------------------------------------------------------------------------------ problem
def _bnsd(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a TND tensor as a zero-copy [1, N, S, D] view (strides (., D', N*D', 1) for a contiguous
    t): the kernels read and write such views in place, with results bit-identical to contiguous copies."""
    return t[r0:r1].permute(1, 0, 2).unsqueeze(0)


def _batch_stats(stats: torch.Tensor, layout: str, n1: int, q0: int, q1: int) -> torch.Tensor:
    """Batch b's [1, N1, Sq_b] statistics from a contiguous [T1, N1] (element 0) in ``layout`` order."""
    if layout == "TND":
        return stats[q0:q1].T.unsqueeze(0)
    return stats.view(-1)[q0 * n1:q1 * n1].view(1, n1, q1 - q0)


def _true_tnd_order(stats: torch.Tensor, layout: str, geo: VarlenGeometry) -> torch.Tensor:
    """Contiguous [T1, N1] statistics in ``layout`` order -> true TND order (:func:`_pack_stats` undone; rows
    beyond the totals as they are)."""
    if layout == "TND":
        return stats
    order = geo.cann_stats_order
    tnd = stats.clone()
    tnd.view(-1)[order] = stats.reshape(-1)[:order.numel()]
    return tnd


def _pack_stats(stats: torch.Tensor, layout: str, geo: VarlenGeometry) -> torch.Tensor:
    """[T1, N1] float32 in true TND order -> [T1, N1, 8] in ``layout`` order (rows beyond the totals 0): the
    default order is one gather through :attr:`VarlenGeometry.cann_stats_order` (whatever the batch count)."""
    if layout == "":
        order = geo.cann_stats_order
        flat = torch.zeros(geo.t1 * geo.n1, dtype=torch.float32)
        flat[:order.numel()] = stats.reshape(-1)[order]
        stats = flat.view(geo.t1, geo.n1)
    return stats8(stats)


@dataclass
class VarlenProblem:
    """Validated TND input: packed tensors, the geometry, one plan per batch, and (grad) the saved forward
    results: ``softmax_max`` / ``softmax_sum`` contiguous [T1, N1] (element 0 of the 8 copies) in
    ``softmax_layout`` order."""

    geo: VarlenGeometry
    plans: list[AttentionPlan]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    dy: torch.Tensor | None = None
    out: torch.Tensor | None = None
    softmax_max: torch.Tensor | None = None
    softmax_sum: torch.Tensor | None = None
    softmax_layout: str = ""
    pse: torch.Tensor | None = None            # the TND float pse (pseType 0/1), for dpse
    rope: tuple | None = None                  # the checked (query_rope [T1,N1,Dr], key_rope [T2,N2|1,Dr], heads)

    def whole(self) -> Problem:
        """All rows as one B = 1 BNSD problem (views), for a launch over the batches' rows; its plan is batch 0's."""
        geo = self.geo
        p = Problem(Geometry("BNSD", 1, geo.n1, geo.n2, geo.t1, geo.t2, geo.d, geo.dv), self.plans[0],
                    _bnsd(self.query, 0, geo.t1), _bnsd(self.key, 0, geo.t2), _bnsd(self.value, 0, geo.t2))
        if self.rope is not None:
            p.q_rope, p.k_rope = _bnsd(self.rope[0], 0, geo.t1), _bnsd(self.rope[1], 0, geo.t2)
        if self.dy is not None:
            p.dy = _bnsd(self.dy, 0, geo.t1)
        if self.out is not None:
            p.out = _bnsd(self.out, 0, geo.t1)
            p.softmax_max, p.softmax_sum = (_batch_stats(_true_tnd_order(t, self.softmax_layout, geo), "TND", geo.n1,
                                                         0, geo.t1) for t in (self.softmax_max, self.softmax_sum))
        return p

    def batch(self, b: int) -> Problem:
        """Batch b as the core's BNSD problem (views; stats [1, N1, Sq_b])."""
        q0, q1, k0, k1 = self.geo.rows(b)
        p = Problem(self.geo.batch_geometry(b), self.plans[b], _bnsd(self.query, q0, q1),
                    _bnsd(self.key, k0, k1), _bnsd(self.value, k0, k1))
        if self.rope is not None:
            p.q_rope, p.k_rope = _bnsd(self.rope[0], q0, q1), _bnsd(self.rope[1], k0, k1)
        if self.dy is not None:
            p.dy = _bnsd(self.dy, q0, q1)
        if self.out is not None:
            p.out = _bnsd(self.out, q0, q1)
            p.softmax_max = _batch_stats(self.softmax_max, self.softmax_layout, self.geo.n1, q0, q1)
            p.softmax_sum = _batch_stats(self.softmax_sum, self.softmax_layout, self.geo.n1, q0, q1)
        return p


# ------------------------------------------------------------------------------------------- checks
def check_forward(query, key, value, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors(), *,
                  outputs: tuple = NO_OUTPUTS, cann_limits: bool = False) -> VarlenProblem:
    """Validate FlashAttentionVarLenScore (TND) in CANN's order; ``outputs``: the aclnn (softmaxMaxOut,
    softmaxSumOut, attentionOutOut), checked with ``cann_limits``."""
    op = FORWARD
    check_input_layout(op, attrs.input_layout, ("TND",))  # CANN checks the layout first
    query, key, value = require_forward_tensors(op, query, key, value, outputs, cann_limits)
    head_num = check_head_num(op, attrs.head_num)
    softmax_layout = _check_softmax_layout(op, attrs.softmax_layout)
    geo = _check_tnd_inputs(op, head_num, (query, key, value), attrs, cann_limits=cann_limits)
    rope = _rope(op, geo, query, key, tensors)
    if cann_limits:
        check_forward_outputs(op, outputs, geo.stats_shape, (geo.t1, geo.n1, geo.dv), query.dtype)
    plans = _resolve_plans(op, geo, query.dtype, attrs, tensors)
    return VarlenProblem(geo, plans, query, key, value, softmax_layout=softmax_layout,
                         pse=tensors.pse if has_float_pse(plans[0]) else None, rope=rope)


def _rope(op: str, geo: VarlenGeometry, query, key, tensors: AttentionTensors):
    return check_rope(op, "TND", geo.n1, geo.n2, query, key, tensors.query_rope, tensors.key_rope)


def check_backward(query, key, value, dy, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors(),
                   *, outputs: tuple = NO_OUTPUTS, cann_limits: bool = False) -> VarlenProblem | None:
    """Validate FlashAttentionUnpaddingScoreGrad (TND) in CANN's order.

    Torch layer: softmax_max, softmax_sum and attention_in all None -> recomputed per batch; some -> 161001.
    With ``cann_limits`` they and the ``outputs`` (dqOut, dkOut, dvOut) are required, and None is returned
    when dq/dk/dv are all empty.
    """
    op = BACKWARD
    check_input_layout(op, attrs.input_layout, ("TND",))  # CANN checks the layout first
    saved = (tensors.softmax_max, tensors.softmax_sum, tensors.attention_in)
    inputs, given, nothing_to_do = require_grad_tensors(op, (query, key, value, dy), saved, outputs, cann_limits)
    if nothing_to_do:
        return None
    query, key, value, dy = inputs
    head_num = check_head_num(op, attrs.head_num)
    softmax_layout = _check_softmax_layout(op, attrs.softmax_layout)
    geo = _check_tnd_inputs(op, head_num, inputs, attrs, tensors.attention_in, cann_limits)
    rope = _rope(op, geo, query, key, tensors)
    if cann_limits:
        check_grad_outputs(op, outputs, query, key, value)
    plans = _resolve_plans(op, geo, query.dtype, attrs, tensors)
    problem = VarlenProblem(geo, plans, query, key, value, dy, softmax_layout=softmax_layout,
                            pse=tensors.pse if has_float_pse(plans[0]) else None, rope=rope)
    if given:
        problem.softmax_max, problem.softmax_sum = saved_stats(op, tensors.softmax_max, tensors.softmax_sum,
                                                               geo.stats_shape, geo.stats_rule)
        problem.out = tensors.attention_in
    return problem


# ------------------------------------------------------------------------------------------ kernels
def forward_packed(p: VarlenProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of all batches as one launch (:class:`.kernels.flash_attention.Sequence`; a batch without keys
    by the core's rule for empty problems): ``(out [T1, N1, Dv], softmax_max [T1, N1], softmax_sum [T1, N1])``
    in true TND order, each batch written in place; rows beyond the totals are 0."""
    geo = p.geo
    out = new_output((geo.t1, geo.n1, geo.dv), p.query.dtype)
    smax = torch.empty(geo.t1, geo.n1, dtype=torch.float32)
    ssum = torch.empty(geo.t1, geo.n1, dtype=torch.float32)
    total_q = geo.cum_q[-1] if geo.batch_count else 0
    for t in (out, smax, ssum):
        t[total_q:].zero_()
    sequences = []
    for b in range(geo.batch_count):
        q0, q1, k0, k1 = geo.rows(b)
        if q1 == q0:
            continue
        if degenerate(geo.batch_geometry(b)):
            forward_kernel(p.batch(b), into=_rows_of((out, smax, ssum), geo.n1, q0, q1))
        else:
            sequences.append(Sequence(q0, q1, k0, k1, p.plans[b]))
    if sequences:
        forward_kernel(p.whole(), into=_rows_of((out, smax, ssum), geo.n1, 0, geo.t1), sequences=sequences)
    return out, smax, ssum


def _rows_of(outputs: tuple, n1: int, q0: int, q1: int) -> tuple[torch.Tensor, ...]:
    """Query rows [q0, q1) of the forward's TND (out, softmax_max, softmax_sum) as BNSD views."""
    out, smax, ssum = outputs
    return _bnsd(out, q0, q1), *(_batch_stats(t, "TND", n1, q0, q1) for t in (smax, ssum))


def run_forward(p: VarlenProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(attention_out [T1, N1, Dv], softmax_max, softmax_sum [T1, N1, 8] in p.softmax_layout order)``."""
    out, smax, ssum = forward_packed(p)
    return out, _pack_stats(smax, p.softmax_layout, p.geo), _pack_stats(ssum, p.softmax_layout, p.geo)


def run_backward(p: VarlenProblem, with_dpse: bool = False) -> Grads:
    """The grad of all batches as one launch (recomputing out and stats by :func:`forward_packed` when absent; a
    batch without queries or keys by the core's zero fill): :class:`Grads`, dq, dk, dv (and dq_rope, dk_rope)
    shaped like query, key, value (and the rope parts), each batch written in place (rows beyond the totals,
    queries of batches without keys and keys of batches without queries get 0, as in CANN) and, with
    ``with_dpse`` for a float pse (pseType 0/1), dpse in the pse's TND form (batch b's gradient added at the
    place it was read from, so a shared compressed alibi sums its batches); else dpse is None. dsink: the sum
    over the batches."""
    geo = p.geo
    if p.out is None:
        out, smax, ssum = forward_packed(p)
        p = dataclasses.replace(p, out=out, softmax_max=smax, softmax_sum=ssum, softmax_layout="TND")
    packed = (p.query, p.key, p.value, *(p.rope[:2] if p.rope else ()))
    grads = tuple(new_output(t.shape, p.query.dtype) for t in packed)
    with_dpse = with_dpse and p.pse is not None
    dpse = torch.zeros(p.pse.shape, dtype=p.pse.dtype) if with_dpse else None
    sink = p.plans[0].sink
    dsink = None if sink is None else torch.zeros(sink.shape)
    total_q, total_kv = (geo.cum_q[-1], geo.cum_kv[-1]) if geo.batch_count else (0, 0)
    for i, grad in enumerate(grads):
        grad[total_q if i in (0, 3) else total_kv:].zero_()
    sequences, batches = [], []
    for b in range(geo.batch_count):
        q0, q1, k0, k1 = geo.rows(b)
        if degenerate(geo.batch_geometry(b)):  # zero-fills its rows
            backward_kernel(p.batch(b), into=_grad_rows(grads, (q0, q1, k0, k1)))
        else:
            sequences.append(Sequence(q0, q1, k0, k1, p.plans[b]))
            batches.append(b)
    if sequences:
        g = backward_kernel(p.whole(), with_dpse=with_dpse, into=_grad_rows(grads, (0, geo.t1, 0, geo.t2)),
                            sequences=sequences)
        for b, batch_dpse in zip(batches, g.dpse if with_dpse else ()):
            _batch_pse(dpse, geo, b, p.plans[b].pse_type).add_(batch_dpse)
        if dsink is not None:
            dsink += g.dsink
    return Grads(*grads[:3], dpse, *(grads[3:] or (None, None)), dsink)


def _grad_rows(grads: tuple, rows: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
    """Query rows [q0, q1) of dq (and dq_rope), key rows [k0, k1) of dk, dv (and dk_rope), as BNSD views."""
    q0, q1, k0, k1 = rows
    return tuple(_bnsd(t, *((q0, q1) if i in (0, 3) else (k0, k1))) for i, t in enumerate(grads))
