"""Contract of FlashAttentionScore (forward) and FlashAttentionScoreGrad (seed 004, spec sections 0-6, 11).

Forward:  ``out = Dropout(Softmax(Mask(S)), keep_prob) @ V`` with ``S = (Q K^T + pse) * scale`` (pseType 1)
or ``S = Q K^T * scale + pse`` (pseType 0/2/3); softmax_max / softmax_sum are float32 ``[B, N1, Sq, 8]``
(8 equal copies of the row max and of the row sum of ``exp(S - max)``).
Backward: CANN's FAG math (spec section 0) with the GIVEN softmax_max, softmax_sum and attention_in.

Layouts ``BSH`` ``[B,S,N*D]``, ``SBH`` ``[S,B,N*D]``, ``BSND``, ``BNSD`` are viewed as BNSD (no copy) for the
kernels; results are returned in the input layout. BSH/SBH: ``D = H1 / headNum``, ``N2 = H2 / D``,
``Dv = Hv / N2``. GQA/MQA: query head n uses kv head ``n // (N1 / N2)``; ``Dv <= D``; dtypes float32,
float16, bfloat16 (outputs in the input dtype).

Validation follows CANN's order (spec 11.2 then the tiling checks of 11.3). ``cann_limits=True`` (the aclnn
layer) adds what only CANN imposes: softmax_max, softmax_sum and attention_in are required by the grad (the
torch layer recomputes them when all three are None), outputs are required and all-empty outputs succeed
without computing, N1 <= 256 and D <= 512 (seed 004).

CANN rules applied as CANN applies them (documented, not silent): without atten_mask, sparse_mode and the
tokens have no effect (full attention); drop_mask is ignored when keep_prob == 1; padding_mask and
softmax_in are reserved and unused; prefix is only read by sparse modes 5/6 (which need a mask);
q_start_idx / kv_start_idx only by pseType 2/3 (which need pse); actual_seq_qlen/kvlen only by TND.

:func:`resolve_plan` is the one place that turns masks, sparse modes, tokens, prefix, pse and dropout into
the kernels' ``AttentionPlan`` (index rules in :mod:`attngrad.kernels.flash_attention_plan`). Choices where
attngrad is stricter or more explicit than CANN, documented at their checks: an empty mode-0/4 band is an
error also at the equality CANN's tiling lets through; a given but invalid prefix is an error for mode 5
too (CANN's grad only warns); modes 2/3/4/6 take the compressed mask as the standard pattern and never read
it. dpse is returned for pseType 0/1 (CANN reserves it). TND is dispatched to the varlen contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ACLNN_ERR_PARAM_NULLPTR, AclnnError
from ..kernels import flash_attention as kernels
from ..kernels.flash_attention_plan import (ALIBI_ROWS, MASK_READ_MODES, UNBOUNDED_TOKENS, AttentionPlan,
                                            band_row_counts, sparse_rule)
from ..kernels.flash_attention_reference import flash_attention_forward_reference
from ..validation import (MASK_DTYPES, check_dim_equal, check_dtype, check_float, check_int, check_int_list,
                          check_range, check_rank, invalid, require_tensor)
from .flash_attention_checks import (absent, check_cann_sizes, check_drop_mask, check_dy_and_attention_in,
                                     check_forward_outputs, check_grad_outputs, check_head_num, check_input_layout,
                                     check_pse_type, check_tensors, require_forward_tensors,
                                     require_grad_tensors, saved_stats)

FORWARD = "FlashAttentionScore"
BACKWARD = "FlashAttentionScoreGrad"
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
SEQ_DIM = {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0}   # the S axis of each non-TND layout
BATCH_DIM = {"BNSD": 0, "BSND": 0, "BSH": 0, "SBH": 1}
STATS_COPIES = 8
# sparse mode -> the compressed attenMask shape it takes (spec 3.1-3.2)
COMPRESSED_MASK = {2: (2048, 2048), 3: (2048, 2048), 4: (2048, 2048), 6: (3072, 2048), 7: (2048, 2048),
                   8: (2048, 2048)}


@dataclass(frozen=True)
class Geometry:
    """Sizes of one problem: B batch, N1/N2 query/kv heads, Sq/Skv lengths, D (q/k) and Dv (v) head dims."""

    layout: str
    b: int
    n1: int
    n2: int
    sq: int
    skv: int
    d: int
    dv: int

    stats_rule = "[B, N1, Sq, 8]"

    @property
    def stats_shape(self) -> tuple[int, int, int, int]:
        return (self.b, self.n1, self.sq, STATS_COPIES)


@dataclass
class Problem:
    """Validated input: BNSD views of the tensors, the geometry and the plan the kernels run."""

    geo: Geometry
    plan: AttentionPlan
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dy: torch.Tensor | None = None
    out: torch.Tensor | None = None
    softmax_max: torch.Tensor | None = None   # [B, N1, Sq] float32 (element 0 of the 8 copies)
    softmax_sum: torch.Tensor | None = None


# --------------------------------------------------------------------------------------------- layouts
def to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A zero-copy BNSD view of ``t`` given in ``layout`` (``heads`` splits H of BSH/SBH)."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    split = t.unflatten(2, (heads, t.shape[2] // heads))
    return split.permute(0, 2, 1, 3) if layout == "BSH" else split.permute(1, 2, 0, 3)


def from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A BNSD result as a contiguous tensor in ``layout``."""
    if layout == "BNSD":
        return t.contiguous()
    if layout == "BSND":
        return t.permute(0, 2, 1, 3).contiguous()
    order = (0, 2, 1, 3) if layout == "BSH" else (2, 0, 1, 3)
    return t.permute(order).contiguous().flatten(2)


