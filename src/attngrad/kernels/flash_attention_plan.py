"""The resolved description of one FlashAttentionScore(Grad) problem that the kernels execute.

The contracts (on :mod:`attngrad.ops.flash_attention_core`) validate the user's arguments, convert the layout
to BNSD and resolve masks, sparse modes, tokens, prefix, pse and dropout into an :class:`AttentionPlan`; the
kernels and the float64 reference read only this plan and never validate. A kernel raises
``NotImplementedError`` for a plan feature it does not implement (nothing is ever silently ignored).

The sparse-mode index rules live here too (pure functions of the sizes, no validation), so the dense and
the varlen (TND) contracts and the benchmarks share them: :func:`sparse_rule` (modes 0-6),
:func:`varlen_sparse_bands` (modes 7/8, per batch) and :func:`visible_pairs` (effective work).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

UNBOUNDED_TOKENS = 2**31 - 1
MASKED_LOGIT = -3.4028234663852886e38  # -FLT_MAX (0xFF7FFFFF): the logit of an excluded position, not -inf
FLT_MAX = 3.4028234663852886e38        # softmax_sum of a fully masked row in invalid-row mode
ALIBI_ROWS = 1024                      # rows of the alibi-compressed pse [B|1, N1, 1024, Skv]
MASK_READ_MODES = (0, 1, 5)            # modes whose attenMask content is applied element-wise


@dataclass(frozen=True)
class AttentionPlan:
    """Per-problem attributes in BNSD terms (B batch, N1 query heads, Sq / Skv sequence lengths).

    Key j is visible from query i of batch b iff ``(i - pre_tokens <= j <= i + next_tokens or
    j < prefix[b]) and not atten_mask[b, n, i, j]``; excluded logits are -FLT_MAX.

    * ``scale``: scaleValue, applied as float32.
    * ``pse_type``: 1 -> ``S = (QK^T + pse) * scale``; 0/2/3 -> ``S = QK^T * scale + pse``.
    * ``atten_mask``: bool/uint8 ``[Bm, Nm, Sq, Skv]`` with Bm in {1, B}, Nm in {1, N1}; nonzero = excluded.
      None when the sparse mode's index rule already implies the mask (compressed masks, modes 2/3/4/6).
    * ``pre_tokens`` / ``next_tokens``: band with LEFT-UP origin (see :func:`sparse_rule`);
      ``UNBOUNDED_TOKENS`` means no bound on that side.
    * ``prefix``: per-batch prefix lengths (sparse modes 5/6) or None (= all 0).
    * ``keep_prob`` / ``drop_mask``: dropout; ``drop_mask`` is CANN's flat uint8 bit-packed keep mask,
      LSB first, bit ``((b*N1 + n1)*Sq + i)*Skv + j`` (1 = keep). Ignored when ``keep_prob == 1``.
    * ``pse``: pse_type 0/1: a float ``[Bp, N1, Sp, Skv]`` (Bp in {1, B}, Sp in {1, Sq}) broadcast to
      ``[B, N1, Sq, Skv]``, or with ``pse_compressed`` the alibi-compressed ``[Bp, N1, 1024, Skv]`` read
      through :func:`alibi_source`; pse_type 2/3: float32 slopes ``[Bs, N1]`` (Bs in {1, B}), the pse is
      ``-slope * |j + kv_start_idx - i - q_start_idx|`` (type 3: its square root).
    * ``invalid_rows``: innerPrecise=2 semantics for fully masked rows (forward only): P = 0, out = 0,
      softmax_max = -FLT_MAX, softmax_sum = +FLT_MAX.
    * ``widen_gemm``: q, k, v, dy are widened once to float32 and every GEMM runs in float32;
      ``round_probs``: P and dS are rounded to the input dtype before their GEMMs (the NPU's order; with
      ``widen_gemm`` the rounded values are widened again, exactly). Without ``widen_gemm`` the GEMMs take the
      input dtype, so P and dS are rounded whatever ``round_probs`` says. The golden precision mode is
      ``widen_gemm`` without ``round_probs``; the backward then takes ``D = rowsum(P * dP)`` from the unrounded
      float32 output instead of the given attention_in.
    * ``sink``: float32 ``[N1]`` or None: head n's softmax has one more logit ``sink[n]`` that carries no value
      (its max and sum include it, so a row's P sums to less than 1; a fully masked row attends to the sink only).
    """

    scale: float
    pse_type: int = 1
    atten_mask: torch.Tensor | None = None
    pre_tokens: int = UNBOUNDED_TOKENS
    next_tokens: int = UNBOUNDED_TOKENS
    prefix: tuple[int, ...] | None = None
    keep_prob: float = 1.0
    drop_mask: torch.Tensor | None = None
    pse: torch.Tensor | None = None
    pse_compressed: bool = False
    q_start_idx: int = 0
    kv_start_idx: int = 0
    invalid_rows: bool = False
    widen_gemm: bool = False
    round_probs: bool = True
    sink: torch.Tensor | None = None

    @property
    def has_band(self) -> bool:
        """True when pre_tokens or next_tokens restricts the visible keys."""
        return self.pre_tokens < UNBOUNDED_TOKENS or self.next_tokens < UNBOUNDED_TOKENS

    @property
    def has_dropout(self) -> bool:
        return self.keep_prob < 1.0

    @property
    def alibi_generated(self) -> bool:
        """pse_type 2/3: the pse is generated from slopes."""
        return self.pse is not None and self.pse_type in (2, 3)


# ------------------------------------------------------------------------------------- index rules
def normalize_band(pre: int, nxt: int, sq: int, skv: int) -> tuple[int, int]:
    """Left-up band with vacuous bounds replaced by ``UNBOUNDED_TOKENS`` (pre >= Sq-1 or next >= Skv-1)."""
    return (UNBOUNDED_TOKENS if pre >= sq - 1 else pre, UNBOUNDED_TOKENS if nxt >= skv - 1 else nxt)


def sparse_rule(sparse_mode: int, pre_tokens: int, next_tokens: int, sq: int, skv: int,
                prefix: list[int] | None = None) -> tuple[int, int, list[int] | None]:
    """Index rule of sparse modes 0-6 for one batch geometry -> left-up ``(pre, next, prefix)``.

    Key j is visible from query i iff ``i - pre <= j <= i + next`` or ``j < prefix[b]`` (then the mask of
    modes 0/1/5 is applied on top). Mode 0: the tokens as given; 1: everything; 2: ``j <= i``; 3: ``j <= i
    + Skv - Sq``; 4: right-down band, ``pre' = pre + Sq - Skv``, ``next' = next + Skv - Sq``; 5/6: ``j <= i
    + Skv - Sq`` or ``j < prefix[b]`` (mode 5 without prefix: mask only). Valid per batch, so the varlen
    contract calls it with each batch's Sq_b / Skv_b.
    """
    unbounded = (UNBOUNDED_TOKENS, UNBOUNDED_TOKENS, None)
    if sparse_mode == 0:
        return (*normalize_band(pre_tokens, next_tokens, sq, skv), None)
    if sparse_mode == 2:
        return (*normalize_band(UNBOUNDED_TOKENS, 0, sq, skv), None)
    if sparse_mode == 3:
        return (*normalize_band(UNBOUNDED_TOKENS, skv - sq, sq, skv), None)
    if sparse_mode == 4:
        return (*normalize_band(pre_tokens + sq - skv, next_tokens + skv - sq, sq, skv), None)
    if sparse_mode in (5, 6) and prefix is not None:
        return (*normalize_band(UNBOUNDED_TOKENS, skv - sq, sq, skv), list(prefix))
    return unbounded


def varlen_sparse_bands(sparse_mode: int, pre_tokens: int, next_tokens: int, sq_lens: list[int],
                        skv_lens: list[int]) -> list[tuple[int, int]]:
    """Per-batch left-up ``(pre, next)`` of the varlen split modes 7/8 (TND only).

    ``sq_lens`` / ``skv_lens`` are per-batch lengths (not cumulative). The band batch (mode 7: the LAST batch
    with Sq_b != 0; mode 8: the FIRST) gets the right-down band of mode 4; the other batches get right-down
    causal (mode 7, as mode 3) or left-up causal (mode 8, as mode 2).
    """
    if sparse_mode not in (7, 8):
        raise ValueError(f"varlen_sparse_bands: sparse mode {sparse_mode} is not a varlen split mode")
    filled = [b for b, s in enumerate(sq_lens) if s != 0]
    band_batch = (filled[-1] if sparse_mode == 7 else filled[0]) if filled else -1
    other = 3 if sparse_mode == 7 else 2
    return [sparse_rule(4 if b == band_batch else other, pre_tokens, next_tokens, sq, skv)[:2]
            for b, (sq, skv) in enumerate(zip(sq_lens, skv_lens))]


def band_row_counts(sq: int, skv: int, pre: int, nxt: int, prefix: int = 0) -> np.ndarray:
    """int64 [Sq]: keys visible from each query row under the band ``i - pre <= j <= i + next`` or ``j < prefix``."""
    i = np.arange(sq, dtype=np.int64)
    lo = np.clip(i - min(pre, skv + sq), 0, skv)
    hi = np.clip(i + min(nxt, skv + sq) + 1, 0, skv)
    band = np.maximum(hi - lo, 0)
    pfx = min(max(prefix, 0), skv)
    overlap = np.where(hi > lo, np.maximum(np.minimum(hi, pfx) - lo, 0), 0)
    return band + pfx - overlap


def visible_pairs(plan: AttentionPlan, b: int, n1: int, sq: int, skv: int) -> int:
    """Number of visible (query, key) pairs over all B batches and N1 heads (the effective work).

    Exact for every mode: closed form per row for the band and prefix; with an atten_mask the mask is
    counted densely (one [Sq, Skv] slice at a time).
    """
    total = 0
    for batch in range(b):
        pfx = plan.prefix[batch] if plan.prefix is not None else 0
        if plan.atten_mask is None:
            total += n1 * int(band_row_counts(sq, skv, plan.pre_tokens, plan.next_tokens, pfx).sum())
            continue
        i = torch.arange(sq).view(sq, 1)
        j = torch.arange(skv).view(1, skv)
        rule = ((j >= i - plan.pre_tokens) & (j <= i + plan.next_tokens)) | (j < pfx)
        for n in range(n1):
            mask = plan.atten_mask[batch % plan.atten_mask.shape[0], n % plan.atten_mask.shape[1]]
            total += int((rule & (mask == 0)).sum())
    return total


def alibi_source(i: int, j: int, sq: int, skv: int) -> tuple[int, int]:
    """(row, col) of the alibi-compressed pse ``[.., 1024, Skv]`` that holds the full pse at (i, j).

    Rows ``i >= Sq - 1024`` are stored as they are; earlier rows reuse the Toeplitz diagonal:
    ``m = i % 1024``, col ``Skv - (i - j) - (1024 - m)``. Defined for ``j <= i`` (the causal part the
    precondition keeps); other columns are clamped into range (their logits are masked).
    """
    if i >= sq - ALIBI_ROWS:
        return i - (sq - ALIBI_ROWS), j
    m = i % ALIBI_ROWS
    return m, min(max(skv - (i - j) - (ALIBI_ROWS - m), 0), skv - 1)
