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
from ..precompile import call_forward
from ..validation import check_dim_equal, invalid, is_int64, is_real
from . import flash_attention_varlen as varlen
from .flash_attention_checks import (NO_OUTPUTS, absent, check_cann_sizes, check_dy_and_attention_in,
                                     check_forward_outputs, check_grad_outputs, check_head_num, check_input_layout,
                                     check_tensors, require_forward_tensors, require_grad_tensors, saved_stats)
from .flash_attention_core import (BATCH_DIM, STATS_COPIES, AttentionAttrs, AttentionTensors, Geometry, Grads,
                                   Problem, backward_kernel, forward_kernel, from_bnsd, geometry,
                                   resolve_plan, split_kwargs, stats8, to_bnsd)
from .flash_attention_sink_rope import check_rope

FORWARD = "FlashAttentionScore"
BACKWARD = "FlashAttentionScoreGrad"
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _layout_shape(geo: Geometry, heads: int, seq: int, dim: int) -> tuple[int, ...]:
    """The shape of a [B, heads, seq, dim] tensor in the problem's layout."""
    return {"BNSD": (geo.b, heads, seq, dim), "BSND": (geo.b, seq, heads, dim),
            "BSH": (geo.b, seq, heads * dim), "SBH": (seq, geo.b, heads * dim)}[geo.layout]


def _problem(geo: Geometry, plan: AttentionPlan, query, key, value, dy=None, rope=None) -> Problem:
    """The BNSD problem over zero-copy views of the inputs given in ``geo.layout`` (``rope``: the checked
    ``(query_rope, key_rope, key_rope heads)``)."""
    layout = geo.layout
    p = Problem(geo, plan, to_bnsd(query, layout, geo.n1), to_bnsd(key, layout, geo.n2),
                to_bnsd(value, layout, geo.n2), None if dy is None else to_bnsd(dy, layout, geo.n1))
    if rope is not None:
        p.q_rope, p.k_rope = to_bnsd(rope[0], layout, geo.n1), to_bnsd(rope[1], layout, rope[2])
    return p


def _rope(op: str, geo: Geometry, query, key, tensors: AttentionTensors):
    return check_rope(op, geo.layout, geo.n1, geo.n2, query, key, tensors.query_rope, tensors.key_rope)


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
    rope = _rope(op, geo, query, key, tensors)
    if cann_limits:
        check_forward_outputs(op, outputs, geo.stats_shape, _layout_shape(geo, geo.n1, geo.sq, geo.dv),
                              query.dtype)
    plan = resolve_plan(op, geo, query.dtype, attrs, tensors)
    return _problem(geo, plan, query, key, value, rope=rope)


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
    rope = _rope(op, geo, query, key, tensors)
    if cann_limits:
        check_grad_outputs(op, outputs, query, key, value)
    problem = _problem(geo, resolve_plan(op, geo, query.dtype, attrs, tensors), query, key, value, dy, rope)
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


def run_backward(p: Problem, with_dpse: bool = False) -> Grads:
    """Grad in the user's layout (:class:`Grads`, as from :func:`backward_kernel`)."""
    g = backward_kernel(p, with_dpse)
    dq, dk, dv, dq_rope, dk_rope = (None if t is None else from_bnsd(t, p.geo.layout)
                                    for t in (g.dq, g.dk, g.dv, g.dq_rope, g.dk_rope))
    return Grads(dq, dk, dv, g.dpse, dq_rope, dk_rope, g.dsink)


# ------------------------------------------------------------------------------- custom ops (torch.library)
# The two operators are torch.library custom ops: their eager kernels validate and run the contract (dense or
# TND), their fake kernels run the same validation and compute the result shapes, so models calling them
# compile (fullgraph, dynamic shapes) and export. TND sequence lengths are tensors in the schema: under
# torch.compile they are graph inputs, and the checks that read their values run in the eager kernel.
_ATTRIBUTES = ("int head_num, str input_layout, float scale_value, float keep_prob, int pre_tokens, int next_tokens, "
               "int inner_precise, int sparse_mode, int pse_type, str softmax_layout, int[]? prefix, "
               "int[]? q_start_idx, int[]? kv_start_idx, str precision")