def _layout_shape(geo: Geometry, heads: int, seq: int, dim: int) -> tuple[int, ...]:
    """The shape of a [B, heads, seq, dim] tensor in the problem's layout."""
    return {"BNSD": (geo.b, heads, seq, dim), "BSND": (geo.b, seq, heads, dim),
            "BSH": (geo.b, seq, heads * dim), "SBH": (seq, geo.b, heads * dim)}[geo.layout]


def _problem(geo: Geometry, plan: AttentionPlan, query, key, value, dy=None) -> Problem:
    """The BNSD problem over zero-copy views of the inputs given in ``geo.layout``."""
    layout = geo.layout
    return Problem(geo, plan, to_bnsd(query, layout, geo.n1), to_bnsd(key, layout, geo.n2),
                   to_bnsd(value, layout, geo.n2), None if dy is None else to_bnsd(dy, layout, geo.n1))


# ---------------------------------------------------------------------------------------- attributes
def _check_layout(op: str, input_layout, softmax_layout) -> str:
    """inputLayout BSH, SBH, BSND or BNSD (TND has its own contract); softmaxLayout must then be ''."""
    check_input_layout(op, input_layout, LAYOUTS)
    if input_layout == "TND":
        raise invalid(op, "inputLayout", "TND (varlen) is not accepted by this API: use "
                      "aclnnFlashAttentionVarLenScore / aclnnFlashAttentionUnpaddingScoreGrad", "'TND'")
    if softmax_layout not in ("", None):
        raise invalid(op, "softmaxLayout", "must be '' for a non-TND inputLayout", repr(softmax_layout))
    return input_layout


# ---------------------------------------------------------------------------------------- geometry
def geometry(op: str, layout: str, head_num: int, query, key, value) -> Geometry:
    """Sizes from the layout (spec section 2); checks D, N and the head-dim rules (11.2 step 7, 11.3).
    The varlen contract reads TND as BSND with B = 1."""
    s_dim = SEQ_DIM[layout]
    b, sq, skv = query.shape[BATCH_DIM[layout]], query.shape[s_dim], key.shape[s_dim]
    if layout in ("BSH", "SBH"):
        h1, h2, hv = query.shape[2], key.shape[2], value.shape[2]
        if h1 % head_num:
            raise invalid(op, "query", f"hidden size H1 must be a multiple of headNum {head_num}", h1)
        d = h1 // head_num
        if d == 0:
            raise invalid(op, "query", "head dim D = H1 / headNum must be > 0 to derive N2", d)
        if h2 % d or h2 == 0:
            raise invalid(op, "key", f"hidden size H2 must be a positive multiple of D = {d}", h2)
        n1, n2, dk = head_num, h2 // d, d
        if hv % n2:
            raise invalid(op, "value", f"hidden size Hv must be a multiple of N2 = {n2}", hv)
        dv = hv // n2
    else:
        n_dim = 3 - s_dim
        n1, n2 = query.shape[n_dim], key.shape[n_dim]
        d, dk, dv = query.shape[3], key.shape[3], value.shape[3]
    if d != dk:
        raise invalid(op, "key", f"D axis must equal query's D axis {d}", dk)
    if dv > d:
        raise invalid(op, "value", f"D axis must be <= query's D axis {d}", dv)
    if n1 != head_num:
        raise invalid(op, "headNum", f"must equal query's N axis {n1}", head_num)
    if n2 == 0 or n1 % n2:
        raise invalid(op, "key", f"N axis N2 must be > 0 and divide query's N1 = {n1} (GQA)", n2)
    return Geometry(layout, b, n1, n2, sq, skv, d, dv)


