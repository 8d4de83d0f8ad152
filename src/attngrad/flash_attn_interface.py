"""flash-attn 2.x's functions (``flash_attn_func``, ``flash_attn_varlen_func`` and the packed forms) on attngrad.

Same names, arguments, defaults and results as ``flash_attn.flash_attn_interface``; every call runs through
:func:`attngrad.npu.npu_fusion_attention_v2` (hence attngrad's FlashAttentionScore contract, its tiled kernels
and its autograd). The flash-attn rules are mapped onto CANN's attributes (docs/interop.md, 'Mapping onto
CANN'):

* ``softmax_scale`` (default ``headdim ** -0.5``) -> ``scale``; ``dropout_p`` -> ``keep_prob = 1 - dropout_p``
  with a seed drawn from torch's default generator (``torch.manual_seed`` reproduces it);
* causal / ``window_size=(left, right)`` are aligned to the bottom-right corner (key j is visible from query
  i iff ``i + Skv - Sq - left <= j <= i + Skv - Sq + right``, -1 = unbounded, causal sets right = 0):
  sparse mode 3 (causal) or 4 (right-down band, pre/next tokens = left/right), so tiles outside the band
  are skipped; no [Sq, Skv] mask is built;
* ``alibi_slopes`` ``[nheads]`` / ``[batch, nheads]`` float32 add ``-slope * |i + Skv - Sq - j|`` to the
  scaled scores: the generated alibi of pse type 2. CANN generates it for Sq == Skv only, so other shapes
  run as square ``Skv x Skv`` blocks of query rows (docs/interop.md, 'alibi with seqlen_q != seqlen_k').

A query row that sees no key gets output 0, zero gradients and ``softmax_lse = +inf``, as in flash-attn.

``sink`` (attngrad's extension, gpt-oss style; keyword of every function): float32 ``[nheads]``, one more logit
per head in every row's softmax that carries no value (differentiable; ``softmax_lse`` includes it, and a row
without keys then attends to the sink only: output 0, ``softmax_lse = sink``). See docs/cann-semantics.md,
'Rope parts and attention sink'.
Unsupported flash-attn features raise :class:`attngrad.AclnnError` 161002 naming the argument.
"""

from __future__ import annotations

import copy
import math

import torch

from .kernels.flash_attention_plan import UNBOUNDED_TOKENS
from .npu import npu_fusion_attention_v2
from .validation import (check_dim_equal, check_float, check_int, check_int_list, check_int_tensor, check_range,
                         check_rank, invalid, require_tensor)

COMPRESSED_MASK_SIZE = 2048                # sparse modes 3/4 take the [2048, 2048] strict upper triangle
EMPTY_ROW_MAX = torch.finfo(torch.float32).min   # softmax_max of a row with no visible key (invalid-row mode)


# The [2048, 2048] bool strict upper triangle (True = masked) that sparse modes 3 and 4 take; built once at import
# (4 MiB), so that compiled graphs take it as a constant instead of building it on every call.
_CAUSAL_MASK = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(1)


class _Attention:
    """The checked flash-attn arguments of one call.

    ``window``: bottom-right ``(pre, next)`` tokens with ``UNBOUNDED_TOKENS`` for -1, or None for full attention
    (flash-attn's normalisation: a side >= the key length (varlen: max_seqlen_k) is unbounded).
    """

    def __init__(self, op, head_dim, seqlen_k, *, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, sink=None):
        self.op = op
        self.sink = sink
        dropout_p = check_float(op, "dropout_p", dropout_p)
        check_range(op, "dropout_p", dropout_p, 0.0, 1.0, high_open=True)
        self.keep_prob = 1.0 - dropout_p
        if check_float(op, "softcap", softcap) > 0:
            raise invalid(op, "softcap", "softcapping (softcap > 0) is not supported", softcap)
        self.scale = (head_dim ** -0.5 if head_dim else 1.0) if softmax_scale is None else softmax_scale
        self.slopes = alibi_slopes
        self.window = _window(op, window_size, bool(causal), seqlen_k)
        self.seed = int(torch.randint(0, 2**62, (1,))) if dropout_p > 0 else 0

    def run(self, q, k, v, layout, *, offset=0, window=None, q_start=0, **varlen):
        """One npu_fusion_attention_v2 call -> ``(out, softmax_max, softmax_sum)`` with the stats' element 0.
        ``window``: (pre, next) tokens of the call's own sparse mode 4 (default: self.window, bottom-right)."""
        pre, nxt = window or self.window or (None, None)
        kwargs = {}
        if pre is not None:
            kwargs.update(atten_mask=_CAUSAL_MASK, pre_tokens=pre, next_tokens=nxt,
                          sparse_mode=3 if (pre, nxt) == (UNBOUNDED_TOKENS, 0) else 4)
        if self.slopes is not None:
            kwargs.update(pse=self.slopes, pse_type=2, q_start_idx=[q_start], kv_start_idx=[0])
        out, softmax_max, softmax_sum, *_ = npu_fusion_attention_v2(
            q, k, v, q.shape[-2], layout, scale=self.scale, keep_prob=self.keep_prob, seed=self.seed,
            offset=offset, sink=self.sink, **kwargs, **varlen)
        return out, softmax_max[..., 0], softmax_sum[..., 0]


