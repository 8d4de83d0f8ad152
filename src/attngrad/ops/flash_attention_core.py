"""The attention core both FlashAttention contracts build on: the dense one (:mod:`attngrad.ops.flash_attention`,
BSH / SBH / BSND / BNSD) and the varlen one (:mod:`attngrad.ops.flash_attention_varlen`, TND).

* :class:`AttentionAttrs` / :class:`AttentionTensors`: the public arguments, parsed once at the API boundary
  (:func:`split_kwargs`). They are stored as given; each contract checks a field when it reaches it, in
  CANN's order (see docs/cann-semantics.md, 'Validation order and status codes').
* :class:`Geometry` / :class:`Problem`: one validated BNSD problem; :func:`to_bnsd` / :func:`from_bnsd` view
  the layouts as BNSD (no copy); :func:`geometry` derives and checks the sizes.
* :func:`resolve_plan`: the one place that turns masks, sparse modes, tokens, prefix, pse and dropout into
  the kernels' ``AttentionPlan`` for one BNSD geometry (the varlen contract calls it once per batch).
* :func:`forward_kernel` / :func:`backward_kernel`: the kernels on a validated problem; :func:`stats8`.

Choices where attngrad is stricter or more explicit than CANN, documented at their checks: an empty
mode-0/4 band is an error also at the equality CANN's tiling lets through; modes 2/3/4/6 take the compressed
mask as the standard pattern and never read it; mode 5 warns on a prefix outside the documented range (see
docs/cann-semantics.md, 'Deviations from CANN').
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import ACLNN_ERR_PARAM_NULLPTR, AclnnError
from ..precision_mode import GOLDEN, check_precision, current_precision
from ..kernels import flash_attention as kernels
from ..kernels.flash_attention_plan import (ALIBI_ROWS, MASK_READ_MODES, UNBOUNDED_TOKENS, AttentionPlan,
                                            band_row_counts, sparse_rule)
from ..kernels.flash_attention_reference import flash_attention_forward_reference
from ..validation import (MASK_DTYPES, check_dtype, check_float, check_int, check_int_list, check_range,
                          check_rank, invalid, require_tensor)
from .flash_attention_checks import absent, check_drop_mask, check_pse_type
from .flash_attention_sink_rope import check_sink

SEQ_DIM = {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0}   # the S axis of each non-TND layout
BATCH_DIM = {"BNSD": 0, "BSND": 0, "BSH": 0, "SBH": 1}
STATS_COPIES = 8
# sparse mode -> the compressed attenMask shape it takes
COMPRESSED_MASK = {2: (2048, 2048), 3: (2048, 2048), 4: (2048, 2048), 6: (3072, 2048), 7: (2048, 2048),
                   8: (2048, 2048)}


# ------------------------------------------------------------------------------------------ arguments
INT_ARRAYS = ("prefix", "q_start_idx", "kv_start_idx")


@dataclass(frozen=True)
class AttentionAttrs:
    """The scalar arguments of FlashAttentionScore(Grad), named as the public keywords, stored unchecked.

    Scalars, strings and int arrays as tuples of ints (None = absent; the TND sequence lengths stay as given,
    so that a tensor reaches the custom op as a tensor); a value of the wrong kind is kept as
    given so that the check reading it reports it at its place in CANN's order.
    """

    head_num: int
    input_layout: str
    scale_value: float = 1.0
    keep_prob: float = 1.0
    pre_tokens: int = UNBOUNDED_TOKENS
    next_tokens: int = UNBOUNDED_TOKENS
    inner_precise: int = 0
    sparse_mode: int = 0
    pse_type: int = 1
    softmax_layout: str = ""
    prefix: tuple[int, ...] | None = None
    q_start_idx: tuple[int, ...] | None = None
    kv_start_idx: tuple[int, ...] | None = None
    actual_seq_qlen: object = None    # TND's cumulative lengths as given: int list or 1-D integer tensor
    actual_seq_kvlen: object = None
    precision: str = field(default_factory=current_precision)  # the precision mode, read when parsed

    @classmethod
    def from_kwargs(cls, head_num, input_layout, **attributes) -> AttentionAttrs:
        """From the public keyword arguments; the int arrays (a list or a 1-D integer tensor) become tuples."""
        arrays = {name: _int_tuple(value) for name, value in attributes.items() if name in INT_ARRAYS}
        return cls(head_num, input_layout, **(attributes | arrays))


def _int_tuple(values):
    """An int array as a tuple of ints; a value :func:`check_int_list` refuses is returned as given."""
    try:
        checked = check_int_list("", "", values)
    except Exception:  # noqa: BLE001 - any malformed value is reported by the contract's own check
        return values
    return None if checked is None else tuple(checked)


class AttentionTensors(NamedTuple):
    """The optional tensors of FlashAttentionScore(Grad) (None = absent). ``softmax_max``, ``softmax_sum``
    and ``attention_in`` are the grad's forward results; ``padding_mask`` and ``softmax_in`` are reserved
    (unused, as in CANN); ``query_rope``, ``key_rope``, ``sink``: :mod:`.flash_attention_sink_rope`."""

    pse: torch.Tensor | None = None
    drop_mask: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    atten_mask: torch.Tensor | None = None
    softmax_max: torch.Tensor | None = None
    softmax_sum: torch.Tensor | None = None
    softmax_in: torch.Tensor | None = None
    attention_in: torch.Tensor | None = None
    query_rope: torch.Tensor | None = None
    key_rope: torch.Tensor | None = None
    sink: torch.Tensor | None = None


def split_kwargs(head_num, input_layout, **kwargs) -> tuple[AttentionAttrs, AttentionTensors]:
    """The public keyword arguments of ``flash_attention_score(_grad)`` -> ``(attrs, tensors)``; an unknown
    name is a TypeError."""
    tensors = AttentionTensors(**{name: kwargs.pop(name) for name in AttentionTensors._fields if name in kwargs})
    return AttentionAttrs.from_kwargs(head_num, input_layout, **kwargs), tensors


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
    q_rope: torch.Tensor | None = None        # BNSD [B, N1, Sq, Dr] and [B, N2 | 1, Skv, Dr], or None
    k_rope: torch.Tensor | None = None

    @property
    def rope(self) -> tuple | None:
        return None if self.q_rope is None else (self.q_rope, self.k_rope)


class Grads(NamedTuple):
    """The grad's results (BNSD from :func:`backward_kernel`): dpse, the rope grads and dsink None when absent."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dpse: torch.Tensor | None = None
    dq_rope: torch.Tensor | None = None
    dk_rope: torch.Tensor | None = None
    dsink: torch.Tensor | None = None


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