def _check_inputs(op: str, layout: str, head_num: int, query, key, value, dy=None, attention_in=None,
                  cann_limits: bool = False) -> Geometry:
    """dtype, rank, shape agreement and geometry checks shared by both operators (CANN order)."""
    check_tensors(op, 3 if layout in ("BSH", "SBH") else 4, query, key, value, dy, attention_in)
    bd = BATCH_DIM[layout]
    check_dim_equal(op, "key", key, bd, query.shape[bd], "query")
    geo = geometry(op, layout, head_num, query, key, value)
    check_dy_and_attention_in(op, query, dy, attention_in, _layout_shape(geo, geo.n1, geo.sq, geo.dv))
    if cann_limits:
        check_cann_sizes(op, geo.n1, geo.d)
    return geo


# -------------------------------------------------------------------------------------------- plan
def _check_atten_mask(op: str, mask: torch.Tensor, geo: Geometry, sparse_mode: int) -> None:
    """attenMask dtype/shape rules of spec 3.1-3.2 (4-D leading dims (B,N1), (B,1) or (1,1); compressed
    [2048, 2048] for modes 2/3/4/7/8 and [3072, 2048] for mode 6; mode 5 per batch when B > 1)."""
    check_dtype(op, "attenMask", mask, MASK_DTYPES)
    check_rank(op, "attenMask", mask, (2, 4))
    if mask.dim() == 4 and tuple(mask.shape[:2]) not in ((geo.b, geo.n1), (geo.b, 1), (1, 1)):
        raise invalid(op, "attenMask", f"dims 0-1 must be ({geo.b}, {geo.n1}), ({geo.b}, 1) or (1, 1)",
                      list(mask.shape))
    expected = COMPRESSED_MASK.get(sparse_mode, (geo.sq, geo.skv))
    if tuple(mask.shape[-2:]) != expected:
        raise invalid(op, "attenMask", f"last two dims must be {list(expected)} for sparseMode {sparse_mode}",
                      list(mask.shape))
    if sparse_mode == 5 and geo.b > 1 and (mask.dim() == 2 or mask.shape[0] == 1):
        raise invalid(op, "attenMask", "sparseMode 5 with B > 1 needs a per-batch [B, N1|1, Sq, Skv] mask",
                      list(mask.shape))


def _check_tokens(op: str, geo: Geometry, sparse_mode: int, pre_tokens: int, next_tokens: int) -> None:
    """Modes 0/4 (spec 3.2, tiling): in left-up origin (mode 4: ``pre' = pre + Sq - Skv``, ``next' = next +
    Skv - Sq``) the band must select at least one key: ``-pre' < Skv``, ``-next' < Sq`` and
    ``pre' + next' >= 0`` (CANN's tiling test, exact at the equality where the band becomes empty)."""
    shift = geo.sq - geo.skv if sparse_mode == 4 else 0
    pre, nxt = pre_tokens + shift, next_tokens - shift
    origin = "right-down (sparseMode 4)" if sparse_mode == 4 else "left-up"
    value = f"preTokens {pre_tokens}, nextTokens {next_tokens} (Sq {geo.sq}, Skv {geo.skv})"
    if -pre >= geo.skv or -nxt >= geo.sq or pre + nxt < 0:
        raise invalid(op, "preTokens/nextTokens", f"the {origin} band i - pre <= j <= i + next selects no key "
                      "(need -pre' < Skv, -next' < Sq and pre' + next' >= 0 in left-up origin)", value)