_ATTRIBUTE_KINDS, _ATTRIBUTE_NAMES = zip(*(item.split() for item in _ATTRIBUTES.split(", ")))
_SEQ_LENGTHS = ("actual_seq_qlen", "actual_seq_kvlen")


def _parsed(attributes: tuple, seq_lengths: tuple, **tensors) -> tuple[AttentionAttrs, AttentionTensors]:
    """The ops' flat arguments -> ``(attrs, tensors)`` for the contracts."""
    attrs = AttentionAttrs.from_kwargs(**dict(zip(_ATTRIBUTE_NAMES, attributes)),
                                       **dict(zip(_SEQ_LENGTHS, seq_lengths)))
    return attrs, AttentionTensors(**tensors)


def _stats_like(query: torch.Tensor, shape) -> torch.Tensor:
    return query.new_empty(shape, dtype=torch.float32)


_EXTRAS = ("query_rope", "key_rope", "sink")   # the optional MLA rope parts and attention sink (both ops)


@torch.library.custom_op("attngrad::flash_attention_score", mutates_args=(), schema=(
    "(Tensor query, Tensor key, Tensor value, Tensor? pse, Tensor? drop_mask, Tensor? atten_mask, "
    "Tensor? query_rope, Tensor? key_rope, Tensor? sink, "
    f"Tensor? actual_seq_qlen, Tensor? actual_seq_kvlen, {_ATTRIBUTES}) -> (Tensor, Tensor, Tensor)"))
def _score_op(query, key, value, pse, drop_mask, atten_mask, q_rope, k_rope, sink, seq_q, seq_kv, *attributes):
    attrs, tensors = _parsed(attributes, (seq_q, seq_kv), pse=pse, drop_mask=drop_mask, atten_mask=atten_mask,
                             query_rope=q_rope, key_rope=k_rope, sink=sink)
    if attrs.input_layout == "TND":
        return varlen.run_forward(varlen.check_forward(query, key, value, attrs, tensors))
    return run_forward(check_forward(query, key, value, attrs, tensors))


@_score_op.register_fake
def _score_fake(query, key, value, pse, drop_mask, atten_mask, q_rope, k_rope, sink, seq_q, seq_kv, *attributes):
    attrs, tensors = _parsed(attributes, (None, None), pse=pse, drop_mask=drop_mask, atten_mask=atten_mask,
                             query_rope=q_rope, key_rope=k_rope, sink=sink)
    if attrs.input_layout == "TND":
        t1, n1, dv = varlen.check_without_lengths(query, key, value, None, attrs, tensors, (seq_q, seq_kv))
        return query.new_empty(t1, n1, dv), _stats_like(query, (t1, n1, STATS_COPIES)), \
            _stats_like(query, (t1, n1, STATS_COPIES))
    geo = check_forward(query, key, value, attrs, tensors).geo
    return (query.new_empty(_layout_shape(geo, geo.n1, geo.sq, geo.dv)), _stats_like(query, geo.stats_shape),
            _stats_like(query, geo.stats_shape))