# ---------------------------------------------------------------------------------------- geometry
def geometry(op: str, layout: str, head_num: int, query, key, value) -> Geometry:
    """Sizes from the layout: BSH/SBH ``D = H1 / headNum``, ``N2 = H2 / D``, ``Dv = Hv / N2``; checks
    D == key's D, Dv <= D, N1 == headNum and N2 dividing N1 (GQA). The varlen contract reads TND as BSND
    with B = 1 (see docs/cann-semantics.md, 'Layouts and geometry')."""
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


# -------------------------------------------------------------------------------------------- plan
def _check_atten_mask(op: str, mask: torch.Tensor, geo: Geometry, sparse_mode: int) -> None:
    """attenMask: bool/uint8, 2-D or 4-D (4-D leading dims (B,N1), (B,1) or (1,1); compressed
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
    """Modes 0/4: in left-up origin (mode 4: ``pre' = pre + Sq - Skv``, ``next' = next +
    Skv - Sq``) the band must select at least one key: ``-pre' < Skv``, ``-next' < Sq`` and
    ``pre' + next' >= 0`` (CANN's tiling test, exact at the equality where the band becomes empty). A problem
    without rows or keys (Sq or Skv 0, e.g. an empty TND batch) has nothing to select: any tokens pass."""
    if geo.sq == 0 or geo.skv == 0:
        return
    shift = geo.sq - geo.skv if sparse_mode == 4 else 0
    pre, nxt = pre_tokens + shift, next_tokens - shift
    origin = "right-down (sparseMode 4)" if sparse_mode == 4 else "left-up"
    value = f"preTokens {pre_tokens}, nextTokens {next_tokens} (Sq {geo.sq}, Skv {geo.skv})"
    if -pre >= geo.skv or -nxt >= geo.sq or pre + nxt < 0:
        raise invalid(op, "preTokens/nextTokens", f"the {origin} band i - pre <= j <= i + next selects no key "
                      "(need -pre' < Skv, -next' < Sq and pre' + next' >= 0 in left-up origin)", value)


def _check_prefix(op: str, geo: Geometry, sparse_mode: int, prefix: list[int] | None) -> list[int] | None:
    """Modes 5/6: prefix has B entries in the documented range [0, Skv] (Sq > Skv) or [Skv - Sq, Skv].
    Mode 6 needs it and checks the range. Mode 5 reads only its mask, the prefix just tells which keys may be
    skipped: without it, or with a value > Skv, the computation is full; a value outside the documented range
    warns (CANN's grad only warns) and computes from the mask."""
    if prefix is None:
        if sparse_mode == 6:
            raise AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{op}: prefix must not be null (None) for sparseMode 6",
                             "prefix")
        return None
    if len(prefix) != geo.b:
        raise invalid(op, "prefix", f"must have B = {geo.b} entries for sparseMode {sparse_mode}", len(prefix))
    low = 0 if geo.sq > geo.skv else geo.skv - geo.sq
    for value in prefix:
        if sparse_mode == 6:
            check_range(op, "prefix", value, low, geo.skv)
        elif value < low:
            warnings.warn(f"{op}: prefix {value} is outside the documented range [{low}, {geo.skv}] of sparseMode 5 "
                          f"(Sq {geo.sq}, Skv {geo.skv}); the attenMask alone decides the result", stacklevel=2)
    return prefix


def _resolve_mask(op: str, geo: Geometry, mask: torch.Tensor, sparse_mode: int, pre_tokens: int,
                  next_tokens: int, prefix: list[int] | None) -> tuple[dict, dict]:
    """attenMask + sparseMode + tokens + prefix -> ``(fields, rule)``: the plan's mask / band / prefix, and the
    band / prefix of the mode's index rule (which decides CANN's automatic invalid-row mode).

    Modes 0/1/5 apply the mask's content element-wise (mode 0 on top of its band; mode 5 from the mask alone,
    its prefix rule only describing the expected mask); modes 2/3/4/6 take their compressed mask as the
    standard triu pattern and run from the index rule alone (:func:`sparse_rule`), never reading the tensor.
    """
    _check_atten_mask(op, mask, geo, sparse_mode)
    if sparse_mode in (0, 4):
        _check_tokens(op, geo, sparse_mode, pre_tokens, next_tokens)
    if sparse_mode in (5, 6):
        prefix = _check_prefix(op, geo, sparse_mode, prefix)
    pre, nxt, rule_prefix = sparse_rule(sparse_mode, pre_tokens, next_tokens, geo.sq, geo.skv, prefix)
    rule = dict(pre_tokens=pre, next_tokens=nxt,
                prefix=None if rule_prefix is None else tuple(min(max(p, 0), geo.skv) for p in rule_prefix))
    dense = None
    if sparse_mode in MASK_READ_MODES:
        dense = (mask.unsqueeze(0).unsqueeze(0) if mask.dim() == 2 else mask).detach()
    if sparse_mode == 5:
        return dict(atten_mask=dense), rule
    return dict(atten_mask=dense, **rule), rule


def _rule_leaves_empty_rows(geo: Geometry, band: dict) -> bool:
    """True when the band/prefix rule leaves a query row without keys: CANN then enables its invalid-row
    mode by itself (band with pre' < Sq - Skv or next' < 0; prefix mode with a prefix 0)."""
    prefixes = set(band["prefix"] or (0,))
    return any(band_row_counts(geo.sq, geo.skv, band["pre_tokens"], band["next_tokens"], p).min() == 0
               for p in prefixes) if geo.sq and geo.skv else False


def _check_pse_shape(op: str, pse: torch.Tensor, geo: Geometry, band: dict) -> bool:
    """pseType 0/1 shapes, in CANN's order: [B,N1,1,Skv], [B,N1,Sq,Skv], [1,N1,Sq,Skv], then the
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
    """pse + pseType -> the plan's pse: pseType 0/1 a [Bp,N1,Sp,Skv] tensor of query's dtype (or
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


def resolve_plan(op: str, geo: Geometry, dtype: torch.dtype, attrs: AttentionAttrs,
                 tensors: AttentionTensors) -> AttentionPlan:
    """Check the plan's attributes and optional tensors in CANN's order and resolve them into an
    ``AttentionPlan`` for ``geo`` (query ``dtype``).

    attenMask + sparseMode + tokens + prefix -> mask, left-up band and prefix (:func:`sparse_rule`); pse;
    invalid rows (innerPrecise 2, or a rule that leaves rows without keys); dropout. Without attenMask,
    CANN computes full attention whatever sparseMode, the tokens and prefix say (see docs/cann-semantics.md,
    'Masks and sparse modes'). Only ``geo``'s sizes are used, so the varlen contract resolves each batch
    with its own Sq_b / Skv_b.
    """
    scale = check_float(op, "scaleValue", attrs.scale_value)
    keep_prob = check_float(op, "keepProb", attrs.keep_prob)
    check_range(op, "keepProb", keep_prob, 0.0, 1.0, low_open=True)
    pre_tokens = check_int(op, "preTokens", attrs.pre_tokens)
    next_tokens = check_int(op, "nextTokens", attrs.next_tokens)
    inner_precise = check_int(op, "innerPrecise", attrs.inner_precise)
    check_range(op, "innerPrecise", inner_precise, 0, 2)
    sparse_mode = check_int(op, "sparseMode", attrs.sparse_mode)
    check_range(op, "sparseMode", sparse_mode, 0, 8)
    if sparse_mode in (7, 8):
        raise invalid(op, "sparseMode", "modes 7/8 (varlen split) need inputLayout TND", sparse_mode)
    pse_type = check_pse_type(op, attrs.pse_type)
    prefix = check_int_list(op, "prefix", attrs.prefix)
    q_start_idx = check_int_list(op, "qStartIdx", attrs.q_start_idx)
    kv_start_idx = check_int_list(op, "kvStartIdx", attrs.kv_start_idx)
    pse, atten_mask, drop_mask = tensors.pse, tensors.atten_mask, tensors.drop_mask
    for name, t in (("pse", pse), ("attenMask", atten_mask)):
        if t is not None:
            require_tensor(op, name, t)
    fields = dict(atten_mask=None, pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, prefix=None)
    rule = fields
    if not absent(atten_mask):
        mask_fields, rule = _resolve_mask(op, geo, atten_mask, sparse_mode, pre_tokens, next_tokens, prefix)
        fields = fields | mask_fields
    invalid_rows = inner_precise == 2 or _rule_leaves_empty_rows(geo, rule)
    if absent(pse):
        if pse_type != 1:
            raise invalid(op, "pseType", "must be 1 when pse is null (pse input required for pseType 0/2/3)",
                          pse_type)
    else:
        fields.update(_resolve_pse(op, geo, dtype, pse, pse_type, fields, q_start_idx, kv_start_idx))
    if keep_prob < 1.0:
        check_drop_mask(op, drop_mask, geo.b * geo.n1 * geo.sq * geo.skv, "B*N1*Sq*Skv/8")
        fields.update(keep_prob=keep_prob, drop_mask=drop_mask.detach().reshape(-1))
    fields.update(sink=check_sink(op, tensors.sink, geo.n1))
    golden = check_precision(attrs.precision) == GOLDEN
    return AttentionPlan(scale=scale, pse_type=pse_type, invalid_rows=invalid_rows, widen_gemm=golden,
                         round_probs=not golden, **fields)


# ----------------------------------------------------------------------------------------- kernels
def degenerate(geo: Geometry) -> bool:
    """A problem with a zero size: the kernels leave it to the dense reference (exact, and trivially small)."""
    return 0 in (geo.b, geo.n1, geo.sq, geo.skv, geo.d, geo.dv)


def forward_kernel(p: Problem, into: tuple | None = None, sequences: list[kernels.Sequence] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward on a validated problem: ``(out BNSD, softmax_max [B,N1,Sq], softmax_sum [B,N1,Sq])``,
    written into ``into = (out, softmax_max, softmax_sum)`` when given (views of those shapes, any strides
    with a unit last stride: the varlen layer's TND rows). ``sequences``: the varlen layer's batches, none of them
    degenerate, as one launch on the rows of a B = 1 problem (``kernels.flash_attention_forward``).

    Empty problems (a zero size) use the dense reference, which is exact and trivially small there:
    Skv == 0 gives out = 0, max = -FLT_MAX, sum = 0 (with a sink: max = sink, sum = 1).
    """
    if degenerate(p.geo):
        out, m, s = flash_attention_forward_reference(p.q, p.k, p.v, p.plan)
        if p.plan.sink is not None and p.geo.skv == 0:
            m, s = p.plan.sink.view(1, -1, 1).expand(m.shape), torch.ones(s.shape)
        results = out.to(p.q.dtype), m.float(), s.float()
        if into is None:
            return results
        for target, result in zip(into, results):
            target.copy_(result)
        return into
    return kernels.flash_attention_forward(p.q, p.k, p.v, p.plan, *(into or (None, None, None)), rope=p.rope,
                                           sequences=sequences)


def backward_kernel(p: Problem, with_dpse: bool = False, into: tuple | None = None,
                    sequences: list[kernels.Sequence] | None = None) -> Grads:
    """Run the grad on a validated problem (recomputing out/max/sum if absent): BNSD :class:`Grads`; dpse
    (pse's shape, pseType 0/1) only when ``with_dpse``; dq_rope / dk_rope with rope parts, dsink float32
    ``[N1]`` with a sink. ``into = (dq, dk, dv)`` or ``(dq, dk, dv, dq_rope, dk_rope)``: views to write the
    gradients into (as in :func:`forward_kernel`). ``sequences``: as in :func:`forward_kernel` (dpse is then a
    list, one per sequence).

    When any of dq, dk, dv is empty (or Skv == 0 / Sq == 0), all gradients are zero-filled (CANN's rule).
    """
    pse, sink = p.plan.pse, p.plan.sink
    if degenerate(p.geo):
        dpse = torch.zeros(pse.shape, dtype=pse.dtype) if with_dpse and pse is not None else None
        like = (p.q, p.k, p.v, *(p.rope or ()))
        grads = into or tuple(torch.empty(t.shape, dtype=p.q.dtype) for t in like)
        for g in grads:
            g.zero_()
        dsink = None if sink is None else torch.zeros(sink.shape)
        return Grads(*grads[:3], dpse, *(grads[3:] or (None, None)), dsink)
    if p.out is None:
        p.out, p.softmax_max, p.softmax_sum = forward_kernel(p)
    into = into or ()
    return Grads(*kernels.flash_attention_backward(
        p.q, p.k, p.v, p.dy, p.out, p.softmax_max, p.softmax_sum, p.plan, with_dpse, *into[:3], rope=p.rope,
        rope_into=into[3:] or None, sequences=sequences))


def stats8(t: torch.Tensor) -> torch.Tensor:
    """[B, N1, Sq] float32 -> CANN's [B, N1, Sq, 8] (8 equal copies)."""
    return t.unsqueeze(-1).expand(*t.shape, STATS_COPIES).contiguous()


def has_float_pse(plan: AttentionPlan) -> bool:
    """pseType 0/1 with a pse tensor: the case where attngrad returns dpse (an extension of CANN)."""
    return plan.pse is not None and plan.pse_type in (0, 1)