def _check_prefix(op: str, geo: Geometry, sparse_mode: int, prefix: list[int] | None) -> list[int] | None:
    """Modes 5/6: prefix has B entries in [0, Skv] (Sq > Skv) or [Skv - Sq, Skv] (spec 3.2); mode 6 needs it,
    mode 5 without it is mask-only (full computation)."""
    if prefix is None:
        if sparse_mode == 6:
            raise AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{op}: prefix must not be null (None) for sparseMode 6",
                             "prefix")
        return None
    if len(prefix) != geo.b:
        raise invalid(op, "prefix", f"must have B = {geo.b} entries for sparseMode {sparse_mode}", len(prefix))
    low = 0 if geo.sq > geo.skv else geo.skv - geo.sq
    for value in prefix:
        check_range(op, "prefix", value, low, geo.skv)
    return prefix


def _resolve_mask(op: str, geo: Geometry, mask: torch.Tensor, sparse_mode: int, pre_tokens: int,
                  next_tokens: int, prefix: list[int] | None) -> dict:
    """attenMask + sparseMode + tokens + prefix -> the plan's mask / band / prefix (spec 3.2).

    Modes 0/1/5 apply the mask's content element-wise (on top of the band of mode 0 and the prefix rule of
    mode 5); modes 2/3/4/6 take their compressed mask as the standard triu pattern and run from the index
    rule alone (:func:`sparse_rule`), never reading the tensor.
    """
    _check_atten_mask(op, mask, geo, sparse_mode)
    if sparse_mode in (0, 4):
        _check_tokens(op, geo, sparse_mode, pre_tokens, next_tokens)
    if sparse_mode in (5, 6):
        prefix = _check_prefix(op, geo, sparse_mode, prefix)
    pre, nxt, rule_prefix = sparse_rule(sparse_mode, pre_tokens, next_tokens, geo.sq, geo.skv, prefix)
    dense = None
    if sparse_mode in MASK_READ_MODES:
        dense = (mask.unsqueeze(0).unsqueeze(0) if mask.dim() == 2 else mask).detach()
    return dict(atten_mask=dense, pre_tokens=pre,
                next_tokens=nxt, prefix=None if rule_prefix is None else tuple(rule_prefix))


def _rule_leaves_empty_rows(geo: Geometry, band: dict) -> bool:
    """True when the band/prefix rule leaves a query row without keys: CANN then enables its invalid-row
    mode by itself (spec 6: band with pre' < Sq - Skv or next' < 0; prefix mode with a prefix 0)."""
    prefixes = set(band["prefix"] or (0,))
    return any(band_row_counts(geo.sq, geo.skv, band["pre_tokens"], band["next_tokens"], p).min() == 0
               for p in prefixes) if geo.sq and geo.skv else False


def _check_pse_shape(op: str, pse: torch.Tensor, geo: Geometry, band: dict) -> bool:
    """pseType 0/1 shapes (spec 4.2, in CANN's order): [B,N1,1,Skv], [B,N1,Sq,Skv], [1,N1,Sq,Skv], then the
    alibi-compressed [B|1,N1,1024,Skv] (needs Sq == Skv > 1024 and a causal rule: pre' >= Sq, next' == 0).
    Returns True for the compressed form."""
    check_rank(op, "pse", pse, (4,))
    shape = tuple(pse.shape)
    b, n1, sq, skv = geo.b, geo.n1, geo.sq, geo.skv
    if shape in ((b, n1, 1, skv), (b, n1, sq, skv), (1, n1, sq, skv)):
        return False
    if shape in ((b, n1, ALIBI_ROWS, skv), (1, n1, ALIBI_ROWS, skv)):
        causal = band["pre_tokens"] == UNBOUNDED_TOKENS and band["next_tokens"] == 0 and band["prefix"] is None
        if sq == skv and sq > ALIBI_ROWS and causal:
            return True
        raise invalid(op, "pse", f"the alibi-compressed [B|1, N1, {ALIBI_ROWS}, Skv] form needs Sq == Skv >= "
                      f"{ALIBI_ROWS} and a causal attenMask/sparseMode (pre' >= Sq, next' == 0)",
                      f"{list(shape)}, Sq {sq}, Skv {skv}")
    raise invalid(op, "pse", f"shape must be [B, N1, 1, Skv], [B, N1, Sq, Skv], [1, N1, Sq, Skv] or "
                  f"[B|1, N1, {ALIBI_ROWS}, Skv] = ({b}, {n1}, {sq}, {skv})", list(shape))