@torch.library.custom_op("attngrad::flash_attention_score_grad", mutates_args=(), schema=(
    "(Tensor query, Tensor key, Tensor value, Tensor dy, Tensor? pse, Tensor? drop_mask, Tensor? atten_mask, "
    "Tensor? query_rope, Tensor? key_rope, Tensor? sink, "
    "Tensor? softmax_max, Tensor? softmax_sum, Tensor? attention_in, Tensor? actual_seq_qlen, "
    f"Tensor? actual_seq_kvlen, {_ATTRIBUTES}, bool with_dpse) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _score_grad_op(query, key, value, dy, pse, drop_mask, atten_mask, q_rope, k_rope, sink, softmax_max, softmax_sum,
                   attention_in, seq_q, seq_kv, *attributes_and_flag):
    """``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``; an absent result is an empty tensor."""
    *attributes, with_dpse = attributes_and_flag
    attrs, tensors = _parsed(attributes, (seq_q, seq_kv), pse=pse, drop_mask=drop_mask, atten_mask=atten_mask,
                             query_rope=q_rope, key_rope=k_rope, sink=sink, softmax_max=softmax_max,
                             softmax_sum=softmax_sum, attention_in=attention_in)
    with_dpse = with_dpse and _float_pse(attrs, tensors)
    if attrs.input_layout == "TND":
        grads = varlen.run_backward(varlen.check_backward(query, key, value, dy, attrs, tensors), with_dpse)
    else:
        grads = run_backward(check_backward(query, key, value, dy, attrs, tensors), with_dpse)
    return tuple(query.new_empty(0) if g is None else g for g in grads)


@_score_grad_op.register_fake
def _score_grad_fake(query, key, value, dy, pse, drop_mask, atten_mask, q_rope, k_rope, sink, softmax_max,
                     softmax_sum, attention_in, seq_q, seq_kv, *attributes_and_flag):
    *attributes, with_dpse = attributes_and_flag
    attrs, tensors = _parsed(attributes, (None, None), pse=pse, drop_mask=drop_mask, atten_mask=atten_mask,
                             query_rope=q_rope, key_rope=k_rope, sink=sink, softmax_max=softmax_max,
                             softmax_sum=softmax_sum, attention_in=attention_in)
    if attrs.input_layout == "TND":
        varlen.check_without_lengths(query, key, value, dy, attrs, tensors, (seq_q, seq_kv))
    else:
        check_backward(query, key, value, dy, attrs, tensors)
    dpse = pse.new_empty(pse.shape) if with_dpse and _float_pse(attrs, tensors) else query.new_empty(0)
    extras = tuple(query.new_empty(0) if absent(t) else t.new_empty(t.shape) for t in (q_rope, k_rope, sink))
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dpse, *extras


def _float_pse(attrs: AttentionAttrs, tensors: AttentionTensors) -> bool:
    """A pse tensor of pseType 0/1: the case where the grad returns dpse (an extension of CANN)."""
    return not absent(tensors.pse) and attrs.pse_type in (0, 1)


def _save_score(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:11], *output)
    ctx.mark_non_differentiable(*output[1:])  # softmax_max / softmax_sum
    ctx.attributes = inputs[11:]


def _differentiate_score(ctx, d_out, _d_max, _d_sum):
    """dq, dk, dv (and dpse for a pseType 0/1 pse; the rope grads and dsink when given) by the grad op on the
    saved output and statistics (the same drop mask); d_out is cast to query's dtype."""
    query, key, value, pse, drop_mask, atten_mask, q_rope, k_rope, sink, seq_q, seq_kv, out, smax, ssum = \
        ctx.saved_tensors
    with_dpse = ctx.needs_input_grad[3] and ctx.attributes[_ATTRIBUTE_NAMES.index("pse_type")] in (0, 1)
    dq, dk, dv, dpse, dq_rope, dk_rope, dsink = _score_grad_op(
        query, key, value, d_out.to(query.dtype), pse, drop_mask, atten_mask, q_rope, k_rope, sink, smax, ssum, out,
        seq_q, seq_kv, *ctx.attributes, with_dpse)
    extras = tuple(None if absent(t) else g for t, g in ((q_rope, dq_rope), (k_rope, dk_rope), (sink, dsink)))
    return dq, dk, dv, dpse if with_dpse else None, None, None, *extras, *(None,) * (2 + len(ctx.attributes))


_score_op.register_autograd(_differentiate_score, setup_context=_save_score)


