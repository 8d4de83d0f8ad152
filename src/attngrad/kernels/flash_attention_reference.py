"""Plain float64 reference of FlashAttentionScore and FlashAttentionScoreGrad: the golden of the tests.

BNSD throughout: q ``[B, N1, Sq, D]``, k ``[B, N2, Skv, D]``, v ``[B, N2, Skv, Dv]``, dy / out
``[B, N1, Sq, Dv]``; query head n uses kv head ``n // (N1 // N2)``. Every feature of
:class:`~attngrad.kernels.flash_attention_plan.AttentionPlan` is implemented densely here (mask, band,
pse, dropout, invalid rows), so this module is the golden for all of them.

Logits (docs/cann-semantics.md, 'Position shift (pse)'): pse_type 1: ``S = (QK^T + pse) * scale``;
otherwise ``S = QK^T * scale + pse``; excluded positions get ``-FLT_MAX``. The backward mirrors CANN: it
uses the GIVEN softmax_max, softmax_sum and out (attentionIn), never recomputed ones. Inputs are used as
given (already rounded to their dtype); results are float64.
"""

from __future__ import annotations

import numpy as np
import torch

from .flash_attention_plan import ALIBI_ROWS, FLT_MAX, MASKED_LOGIT, AttentionPlan


def _f32(x: float) -> float:
    return float(np.float32(x))


