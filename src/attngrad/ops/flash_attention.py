"""Contract of FlashAttentionScore (forward) and FlashAttentionScoreGrad for the dense layouts, and the
public torch functions (TND goes to :mod:`attngrad.ops.flash_attention_varlen`).

Forward:  ``out = Dropout(Softmax(Mask(S)), keep_prob) @ V`` with ``S = (Q K^T + pse) * scale`` (pseType 1)
or ``S = Q K^T * scale + pse`` (pseType 0/2/3); softmax_max / softmax_sum are float32 ``[B, N1, Sq, 8]``
(8 equal copies of the row max and of the row sum of ``exp(S - max)``).
Backward: CANN's FlashAttentionScoreGrad math with the GIVEN softmax_max, softmax_sum and attention_in (see
docs/cann-semantics.md, 'FlashAttentionScoreGrad').

Layouts ``BSH`` ``[B,S,N*D]``, ``SBH`` ``[S,B,N*D]``, ``BSND``, ``BNSD`` are viewed as BNSD (no copy) for the
kernels; results are returned in the input layout. BSH/SBH: ``D = H1 / headNum``, ``N2 = H2 / D``,
``Dv = Hv / N2``. GQA/MQA: query head n uses kv head ``n // (N1 / N2)``; ``Dv <= D``; dtypes float32,
float16, bfloat16 (outputs in the input dtype).

Validation follows CANN's order. ``cann_limits=True`` (the aclnn layer) adds what only CANN imposes:
softmax_max, softmax_sum and attention_in are required by the grad (the torch layer recomputes them when
all three are None), outputs are required and all-empty outputs succeed without computing, N1 <= 256 and
D <= 512.

CANN rules applied as CANN applies them (documented, not silent): without atten_mask, sparse_mode and the
tokens have no effect (full attention); drop_mask is ignored when keep_prob == 1; padding_mask and
softmax_in are reserved and unused; prefix is only read by sparse modes 5/6 (which need a mask);
q_start_idx / kv_start_idx only by pseType 2/3 (which need pse); actual_seq_qlen/kvlen only by TND.
dpse is returned for pseType 0/1 (CANN reserves it).
"""

from __future__ import annotations

import torch

from ..kernels.flash_attention_plan import UNBOUNDED_TOKENS, AttentionPlan
from ..validation import check_dim_equal, invalid
from . import flash_attention_varlen as varlen
from .flash_attention_checks import (NO_OUTPUTS, check_cann_sizes, check_dy_and_attention_in,
                                     check_forward_outputs, check_grad_outputs, check_head_num, check_input_layout,
                                     check_tensors, require_forward_tensors, require_grad_tensors, saved_stats)
from .flash_attention_core import (BATCH_DIM, AttentionAttrs, AttentionTensors, Geometry, Problem,
                                   backward_kernel, forward_kernel, from_bnsd, geometry, has_float_pse,
                                   resolve_plan, split_kwargs, stats8, to_bnsd)

FORWARD = "FlashAttentionScore"
BACKWARD = "FlashAttentionScoreGrad"
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _layout_shape(geo: Geometry, heads: int, seq: int, dim: int) -> tuple[int, ...]:
    """The shape of a [B, heads, seq, dim] tensor in the problem's layout."""
    return {"BNSD": (geo.b, heads, seq, dim), "BSND": (geo.b, seq, heads, dim),
            "BSH": (geo.b, seq, heads * dim), "SBH": (seq, geo.b, heads * dim)}[geo.layout]


def _problem(geo: Geometry, plan: AttentionPlan, query, key, value, dy=None) -> Problem:
    """The BNSD problem over zero-copy views of the inputs given in ``geo.layout``."""
    layout = geo.layout
    return Problem(geo, plan, to_bnsd(query, layout, geo.n1), to_bnsd(key, layout, geo.n2),
                   to_bnsd(value, layout, geo.n2), None if dy is None else to_bnsd(dy, layout, geo.n1))


# ------------------------------------------------------------------------------------------- checks
def _check_layout(op: str, input_layout, softmax_layout) -> str:
    """inputLayout BSH, SBH, BSND or BNSD (TND has its own contract); softmaxLayout must then be ''."""
    check_input_layout(op, input_layout, LAYOUTS)
    if input_layout == "TND":
        raise invalid(op, "inputLayout", "TND (varlen) is not accepted by this API: use "
                      "aclnnFlashAttentionVarLenScore / aclnnFlashAttentionUnpaddingScoreGrad", "'TND'")
    if softmax_layout not in ("", None):
        raise invalid(op, "softmaxLayout", "must be '' for a non-TND inputLayout", repr(softmax_layout))
    return input_layout