# -------------------------------------------------------------------------------------------- torch
def _op_arguments(attrs: AttentionAttrs, tensors: AttentionTensors, required: tuple, check) -> tuple:
    """``(scalars, sequence lengths, tensors)``: the ops' flat arguments from parsed public arguments.

    A value the schema cannot carry (a tensor that is not one, an attribute of another type) goes to the
    contract's ``check`` first, so the caller gets CANN's error in CANN's order; values the contract accepts in
    another form (numpy integers, int lists) are converted, and optional arguments it ignores become None."""
    scalars = tuple(getattr(attrs, name) for name in _ATTRIBUTE_NAMES)
    seq = tuple(getattr(attrs, name) for name in _SEQ_LENGTHS)
    if not (_schema_ready(scalars, seq) and all(isinstance(t, torch.Tensor) for t in required)
            and all(t is None or isinstance(t, torch.Tensor) for t in tensors)):
        check()
        tensors = AttentionTensors(*(t if isinstance(t, torch.Tensor) else None for t in tensors))
    scalars = tuple(_COERCE[kind](v) for kind, v in zip(_ATTRIBUTE_KINDS, scalars))
    if attrs.input_layout != "TND":  # only TND reads the sequence lengths
        return scalars, (None, None), tensors
    return scalars, tuple(v if v is None or isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int64)
                          for v in seq), tensors


def _int_array(v) -> bool:
    return v is None or (isinstance(v, (list, tuple)) and all(is_int64(x) for x in v))


_FITS = {"int": is_int64, "float": is_real, "str": lambda v: isinstance(v, str), "int[]?": _int_array}
_COERCE = {"int": int, "float": float, "str": lambda v: "" if v is None else v,
           "int[]?": lambda v: v if v is None else tuple(v)}


def _schema_ready(scalars: tuple, seq: tuple) -> bool:
    """True when every attribute already has its schema type and the sequence lengths are tensors or int lists."""
    return (all(_FITS[kind](v) for kind, v in zip(_ATTRIBUTE_KINDS, scalars))
            and all(isinstance(v, torch.Tensor) or _int_array(v) for v in seq))


def score_op_args(query, key, value, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors()) -> tuple:
    """The ``attngrad::flash_attention_score`` op's arguments for parsed public arguments."""
    def check():
        (varlen.check_forward if attrs.input_layout == "TND" else check_forward)(query, key, value, attrs, tensors)

    scalars, seq, tensors = _op_arguments(attrs, tensors, (query, key, value), check)
    return (query, key, value, tensors.pse, tensors.drop_mask, tensors.atten_mask, *_extras(tensors), *seq,
            *scalars)


def _extras(tensors: AttentionTensors) -> tuple:
    return tuple(getattr(tensors, name) for name in _EXTRAS)


def _has_extras(tensors: AttentionTensors) -> bool:
    """True when query_rope, key_rope or sink is given: the grad then returns their gradients too."""
    return not all(absent(t) for t in _extras(tensors))


def score_grad_op_args(query, key, value, dy, attrs: AttentionAttrs,
                       tensors: AttentionTensors = AttentionTensors()) -> tuple:
    """The ``attngrad::flash_attention_score_grad`` op's arguments for parsed public arguments (with dpse)."""
    def check():
        contract = varlen.check_backward if attrs.input_layout == "TND" else check_backward
        contract(query, key, value, dy, attrs, tensors)

    scalars, seq, tensors = _op_arguments(attrs, tensors, (query, key, value, dy), check)
    return (query, key, value, dy, tensors.pse, tensors.drop_mask, tensors.atten_mask, *_extras(tensors),
            tensors.softmax_max, tensors.softmax_sum, tensors.attention_in, *seq, *scalars, True)


def score(query, key, value, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors()):
    """:func:`flash_attention_score` on parsed arguments: the ``attngrad::flash_attention_score`` op."""
    return call_forward(_score_op, score_op_args(query, key, value, attrs, tensors), BACKWARD, attrs.precision)


