"""The resolved description of one FlashAttentionScore(Grad) problem that the kernels execute.

The contract (:mod:`attngrad.ops.flash_attention`) validates the user's arguments, converts the layout to
BNSD and resolves masks, sparse modes and tokens into an :class:`AttentionPlan`; the kernels and the
float64 reference read only this plan and never validate. A kernel raises ``NotImplementedError`` for a
plan feature it does not implement (nothing is ever silently ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNBOUNDED_TOKENS = 2**31 - 1
MASKED_LOGIT = -3.4028234663852886e38  # -FLT_MAX (0xFF7FFFFF): the logit of an excluded position, not -inf
FLT_MAX = 3.4028234663852886e38        # softmax_sum of a fully masked row in invalid-row mode


@dataclass(frozen=True)
class AttentionPlan:
    """Per-problem attributes in BNSD terms (B batch, N1 query heads, Sq / Skv sequence lengths).

    * ``scale``: scaleValue, applied as float32.
    * ``pse_type``: 1 -> ``S = (QK^T + pse) * scale``; 0/2/3 -> ``S = QK^T * scale + pse``.
    * ``atten_mask``: bool/uint8 ``[Bm, Nm, Sq, Skv]`` with Bm in {1, B}, Nm in {1, N1}; nonzero = excluded.
    * ``pre_tokens`` / ``next_tokens``: band with LEFT-UP origin: key j is visible from query i iff
      ``i - pre_tokens <= j <= i + next_tokens`` (the contract converts sparse modes 2/3/4 to this form);
      ``UNBOUNDED_TOKENS`` means no bound on that side.
    * ``keep_prob`` / ``drop_mask``: dropout; ``drop_mask`` is CANN's flat uint8 bit-packed keep mask,
      LSB first, bit ``((b*N1 + n1)*Sq + i)*Skv + j`` (1 = keep). Ignored when ``keep_prob == 1``.
    * ``pse``: float tensor broadcastable to ``[B, N1, Sq, Skv]`` (dense; the contract expands compressed
      forms).
    * ``invalid_rows``: innerPrecise=2 semantics for fully masked rows (forward only): P = 0, out = 0,
      softmax_max = -FLT_MAX, softmax_sum = +FLT_MAX.
    """

    scale: float
    pse_type: int = 1
    atten_mask: torch.Tensor | None = None
    pre_tokens: int = UNBOUNDED_TOKENS
    next_tokens: int = UNBOUNDED_TOKENS
    keep_prob: float = 1.0
    drop_mask: torch.Tensor | None = None
    pse: torch.Tensor | None = None
    invalid_rows: bool = False

    @property
    def has_band(self) -> bool:
        """True when pre_tokens or next_tokens restricts the visible keys."""
        return self.pre_tokens < UNBOUNDED_TOKENS or self.next_tokens < UNBOUNDED_TOKENS

    @property
    def has_dropout(self) -> bool:
        return self.keep_prob < 1.0

    def unsupported_features(self) -> list[str]:
        """Names of the plan features beyond the core (scale only), for kernels that lack them."""
        names = []
        if self.atten_mask is not None:
            names.append("atten_mask")
        if self.has_band:
            names.append("pre_tokens/next_tokens band")
        if self.has_dropout:
            names.append("dropout")
        if self.pse is not None:
            names.append("pse")
        if self.invalid_rows:
            names.append("invalid_rows")
        return names