def _window(op: str, window_size, causal: bool, seqlen_k: int):
    """``window_size`` (two ints >= -1) and ``causal`` -> bottom-right (pre, next) tokens, or None."""
    if not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise invalid(op, "window_size", "must be a pair (left, right)", repr(window_size))
    sides = []
    for value in window_size:
        value = check_int(op, "window_size", value)
        check_range(op, "window_size", value, -1)
        sides.append(UNBOUNDED_TOKENS if value < 0 or value >= seqlen_k else value)
    if causal:
        sides[1] = 0
    return None if sides == [UNBOUNDED_TOKENS, UNBOUNDED_TOKENS] else tuple(sides)


def _dropout_span(heads: int, sq: int, skv: int) -> int:
    """Dropout counters one sequence may use (>= heads * Sq * Skv, and >= what its alibi blocks use): the next
    sequence's offset, so that no two sequences share a random stream."""
    return heads * (sq + skv) * skv


def _result(out, softmax_max, softmax_sum, return_attn_probs):
    """flash-attn's results from ``out`` (``[..., S, H, Dv]``) and the stats (``[..., H, S]``): a row without keys
    (softmax_max -FLT_MAX) keeps output 0 but passes no gradient (CANN's invalid-row backward would leave
    ~1e-39 there); softmax_lse = max + log(sum), +inf for such rows."""
    empty = softmax_max == EMPTY_ROW_MAX
    out = torch.where(empty.transpose(-1, -2)[..., None], 0.0, out)  # no data-dependent branch: it compiles
    if not return_attn_probs:
        return out
    return out, torch.where(empty, math.inf, softmax_max + softmax_sum.log()), None


# ------------------------------------------------------------------------------------------- batched
def _attention_bsnd(att: _Attention, q, k, v, offset=0):
    """q ``[B, Sq, H, D]``, k/v ``[B, Skv, Hk, D|Dv]`` -> ``(out [B, Sq, H, Dv], max [B, H, Sq], sum [B, H, Sq])``."""
    if att.slopes is not None and 0 in (q.shape[1], k.shape[1]):  # no scores: the alibi changes nothing
        att = copy.copy(att)
        att.slopes = None
    if att.slopes is None or q.shape[1] == k.shape[1]:
        return att.run(q, k, v, "BSND", offset=offset)
    return _alibi_square_blocks(att, q, k, v, offset)