def _check_inputs(op: str, attrs: AttentionAttrs, inputs: tuple, attention_in=None,
                  cann_limits: bool = False) -> Geometry:
    """headNum, the layouts, then dtype, rank, shape agreement and geometry of ``inputs`` = (query, key,
    value) or (query, key, value, dy), in CANN's order."""
    head_num = check_head_num(op, attrs.head_num)
    layout = _check_layout(op, attrs.input_layout, attrs.softmax_layout)
    query, key, value, dy = inputs if len(inputs) == 4 else (*inputs, None)
    check_tensors(op, 3 if layout in ("BSH", "SBH") else 4, query, key, value, dy, attention_in)
    bd = BATCH_DIM[layout]
    check_dim_equal(op, "key", key, bd, query.shape[bd], "query")
    geo = geometry(op, layout, head_num, query, key, value)
    check_dy_and_attention_in(op, query, dy, attention_in, _layout_shape(geo, geo.n1, geo.sq, geo.dv))
    if cann_limits:
        check_cann_sizes(op, geo.n1, geo.d)
    return geo


def check_forward(query, key, value, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors(), *,
                  outputs: tuple = NO_OUTPUTS, cann_limits: bool = False) -> Problem:
    """Validate FlashAttentionScore in CANN's order; returns the BNSD problem. ``outputs``: the aclnn
    (softmaxMaxOut, softmaxSumOut, attentionOutOut), checked with ``cann_limits``."""
    op = FORWARD
    query, key, value = require_forward_tensors(op, query, key, value, outputs, cann_limits)
    geo = _check_inputs(op, attrs, (query, key, value), cann_limits=cann_limits)
    if cann_limits:
        check_forward_outputs(op, outputs, geo.stats_shape, _layout_shape(geo, geo.n1, geo.sq, geo.dv),
                              query.dtype)
    plan = resolve_plan(op, geo, query.dtype, attrs, tensors)
    return _problem(geo, plan, query, key, value)


def check_backward(query, key, value, dy, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors(),
                   *, outputs: tuple = NO_OUTPUTS, cann_limits: bool = False) -> Problem | None:
    """Validate FlashAttentionScoreGrad in CANN's order; returns the BNSD problem.

    With ``cann_limits`` the aclnn ``outputs`` (dqOut, dkOut, dvOut) are required and None is returned when
    they are all empty (CANN: success, nothing computed).
    """
    op = BACKWARD
    saved = (tensors.softmax_max, tensors.softmax_sum, tensors.attention_in)
    inputs, given, nothing_to_do = require_grad_tensors(op, (query, key, value, dy), saved, outputs, cann_limits)
    if nothing_to_do:
        return None
    query, key, value, dy = inputs
    geo = _check_inputs(op, attrs, inputs, tensors.attention_in, cann_limits)
    if cann_limits:
        check_grad_outputs(op, outputs, query, key, value)
    problem = _problem(geo, resolve_plan(op, geo, query.dtype, attrs, tensors), query, key, value, dy)
    if given:
        problem.softmax_max, problem.softmax_sum = saved_stats(op, tensors.softmax_max, tensors.softmax_sum,
                                                               geo.stats_shape, geo.stats_rule)
        problem.out = to_bnsd(tensors.attention_in, geo.layout, geo.n1)
    return problem