def score_grad(query, key, value, dy, attrs: AttentionAttrs, tensors: AttentionTensors = AttentionTensors()):
    """:func:`flash_attention_score_grad` on parsed arguments: the ``attngrad::flash_attention_score_grad`` op:
    ``(dq, dk, dv, dpse)``, dpse None unless pse is a pseType 0/1 tensor; when query_rope / key_rope or sink
    is given, ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` (torch_npu's order), None for an absent one."""
    dq, dk, dv, dpse, *extras = _score_grad_op(*score_grad_op_args(query, key, value, dy, attrs, tensors))
    grads = (dq, dk, dv, dpse if _float_pse(attrs, tensors) else None)
    if not _has_extras(tensors):
        return grads
    return (*grads, *(None if absent(t) else g for t, g in zip(_extras(tensors), extras)))


def flash_attention_score(query, key, value, head_num, input_layout, *, pse=None, drop_mask=None,
                          padding_mask=None, atten_mask=None, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0,
                          keep_prob=1.0, pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, inner_precise=0,
                          sparse_mode=0, pse_type=1, softmax_layout="", query_rope=None, key_rope=None, sink=None):
    """CANN FlashAttentionScore -> ``(attention_out, softmax_max, softmax_sum)``.

    query ``[B,Sq,N1*D]`` (BSH) / ``[Sq,B,N1*D]`` (SBH) / ``[B,Sq,N1,D]`` (BSND) / ``[B,N1,Sq,D]`` (BNSD);
    key like query with N2 heads and Skv; value like key with Dv <= D. attention_out is query's shape with
    D -> Dv in query's dtype; softmax_max / softmax_sum float32 ``[B, N1, Sq, 8]``. TND (``[T, N, D]`` with
    cumulative ``actual_seq_qlen`` / ``actual_seq_kvlen``): see :mod:`attngrad.ops.flash_attention_varlen`.
    Differentiable w.r.t. query, key, value, (pseType 0/1) pse, query_rope, key_rope and sink: the backward is
    FlashAttentionScoreGrad's kernel on the saved out and stats (the same drop mask). ``padding_mask`` is
    reserved (unused, as in CANN). ``query_rope`` / ``key_rope`` (MLA: scores from ``[query, query_rope]`` and
    ``[key, key_rope]``) and ``sink`` (float32 ``[N1]``): see :mod:`attngrad.ops.flash_attention_sink_rope`.
    """
    return score(query, key, value, *split_kwargs(
        head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask, atten_mask=atten_mask,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
        softmax_layout=softmax_layout, query_rope=query_rope, key_rope=key_rope, sink=sink))


def flash_attention_score_grad(query, key, value, dy, head_num, input_layout, *, pse=None, drop_mask=None,
                               padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None,
                               softmax_in=None, attention_in=None, prefix=None, actual_seq_qlen=None,
                               actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0,
                               keep_prob=1.0, pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS,
                               inner_precise=0, sparse_mode=0, pse_type=1, softmax_layout="", query_rope=None,
                               key_rope=None, sink=None):
    """CANN FlashAttentionScoreGrad -> ``(dq, dk, dv, dpse)`` shaped like query, key, value (and pse); with
    query_rope / key_rope or sink ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` (torch_npu's
    ``npu_fusion_attention_grad_v2`` order; None for an absent input), so calls without them are unchanged.

    dy / attention_in: query's shape with D -> Dv; softmax_max / softmax_sum float32 ``[B, N1, Sq, 8]`` from
    the forward, used as given. When all three are None they are recomputed by the forward kernel (attngrad
    extension); giving only some of them is 161001. ``dpse`` (attngrad extension; CANN reserves it): for
    pseType 0/1 the gradient w.r.t. pse (its shape and dtype, reduced over its broadcast dims, 0 at excluded
    positions), else None. TND: see :mod:`attngrad.ops.flash_attention_varlen`. ``softmax_in`` /
    ``padding_mask`` are reserved (unused, as in CANN).
    """
    return score_grad(query, key, value, dy, *split_kwargs(
        head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
        softmax_layout=softmax_layout, query_rope=query_rope, key_rope=key_rope, sink=sink))