def _alibi_square_blocks(att: _Attention, q, k, v, offset):
    """Generated alibi with Sq != Skv: the query rows as ``Skv``-row blocks aligned at the bottom, each a square
    problem (the top one padded with zero rows in front). A block ending at row ``end`` is shifted by
    ``c = end - Sq`` (<= 0): its pse is ``-slope * |r + c - j|`` (qStartIdx = c) and its band is left-up
    ``(pre - c, next + c)``. Blocks whose band selects no key are skipped (output 0, max -FLT_MAX)."""
    b, sq, h, _ = q.shape
    skv = k.shape[1]
    pieces = []
    # each block takes its own cast of one float32 copy of k and v (exact both ways), so that autograd sums the
    # blocks' dK / dV in float32 and rounds once, as flash-attn accumulates them
    key, value = _widened_for_grad(k), _widened_for_grad(v)
    for index, end in enumerate(range(sq, 0, -skv)):
        start, shift = max(end - skv, 0), end - sq
        band = att.window and tuple(UNBOUNDED_TOKENS if side == UNBOUNDED_TOKENS else side + sign * shift
                                    for side, sign in zip(att.window, (-1, 1)))
        if band and band[1] < 1 - skv:
            pieces.append(_rows_without_keys(att, q, v, end - start))
            continue
        pad = skv - (end - start)
        rows = torch.cat([q.new_zeros(b, pad, h, q.shape[3]), q[:, start:end]], 1) if pad else q[:, start:end]
        out, smax, ssum = att.run(rows, key.to(k.dtype), value.to(v.dtype), "BSND",
                                  offset=offset + index * b * h * skv * skv, window=band, q_start=shift)
        pieces.append((out[:, pad:], smax[:, :, pad:], ssum[:, :, pad:]))
    out, smax, ssum = zip(*reversed(pieces))
    return torch.cat(out, 1), torch.cat(smax, 2), torch.cat(ssum, 2)


def _widened_for_grad(t: torch.Tensor) -> torch.Tensor:
    """t as float32 where autograd will take its gradient, else t itself (``.to(t.dtype)`` of the result is then
    t, no copy)."""
    return t.float() if torch.is_grad_enabled() and t.requires_grad else t


def _rows_without_keys(att: _Attention, q, v, rows: int):
    """The results of ``rows`` query rows that see no key, as the kernel gives them: output 0, softmax_sum 1 and
    softmax_max -FLT_MAX, or with a sink the head's sink logit (the row's softmax is all sink)."""
    b, _, h, _ = q.shape
    if att.sink is None:
        softmax_max = q.new_full((b, h, rows), EMPTY_ROW_MAX, dtype=torch.float32)
    else:
        softmax_max = att.sink.detach().reshape(1, h, 1).expand(b, h, rows)
    return q.new_zeros(b, rows, h, v.shape[3]), softmax_max, torch.ones(b, h, rows)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sink=None):
    """flash-attn's attention over ``[batch, seqlen, nheads, headdim]`` tensors (GQA: k/v with nheads_k dividing
    nheads) -> ``out [batch, seqlen_q, nheads, headdim_v]`` in q's dtype, or with ``return_attn_probs``
    ``(out, softmax_lse [batch, nheads, seqlen_q] float32, None)``.

    causal and ``window_size=(left, right)`` are aligned to the bottom-right corner; ``alibi_slopes``
    ``[nheads]`` / ``[batch, nheads]`` float32 adds ``-slope * |i + seqlen_k - seqlen_q - j|``. Differentiable
    w.r.t. q, k, v (and ``sink``, module docstring); ``deterministic`` has no effect (the backward always is).
    """
    op = "flash_attn_func"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(op, name, require_tensor(op, name, t), (4,))
    att = _Attention(op, q.shape[-1], k.shape[1], dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sink=sink)
    return _result(*_attention_bsnd(att, q, k, v), return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              sink=None):
    """:func:`flash_attn_func` on ``qkv [batch, seqlen, 3, nheads, headdim]``."""
    q, k, v = _unpack("flash_attn_qkvpacked_func", "qkv", qkv, 5, 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sink=sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             sink=None):
    """:func:`flash_attn_func` on q and ``kv [batch, seqlen_k, 2, nheads_k, headdim]``."""
    k, v = _unpack("flash_attn_kvpacked_func", "kv", kv, 5, 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sink=sink)


def _unpack(op: str, name: str, packed, rank: int, dim: int, count: int):
    """The ``count`` tensors stacked along ``dim`` of a packed argument (views: gradients flow back)."""
    check_rank(op, name, require_tensor(op, name, packed), (rank,))
    check_dim_equal(op, name, packed, dim, count, "the packing")
    return packed.unbind(dim)


# -------------------------------------------------------------------------------------------- varlen
def _cumulative(op: str, name: str, cu_seqlens):
    """flash-attn's ``cu_seqlens`` ``[batch + 1]`` starting at 0 -> CANN's cumulative ends ``[batch]``. A tensor
    stays a tensor (a view): under torch.compile its values are graph data, checked by the operator's kernel."""
    if isinstance(cu_seqlens, torch.Tensor):
        check_int_tensor(op, name, cu_seqlens)
        if cu_seqlens.numel() == 0 or (not torch.compiler.is_compiling() and int(cu_seqlens[0]) != 0):
            raise invalid(op, name, "must be [batch + 1] cumulative lengths starting with 0", cu_seqlens.tolist())
        return cu_seqlens[1:]
    values = check_int_list(op, name, cu_seqlens)
    if not values or values[0] != 0:
        raise invalid(op, name, "must be [batch + 1] cumulative lengths starting with 0", values)
    return values[1:]