# ------------------------------------------------------------------------------------------ results
def run_forward(p: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward in the user's layout: ``(attention_out, softmax_max [B,N1,Sq,8], softmax_sum [B,N1,Sq,8])``."""
    out, m, s = forward_kernel(p)
    return from_bnsd(out, p.geo.layout), stats8(m), stats8(s)


def run_backward(p: Problem, with_dpse: bool = False) -> tuple:
    """Grad in the user's layout: ``(dq, dk, dv, dpse)`` (dpse as in :func:`backward_kernel`)."""
    *grads, dpse = backward_kernel(p, with_dpse)
    return (*(from_bnsd(g, p.geo.layout) for g in grads), dpse)


class _FlashAttentionFunction(torch.autograd.Function):
    """Differentiable w.r.t. query, key, value and (pseType 0/1) pse."""

    @staticmethod
    def forward(ctx, query, key, value, pse, problem):
        out, m, s = forward_kernel(problem)
        ctx.save_for_backward(query, key, value, out, m, s)
        ctx.geo, ctx.plan = problem.geo, problem.plan
        m8, s8 = stats8(m), stats8(s)
        ctx.mark_non_differentiable(m8, s8)
        return from_bnsd(out, problem.geo.layout), m8, s8

    @staticmethod
    def backward(ctx, d_out, _d_max, _d_sum):
        query, key, value, out, m, s = ctx.saved_tensors
        dy = d_out if d_out.dtype == query.dtype else d_out.to(query.dtype)
        problem = _problem(ctx.geo, ctx.plan, query, key, value, dy)
        problem.out, problem.softmax_max, problem.softmax_sum = out, m, s
        dq, dk, dv, dpse = run_backward(problem, with_dpse=ctx.needs_input_grad[3])
        return dq, dk, dv, dpse, None


# -------------------------------------------------------------------------------------------- torch
def score(query, key, value, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors()):
    """:func:`flash_attention_score` on parsed arguments (TND: :func:`attngrad.ops.flash_attention_varlen.score`)."""
    if attrs.input_layout == "TND":
        return varlen.score(query, key, value, attrs, tensors)
    p = check_forward(query, key, value, attrs, tensors)
    differentiable = [t for t in (query, key, value) if t.requires_grad]
    pse_leaf = tensors.pse if has_float_pse(p.plan) and tensors.pse.requires_grad else None
    if torch.is_grad_enabled() and (differentiable or pse_leaf is not None):
        return _FlashAttentionFunction.apply(query, key, value, pse_leaf, p)
    return run_forward(p)


def score_grad(query, key, value, dy, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors()):
    """:func:`flash_attention_score_grad` on parsed arguments (TND: the varlen contract)."""
    if attrs.input_layout == "TND":
        return varlen.score_grad(query, key, value, dy, attrs, tensors)
    p = check_backward(query, key, value, dy, attrs, tensors)
    return run_backward(p, with_dpse=has_float_pse(p.plan))


def flash_attention_score(query, key, value, head_num, input_layout, *, pse=None, drop_mask=None,
                          padding_mask=None, atten_mask=None, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0,
                          keep_prob=1.0, pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, inner_precise=0,
                          sparse_mode=0, pse_type=1, softmax_layout=""):
    """CANN FlashAttentionScore -> ``(attention_out, softmax_max, softmax_sum)``.

    query ``[B,Sq,N1*D]`` (BSH) / ``[Sq,B,N1*D]`` (SBH) / ``[B,Sq,N1,D]`` (BSND) / ``[B,N1,Sq,D]`` (BNSD);
    key like query with N2 heads and Skv; value like key with Dv <= D. attention_out is query's shape with
    D -> Dv in query's dtype; softmax_max / softmax_sum float32 ``[B, N1, Sq, 8]``. TND (``[T, N, D]`` with
    cumulative ``actual_seq_qlen`` / ``actual_seq_kvlen``): see :mod:`attngrad.ops.flash_attention_varlen`.
    Differentiable w.r.t. query, key, value and (pseType 0/1) pse: the backward is FlashAttentionScoreGrad's
    kernel on the saved out and stats (the same drop mask). ``padding_mask`` is reserved (unused, as in CANN).
    """
    keywords = locals()  # every name after value is an AttentionAttrs / AttentionTensors field
    return score(*(keywords.pop(name) for name in ("query", "key", "value")), *split_kwargs(**keywords))


def flash_attention_score_grad(query, key, value, dy, head_num, input_layout, *, pse=None, drop_mask=None,
                               padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None,
                               softmax_in=None, attention_in=None, prefix=None, actual_seq_qlen=None,
                               actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0,
                               keep_prob=1.0, pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS,
                               inner_precise=0, sparse_mode=0, pse_type=1, softmax_layout=""):
    """CANN FlashAttentionScoreGrad -> ``(dq, dk, dv, dpse)`` shaped like query, key, value (and pse).

    dy / attention_in: query's shape with D -> Dv; softmax_max / softmax_sum float32 ``[B, N1, Sq, 8]`` from
    the forward, used as given. When all three are None they are recomputed by the forward kernel (attngrad
    extension); giving only some of them is 161001. ``dpse`` (attngrad extension; CANN reserves it): for
    pseType 0/1 the gradient w.r.t. pse (its shape and dtype, reduced over its broadcast dims, 0 at excluded
    positions), else None. TND: see :mod:`attngrad.ops.flash_attention_varlen`. ``softmax_in`` /
    ``padding_mask`` are reserved (unused, as in CANN).
    """
    keywords = locals()  # every name after dy is an AttentionAttrs / AttentionTensors field
    return score_grad(*(keywords.pop(name) for name in ("query", "key", "value", "dy")), *split_kwargs(**keywords))