def _expand_kv(t: torch.Tensor, n1: int) -> torch.Tensor:
    """[B, N2, S, D] -> [B, N1, S, D]: query head n reads kv head n // G."""
    return t.double().repeat_interleave(n1 // t.shape[1], dim=1)


def _reduce_kv(t: torch.Tensor, n2: int) -> torch.Tensor:
    """[B, N1, S, D] -> [B, N2, S, D]: sum over the G query heads of each kv head."""
    b, n1, s, d = t.shape
    return t.view(b, n2, n1 // n2, s, d).sum(2)


def excluded_positions(plan: AttentionPlan, b: int, n1: int, sq: int, skv: int) -> torch.Tensor:
    """Bool ``[B|1, N1|1, Sq, Skv]``: True where the atten_mask is nonzero or the key is outside both the
    band and the batch's prefix."""
    i = torch.arange(sq).view(1, 1, sq, 1)
    j = torch.arange(skv).view(1, 1, 1, skv)
    out = (j < i - plan.pre_tokens) | (j > i + plan.next_tokens)
    if plan.prefix is not None:
        out = out & (j >= torch.tensor(plan.prefix).view(b, 1, 1, 1))
    if plan.atten_mask is not None:
        out = out | (plan.atten_mask != 0)
    return out


def dense_pse(plan: AttentionPlan, pse: torch.Tensor | None, sq: int, skv: int) -> torch.Tensor | float:
    """The pse term broadcastable to ``[B, N1, Sq, Skv]`` float64, differentiable w.r.t. ``pse``.

    ``pse`` is ``plan.pse`` (or a float64 leaf standing for it). Compressed alibi: gathered through
    :func:`~attngrad.kernels.flash_attention_plan.alibi_source`; pse_type 2/3: generated from the slopes.
    """
    if pse is None:
        return 0.0
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(skv).view(1, skv)
    if plan.pse_type in (2, 3):
        dist = (j + plan.kv_start_idx - i - plan.q_start_idx).abs().double()
        dist = dist.sqrt() if plan.pse_type == 3 else dist
        return -pse.double().view(pse.shape[0], pse.shape[1], 1, 1) * dist
    if not plan.pse_compressed:
        return pse.double()
    tail = i >= sq - ALIBI_ROWS
    m = i % ALIBI_ROWS
    rows = torch.where(tail, i - (sq - ALIBI_ROWS), m).expand(sq, skv)
    cols = torch.where(tail, j, (skv - (i - j) - (ALIBI_ROWS - m)).clamp(0, skv - 1))
    return pse.double()[:, :, rows, cols]


def keep_mask(plan: AttentionPlan, shape: tuple[int, int, int, int]) -> torch.Tensor | None:
    """The dropout keep factor ``M / keep_prob`` as float64 ``shape`` (None when there is no dropout).

    Bits of ``plan.drop_mask`` are LSB first over the flat [B, N1, Sq, Skv] index.
    """
    if not plan.has_dropout:
        return None
    count = int(np.prod(shape))
    packed = plan.drop_mask.reshape(-1).to(torch.uint8).numpy()
    bits = np.unpackbits(packed, count=count, bitorder="little").reshape(shape)
    return torch.from_numpy(bits.astype(np.float64)) / _f32(plan.keep_prob)


def logits(q: torch.Tensor, k: torch.Tensor, plan: AttentionPlan, pse: torch.Tensor | None = None
           ) -> torch.Tensor:
    """S ``[B, N1, Sq, Skv]`` float64 with scale, pse and the -FLT_MAX fill of excluded positions.

    ``pse`` replaces ``plan.pse`` (a float64 leaf, to differentiate w.r.t. it)."""
    b, n1, sq, _ = q.shape
    skv = k.shape[2]
    s = q.double() @ _expand_kv(k, n1).transpose(-1, -2)
    pse = dense_pse(plan, plan.pse if pse is None else pse, sq, skv)
    scale = _f32(plan.scale)
    s = (s + pse) * scale if plan.pse_type == 1 else s * scale + pse
    s = s.expand(b, n1, sq, skv)
    return s.masked_fill(excluded_positions(plan, b, n1, sq, skv), MASKED_LOGIT)


def flash_attention_forward_reference(q, k, v, plan: AttentionPlan):
    """Returns ``(out [B,N1,Sq,Dv], softmax_max [B,N1,Sq], softmax_sum [B,N1,Sq])``, all float64.

    Fully masked rows: max = -FLT_MAX, sum = Skv, uniform P (normal mode); with ``plan.invalid_rows``
    P = 0, out = 0 and sum = +FLT_MAX (docs/cann-semantics.md, 'Fully masked rows').
    """
    n1 = q.shape[1]
    s = logits(q, k, plan)
    row_max = s.amax(-1) if s.shape[-1] else torch.full(s.shape[:-1], MASKED_LOGIT, dtype=torch.float64)
    e = torch.exp(s - row_max.unsqueeze(-1))
    row_sum = e.sum(-1)
    p = e / row_sum.unsqueeze(-1)
    if plan.invalid_rows:
        invalid = row_max == MASKED_LOGIT
        p = p.masked_fill(invalid.unsqueeze(-1), 0.0)
        row_sum = row_sum.masked_fill(invalid, FLT_MAX)
    factor = keep_mask(plan, tuple(s.shape))
    pd = p if factor is None else p * factor
    out = pd @ _expand_kv(v, n1)
    return out, row_max, row_sum


def _round(t: torch.Tensor, round_to: torch.dtype | None) -> torch.Tensor:
    return t if round_to is None else t.to(round_to).double()


def flash_attention_backward_reference(q, k, v, dy, out, softmax_max, softmax_sum, plan: AttentionPlan,
                                       round_to: torch.dtype | None = None):
    """Returns ``(dq, dk, dv)`` float64 shaped like q, k, v (docs/cann-semantics.md, 'FlashAttentionScoreGrad').

    ``softmax_max`` / ``softmax_sum`` are ``[B, N1, Sq]`` (element 0 of CANN's 8 copies), used as given.
    ``round_to`` (e.g. torch.float16) emulates the kernel rounding Pd and dS to the input dtype before
    their GEMMs.
    """
    n1, n2 = q.shape[1], k.shape[1]
    s = logits(q, k, plan)
    p = torch.exp(s - softmax_max.double().unsqueeze(-1)) / softmax_sum.double().unsqueeze(-1)
    factor = keep_mask(plan, tuple(s.shape))
    dyd = dy.double()
    pd = p if factor is None else p * factor
    dv = _round(pd, round_to).transpose(-1, -2) @ dyd
    dp = dyd @ _expand_kv(v, n1).transpose(-1, -2)
    dpd = dp if factor is None else dp * factor
    dr = (dyd * out.double()).sum(-1, keepdim=True)
    ds = _round(p * (dpd - dr), round_to)
    scale = _f32(plan.scale)
    dq = scale * (ds @ _expand_kv(k, n1))
    dk = scale * (ds.transpose(-1, -2) @ q.double())
    return dq, _reduce_kv(dk, n2), _reduce_kv(dv, n2)


def flash_attention_dpse_reference(q, k, v, dy, out, softmax_max, softmax_sum, plan: AttentionPlan):
    """dpse float64 shaped like ``plan.pse`` (pse_type 0/1): the gradient of the logits' pse term with the
    GIVEN statistics (dS of the backward; 0 at excluded positions), reduced over pse's broadcast dims and,
    for the compressed alibi form, summed into the stored entries each logit reads."""
    leaf = plan.pse.double().requires_grad_()
    s = logits(q, k, plan, leaf)
    p = torch.exp(s.detach() - softmax_max.double().unsqueeze(-1)) / softmax_sum.double().unsqueeze(-1)
    factor = keep_mask(plan, tuple(s.shape))
    dyd = dy.double()
    dp = dyd @ _expand_kv(v, q.shape[1]).transpose(-1, -2)
    dpd = dp if factor is None else dp * factor
    ds = p * (dpd - (dyd * out.double()).sum(-1, keepdim=True))
    ds = ds.masked_fill(excluded_positions(plan, *s.shape), 0.0)
    (grad,) = torch.autograd.grad(s, leaf, ds)
    return grad