def _attention_varlen(att: _Attention, q, k, v, ends_q, ends_k):
    """TND q ``[total_q, H, D]`` -> ``(out [total_q, H, Dv], max [H, total_q], sum [H, total_q])``; ``ends_*``:
    the cumulative ends as a list or a 1-D integer tensor.

    One TND call, except for a generated alibi with some ``Sq_b != Skv_b`` (CANN generates it for square
    batches only): then each sequence runs as its own batched problem."""
    if att.slopes is not None:  # the alibi cases depend on the lengths' values
        ends_q, ends_k = (e.tolist() if isinstance(e, torch.Tensor) else e for e in (ends_q, ends_k))
        lengths = list(zip(_lengths(ends_q), _lengths(ends_k)))
    if att.slopes is None or all(sq == skv > 0 for sq, skv in lengths):
        out, smax, ssum = att.run(q, k, v, "TND", actual_seq_qlen=ends_q, actual_seq_kvlen=ends_k,
                                  softmax_layout="TND")
        return out, smax.T, ssum.T
    if att.slopes.dim() == 2 and att.slopes.shape[0] != len(lengths):
        raise invalid(att.op, "alibi_slopes", f"must be [nheads] or [batch = {len(lengths)}, nheads]",
                      list(att.slopes.shape))
    pieces, offset = [], 0
    for b, (q1, k1) in enumerate(zip(ends_q, ends_k)):
        q0, k0 = (ends_q[b - 1], ends_k[b - 1]) if b else (0, 0)
        sequence = copy.copy(att)
        sequence.slopes = att.slopes if att.slopes.dim() == 1 else att.slopes[b:b + 1]
        out, smax, ssum = _attention_bsnd(sequence, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], offset)
        pieces.append((out[0], smax[0], ssum[0]))
        offset += _dropout_span(q.shape[1], q1 - q0, k1 - k0)
    out, smax, ssum = zip(*pieces)
    return torch.cat(out), torch.cat(smax, 1), torch.cat(ssum, 1)


def _lengths(ends: list[int]) -> list[int]:
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sink=None):
    """flash-attn's varlen attention: q ``[total_q, nheads, headdim]``, k/v ``[total_k, nheads_k, headdim]``
    packed by ``cu_seqlens_q`` / ``cu_seqlens_k`` (``[batch + 1]`` int, starting at 0) -> ``out [total_q,
    nheads, headdim_v]``, or ``(out, softmax_lse [nheads, total_q] float32, None)``.

    Each sequence is its own problem (causal / windows bottom-right per sequence). ``max_seqlen_k`` only
    bounds the window (a side >= it is unbounded, as in flash-attn); ``max_seqlen_q`` is not used.
    ``block_table`` (paged KV) is not supported.
    """
    op = "flash_attn_varlen_func"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(op, name, require_tensor(op, name, t), (3,))
    if block_table is not None:
        raise invalid(op, "block_table", "(paged KV cache) is not supported", type(block_table).__name__)
    ends_q, ends_k = _cumulative(op, "cu_seqlens_q", cu_seqlens_q), _cumulative(op, "cu_seqlens_k", cu_seqlens_k)
    att = _Attention(op, q.shape[-1], check_int(op, "max_seqlen_k", max_seqlen_k), dropout_p=dropout_p,
                     softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, sink=sink)
    return _result(*_attention_varlen(att, q, k, v, ends_q, ends_k), return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sink=None):
    """:func:`flash_attn_varlen_func` on ``qkv [total, 3, nheads, headdim]`` (one ``cu_seqlens``)."""
    q, k, v = _unpack("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 4, 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  sink=sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sink=None):
    """:func:`flash_attn_varlen_func` on q and ``kv [total_k, 2, nheads_k, headdim]``."""
    k, v = _unpack("flash_attn_varlen_kvpacked_func", "kv", kv, 4, 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sink=sink)