def _start_index(op: str, name: str, values: list[int] | None) -> int:
    """qStartIdx / kvStartIdx: an int array of length 1 (absent = 0)."""
    if not values:
        return 0
    if len(values) != 1:
        raise invalid(op, name, "must have exactly 1 element", values)
    return values[0]


def _resolve_pse(op: str, geo: Geometry, dtype: torch.dtype, pse: torch.Tensor, pse_type: int, band: dict,
                 q_start_idx, kv_start_idx) -> dict:
    """pse + pseType -> the plan's pse (spec 4): pseType 0/1 a [Bp,N1,Sp,Skv] tensor of query's dtype (or
    the compressed alibi); pseType 2/3 float32 slopes [N1] or [B,N1] (as [Bs, N1]) with Sq == Skv."""
    check_dtype(op, "pse", pse, (dtype,) if pse_type in (0, 1) else (torch.float32,))
    if pse_type in (0, 1):
        return dict(pse=pse.detach(), pse_compressed=_check_pse_shape(op, pse, geo, band))
    if tuple(pse.shape) not in ((geo.n1,), (geo.b, geo.n1)):
        raise invalid(op, "pse", f"alibi slopes (pseType {pse_type}) must be [N1] or [B, N1] = "
                      f"({geo.b}, {geo.n1})", list(pse.shape))
    if geo.sq != geo.skv:
        raise invalid(op, "pseType", f"pseType {pse_type} (generated alibi) needs Sq == Skv",
                      f"Sq {geo.sq}, Skv {geo.skv}")
    return dict(pse=pse.detach().reshape(-1, geo.n1), q_start_idx=_start_index(op, "qStartIdx", q_start_idx),
                kv_start_idx=_start_index(op, "kvStartIdx", kv_start_idx))


def resolve_plan(op: str, geo: Geometry, dtype: torch.dtype, *, scale_value, keep_prob, pre_tokens, next_tokens,
                 inner_precise, sparse_mode, pse_type, atten_mask, pse, drop_mask, prefix, q_start_idx,
                 kv_start_idx) -> AttentionPlan:
    """Check the attributes and optional tensors (spec 11.3) and resolve them into an ``AttentionPlan``.

    The home of spec section 3 (attenMask / sparseMode / tokens / prefix -> mask + left-up band + prefix,
    via :func:`sparse_rule`), section 4 (pse), section 6 (invalid rows: innerPrecise 2, or a rule that
    leaves rows without keys) and section 7 (dropout). Without attenMask, CANN computes full attention
    whatever sparseMode, the tokens and prefix say (spec 3.1). Only ``geo``'s sizes are used, so a varlen
    caller can resolve each batch with its own Sq_b / Skv_b.
    """
    scale = check_float(op, "scaleValue", scale_value)
    keep_prob = check_float(op, "keepProb", keep_prob)
    check_range(op, "keepProb", keep_prob, 0.0, 1.0, low_open=True)
    pre_tokens = check_int(op, "preTokens", pre_tokens)
    next_tokens = check_int(op, "nextTokens", next_tokens)
    inner_precise = check_int(op, "innerPrecise", inner_precise)
    check_range(op, "innerPrecise", inner_precise, 0, 2)
    sparse_mode = check_int(op, "sparseMode", sparse_mode)
    check_range(op, "sparseMode", sparse_mode, 0, 8)
    if sparse_mode in (7, 8):
        raise invalid(op, "sparseMode", "modes 7/8 (varlen split) need inputLayout TND", sparse_mode)
    pse_type = check_pse_type(op, pse_type)
    prefix = check_int_list(op, "prefix", prefix)
    q_start_idx = check_int_list(op, "qStartIdx", q_start_idx)
    kv_start_idx = check_int_list(op, "kvStartIdx", kv_start_idx)
    for name, t in (("pse", pse), ("attenMask", atten_mask)):
        if t is not None:
            require_tensor(op, name, t)
    fields = dict(atten_mask=None, pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, prefix=None)
    if not absent(atten_mask):
        fields.update(_resolve_mask(op, geo, atten_mask, sparse_mode, pre_tokens, next_tokens, prefix))
    invalid_rows = inner_precise == 2 or _rule_leaves_empty_rows(geo, fields)
    if absent(pse):
        if pse_type != 1:
            raise invalid(op, "pseType", "must be 1 when pse is null (pse input required for pseType 0/2/3)",
                          pse_type)
    else:
        fields.update(_resolve_pse(op, geo, dtype, pse, pse_type, fields, q_start_idx, kv_start_idx))
    if keep_prob < 1.0:
        check_drop_mask(op, drop_mask, geo.b * geo.n1 * geo.sq * geo.skv, "B*N1*Sq*Skv/8")
        fields.update(keep_prob=keep_prob, drop_mask=drop_mask.detach().reshape(-1))
    return AttentionPlan(scale=scale, pse_type=pse_type, invalid_rows=invalid_rows, **fields)


# ------------------------------------------------------------------------------------------ checks
def check_forward(query, key, value, head_num, input_layout, *, pse=None, drop_mask=None, atten_mask=None,
                  prefix=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0, keep_prob=1.0,
                  pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, inner_precise=0, sparse_mode=0,
                  pse_type=1, softmax_layout="", softmax_max_out=None, softmax_sum_out=None, attention_out=None,
                  cann_limits=False) -> Problem:
    """Validate FlashAttentionScore in CANN's order; returns the BNSD problem. ``*_out``: aclnn outputs."""
    op = FORWARD
    query, key, value = require_forward_tensors(op, query, key, value, softmax_max_out, softmax_sum_out,
                                                attention_out, cann_limits)
    head_num = check_head_num(op, head_num)
    layout = _check_layout(op, input_layout, softmax_layout)
    geo = _check_inputs(op, layout, head_num, query, key, value, cann_limits=cann_limits)
    if cann_limits:
        check_forward_outputs(op, softmax_max_out, softmax_sum_out, attention_out, geo.stats_shape,
                              _layout_shape(geo, geo.n1, geo.sq, geo.dv), query.dtype)
    plan = resolve_plan(op, geo, query.dtype, scale_value=scale_value, keep_prob=keep_prob,
                        pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise,
                        sparse_mode=sparse_mode, pse_type=pse_type, atten_mask=atten_mask, pse=pse,
                        drop_mask=drop_mask, prefix=prefix, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
    return _problem(geo, plan, query, key, value)


def check_backward(query, key, value, dy, head_num, input_layout, *, pse=None, drop_mask=None, atten_mask=None,
                   softmax_max=None, softmax_sum=None, attention_in=None, prefix=None, q_start_idx=None,
                   kv_start_idx=None, scale_value=1.0, keep_prob=1.0, pre_tokens=UNBOUNDED_TOKENS,
                   next_tokens=UNBOUNDED_TOKENS, inner_precise=0, sparse_mode=0, pse_type=1, softmax_layout="",
                   dq_out=None, dk_out=None, dv_out=None, cann_limits=False) -> Problem | None:
    """Validate FlashAttentionScoreGrad in CANN's order (spec 11.2, 11.3); returns the BNSD problem.

    With ``cann_limits`` the aclnn outputs dq/dk/dv are required and None is returned when they are all
    empty (CANN: success, nothing computed).
    """
    op = BACKWARD
    (query, key, value, dy), saved, nothing_to_do = require_grad_tensors(
        op, query, key, value, dy, softmax_max, softmax_sum, attention_in, dq_out, dk_out, dv_out, cann_limits)
    if nothing_to_do:
        return None
    head_num = check_head_num(op, head_num)
    layout = _check_layout(op, input_layout, softmax_layout)
    geo = _check_inputs(op, layout, head_num, query, key, value, dy, attention_in, cann_limits)
    if cann_limits:
        check_grad_outputs(op, dq_out, dk_out, dv_out, query, key, value)
    plan = resolve_plan(op, geo, query.dtype, scale_value=scale_value, keep_prob=keep_prob,
                        pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise,
                        sparse_mode=sparse_mode, pse_type=pse_type, atten_mask=atten_mask, pse=pse,
                        drop_mask=drop_mask, prefix=prefix, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
    problem = _problem(geo, plan, query, key, value, dy)
    if saved:
        problem.softmax_max, problem.softmax_sum = saved_stats(op, softmax_max, softmax_sum, geo.stats_shape,
                                                               geo.stats_rule)
        problem.out = to_bnsd(attention_in, layout, geo.n1)
    return problem


# ----------------------------------------------------------------------------------------- kernels
def _degenerate(geo: Geometry) -> bool:
    return 0 in (geo.b, geo.n1, geo.sq, geo.skv, geo.d, geo.dv)


def forward_kernel(p: Problem, into: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward on a validated problem: ``(out BNSD, softmax_max [B,N1,Sq], softmax_sum [B,N1,Sq])``,
    written into ``into = (out, softmax_max, softmax_sum)`` when given (views of those shapes, any strides
    with a unit last stride: the varlen layer's TND rows).

    Empty problems (a zero size) use the dense reference, which is exact and trivially small there:
    Skv == 0 gives out = 0, max = -FLT_MAX, sum = 0.
    """
    if _degenerate(p.geo):
        out, m, s = flash_attention_forward_reference(p.q, p.k, p.v, p.plan)
        results = out.to(p.q.dtype), m.float(), s.float()
        if into is None:
            return results
        for target, result in zip(into, results):
            target.copy_(result)
        return into
    return kernels.flash_attention_forward(p.q, p.k, p.v, p.plan, *(into or ()))


def backward_kernel(p: Problem, with_dpse: bool = False, into: tuple | None = None) -> tuple:
    """Run the grad on a validated problem (recomputing out/max/sum if absent): BNSD ``(dq, dk, dv, dpse)``;
    dpse (pse's shape, pseType 0/1) only when ``with_dpse``, else None. ``into = (dq, dk, dv)``: views to
    write the gradients into (as in :func:`forward_kernel`).

    Spec 11.4: when any of dq, dk, dv is empty (or Skv == 0 / Sq == 0), all gradients are zero-filled.
    """
    pse = p.plan.pse
    if _degenerate(p.geo):
        dpse = torch.zeros(pse.shape, dtype=pse.dtype) if with_dpse and pse is not None else None
        grads = into or tuple(torch.empty(t.shape, dtype=p.q.dtype) for t in (p.q, p.k, p.v))
        for g in grads:
            g.zero_()
        return (*grads, dpse)
    if p.out is None:
        p.out, p.softmax_max, p.softmax_sum = forward_kernel(p)
    return kernels.flash_attention_backward(p.q, p.k, p.v, p.dy, p.out, p.softmax_max, p.softmax_sum, p.plan,
                                            with_dpse, *(into or ()))


def stats8(t: torch.Tensor) -> torch.Tensor:
    """[B, N1, Sq] float32 -> CANN's [B, N1, Sq, 8] (8 equal copies)."""
    return t.unsqueeze(-1).expand(*t.shape, STATS_COPIES).contiguous()


def run_forward(p: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward in the user's layout: ``(attention_out, softmax_max [B,N1,Sq,8], softmax_sum [B,N1,Sq,8])``."""
    out, m, s = forward_kernel(p)
    return from_bnsd(out, p.geo.layout), stats8(m), stats8(s)


def run_backward(p: Problem, with_dpse: bool = False) -> tuple:
    """Grad in the user's layout: ``(dq, dk, dv, dpse)`` (dpse as in :func:`backward_kernel`)."""
    *grads, dpse = backward_kernel(p, with_dpse)
    return (*(from_bnsd(g, p.geo.layout) for g in grads), dpse)


def has_float_pse(plan: AttentionPlan) -> bool:
    """pseType 0/1 with a pse tensor: the case where attngrad returns dpse (an extension of CANN)."""
    return plan.pse is not None and plan.pse_type in (0, 1)


# -------------------------------------------------------------------------------------------- torch
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
        geo = ctx.geo
        dy = d_out if d_out.dtype == query.dtype else d_out.to(query.dtype)
        problem = _problem(geo, ctx.plan, query, key, value, dy)
        problem.out, problem.softmax_max, problem.softmax_sum = out, m, s
        dq, dk, dv, dpse = run_backward(problem, with_dpse=ctx.needs_input_grad[3])
        return dq, dk, dv, dpse, None


def flash_attention_score(query, key, value, head_num, input_layout, *, pse=None, drop_mask=None,
                          padding_mask=None, atten_mask=None, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0,
                          keep_prob=1.0, pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0,
                          sparse_mode=0, pse_type=1, softmax_layout=""):
    """CANN FlashAttentionScore -> ``(attention_out, softmax_max, softmax_sum)``.

    query ``[B,Sq,N1*D]`` (BSH) / ``[Sq,B,N1*D]`` (SBH) / ``[B,Sq,N1,D]`` (BSND) / ``[B,N1,Sq,D]`` (BNSD);
    key like query with N2 heads and Skv; value like key with Dv <= D. attention_out is query's shape with
    D -> Dv in query's dtype; softmax_max / softmax_sum float32 ``[B, N1, Sq, 8]``. Differentiable w.r.t.
    query, key, value and (pseType 0/1) pse: the backward is FlashAttentionScoreGrad's kernel on the saved
    out and stats (the same drop mask).
    ``padding_mask`` is reserved (unused, as in CANN); ``actual_seq_qlen/kvlen`` belong to TND.
    """
    if input_layout == "TND":  # varlen: the per-batch contract of attngrad.ops.flash_attention_varlen
        from . import flash_attention_varlen as varlen
        return varlen.flash_attention_score(query, key, value, head_num, input_layout, pse=pse, drop_mask=drop_mask,
            atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
            q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
            pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
            pse_type=pse_type, softmax_layout=softmax_layout)
    p = check_forward(query, key, value, head_num, input_layout, pse=pse, drop_mask=drop_mask,
                      atten_mask=atten_mask, prefix=prefix, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx,
                      scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
                      next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
                      pse_type=pse_type, softmax_layout=softmax_layout)
    differentiable = [t for t in (query, key, value) if t.requires_grad]
    pse_leaf = pse if has_float_pse(p.plan) and pse.requires_grad else None
    if torch.is_grad_enabled() and (differentiable or pse_leaf is not None):
        return _FlashAttentionFunction.apply(query, key, value, pse_leaf, p)
    return run_forward(p)


def flash_attention_score_grad(query, key, value, dy, head_num, input_layout, *, pse=None, drop_mask=None,
                               padding_mask=None, atten_mask=None, softmax_max=None, softmax_sum=None,
                               softmax_in=None, attention_in=None, prefix=None, actual_seq_qlen=None,
                               actual_seq_kvlen=None, q_start_idx=None, kv_start_idx=None, scale_value=1.0,
                               keep_prob=1.0, pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0,
                               sparse_mode=0, pse_type=1, softmax_layout=""):
    """CANN FlashAttentionScoreGrad -> ``(dq, dk, dv, dpse)`` shaped like query, key, value (and pse).

    dy / attention_in: query's shape with D -> Dv; softmax_max / softmax_sum float32 ``[B, N1, Sq, 8]`` from
    the forward, used as given (spec section 0). When all three are None they are recomputed by the
    forward kernel (attngrad extension; seed 004 defines the grad from q, k, v, dy alone); giving only some
    of them is 161001. ``dpse`` (attngrad extension; CANN reserves it): for pseType 0/1 the gradient w.r.t.
    pse (its shape and dtype, reduced over its broadcast dims, 0 at excluded positions), else None.
    ``softmax_in`` / ``padding_mask`` are reserved (unused, as in CANN).
    """
    if input_layout == "TND":  # varlen: the per-batch contract of attngrad.ops.flash_attention_varlen
        from . import flash_attention_varlen as varlen
        return varlen.flash_attention_score_grad(
            query, key, value, dy, head_num, input_layout, softmax_max=softmax_max, softmax_sum=softmax_sum,
            attention_in=attention_in, pse=pse, drop_mask=drop_mask,
            atten_mask=atten_mask, prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
            q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
            pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode,
            pse_type=pse_type, softmax_layout=softmax_layout)
    p = check_backward(query, key, value, dy, head_num, input_layout, pse=pse, drop_mask=drop_mask,
                       atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
                       attention_in=attention_in, prefix=prefix, q_start_idx=q_start_idx,
                       kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob,
                       pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise,
                       sparse_mode=sparse_mode, pse_type=pse_type, softmax_layout=softmax_layout)
    return run_backward(p, with_dpse=has_float_pse(p.plan))
