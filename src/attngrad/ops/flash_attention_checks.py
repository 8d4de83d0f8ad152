"""The FlashAttention checks both contracts share: :mod:`attngrad.ops.flash_attention` (BSH, SBH, BSND,
BNSD) and :mod:`attngrad.ops.flash_attention_varlen` (TND) call these in CANN's order (see
docs/cann-semantics.md, 'Validation order and status codes').

Each check owns one rule (messages name the operator, the parameter, the rule and the value); the layout-
specific rules (geometry, masks, pse forms, sequence lengths) live in :mod:`attngrad.ops.flash_attention_core`
and the two contracts.
"""

from __future__ import annotations

import math

import torch

from ..errors import ACLNN_ERR_PARAM_NULLPTR, AclnnError
from ..validation import (FLOAT_DTYPES, check_choice, check_dim_equal, check_dtype, check_int, check_output_view,
                          check_range, check_rank, check_same_dtype, check_shape, invalid, require_tensor)

CANN_MAX_HEADS = 256
CANN_MAX_HEAD_DIM = 512


# ------------------------------------------------------------------------------------------ nulls
FORWARD_OUTPUTS = ("softmaxMaxOut", "softmaxSumOut", "attentionOutOut")
GRAD_OUTPUTS = ("dqOut", "dkOut", "dvOut")
NO_OUTPUTS = (None, None, None)         # the torch layer: no aclnn outputs


def require_forward_tensors(op: str, query, key, value, outputs: tuple,
                            cann_limits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value are required; with ``cann_limits`` the aclnn ``outputs`` (softmaxMaxOut,
    softmaxSumOut, attentionOutOut) too (161001)."""
    query, key, value = (require_tensor(op, n, t) for n, t in (("query", query), ("key", key), ("value", value)))
    if cann_limits:
        for name, t in zip(FORWARD_OUTPUTS, outputs):
            require_tensor(op, name, t)
    return query, key, value


def require_grad_tensors(op: str, inputs: tuple, saved: tuple, outputs: tuple,
                         cann_limits: bool) -> tuple[tuple[torch.Tensor, ...], bool, bool]:
    """The grad's nulls in CANN's order -> ``((query, key, value, dy), saved, nothing_to_do)``.

    ``inputs``: (query, key, value, dy); ``saved``: (softmax_max, softmax_sum, attention_in), the returned
    ``saved`` tells whether they are given (see :func:`check_saved`). With ``cann_limits`` the ``outputs``
    dqOut, dkOut, dvOut are required and ``nothing_to_do`` is True when all three are empty (CANN: success,
    no work).
    """
    tensors = tuple(require_tensor(op, n, t) for n, t in zip(("query", "key", "value", "dy"), inputs))
    given = check_saved(op, *saved, cann_limits)
    if not cann_limits:
        return tensors, given, False
    outs = [require_tensor(op, n, t) for n, t in zip(GRAD_OUTPUTS, outputs)]
    return tensors, given, all(t.numel() == 0 for t in outs)


def check_saved(op: str, softmax_max, softmax_sum, attention_in, cann_limits: bool) -> bool:
    """True when the forward results are given. Torch layer: all three None -> recomputed; some -> 161001."""
    given = [t is not None for t in (softmax_max, softmax_sum, attention_in)]
    if not any(given) and not cann_limits:
        return False
    for name, t in (("attentionIn", attention_in), ("softmaxMax", softmax_max), ("softmaxSum", softmax_sum)):
        require_tensor(op, name, t)
    return True


def absent(t) -> bool:
    """CANN treats a missing or 0-dim optional tensor as absent."""
    return t is None or (isinstance(t, torch.Tensor) and t.dim() == 0)


# ------------------------------------------------------------------------------------- attributes
def check_input_layout(op: str, input_layout, allowed: tuple[str, ...]) -> str:
    """inputLayout: not null (161001), a string, one of ``allowed``."""
    if input_layout is None:
        raise AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{op}: inputLayout must not be null (None)", "inputLayout")
    if not isinstance(input_layout, str):
        raise invalid(op, "inputLayout", "must be a string", repr(input_layout))
    check_choice(op, "inputLayout", input_layout, allowed)
    return input_layout


def check_head_num(op: str, head_num) -> int:
    """headNum: an integer >= 1 (the N1 rules are checked with the geometry)."""
    head_num = check_int(op, "headNum", head_num)
    check_range(op, "headNum", head_num, 1)
    return head_num


def check_pse_type(op: str, pse_type) -> int:
    """pseType: 0, 1, 2 or 3 (see docs/cann-semantics.md, 'Position shift (pse)')."""
    pse_type = check_int(op, "pseType", pse_type)
    check_range(op, "pseType", pse_type, 0, 3)
    return pse_type


# ----------------------------------------------------------------------------------------- tensors
def _check_same_but_last(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    for dim in range(ref.dim() - 1):
        check_dim_equal(op, name, t, dim, ref.shape[dim], ref_name)


def check_tensors(op: str, rank: int, query, key, value, dy=None, attention_in=None) -> None:
    """query float32/float16/bfloat16, key, value (and dy) of its dtype; all of rank ``rank``; value like key
    and dy like query in every axis but the last (the head dims D / Dv)."""
    check_dtype(op, "query", query, FLOAT_DTYPES)
    for name, t in (("key", key), ("value", value), ("dy", dy)):
        if t is not None:
            check_same_dtype(op, name, t, "query", query)
    for name, t in (("query", query), ("key", key), ("value", value), ("dy", dy), ("attentionIn", attention_in)):
        if t is not None:
            check_rank(op, name, t, (rank,))
    _check_same_but_last(op, "value", value, "key", key)
    if dy is not None:
        _check_same_but_last(op, "dy", dy, "query", query)


def check_dy_and_attention_in(op: str, query, dy, attention_in, dy_shape: tuple[int, ...]) -> None:
    """dy has ``dy_shape`` (query's with D -> Dv); attentionIn has query's dtype and dy's shape."""
    if dy is not None:
        check_shape(op, "dy", dy, dy_shape, "query's shape with D = Dv")
    if attention_in is not None:
        check_same_dtype(op, "attentionIn", attention_in, "query", query)
        check_shape(op, "attentionIn", attention_in, dy.shape, "must equal dy's shape")


def check_cann_sizes(op: str, n1: int, d: int) -> None:
    """CANN's documented ranges on A2/A3: N 1~256, D 1~512."""
    check_range(op, "headNum", n1, 1, CANN_MAX_HEADS)
    check_range(op, "query D axis", d, 1, CANN_MAX_HEAD_DIM)


def check_drop_mask(op: str, drop_mask, elements: int, formula: str) -> None:
    """keepProb < 1 needs a UINT8 bit mask of at least ceil(elements / 8) bytes; ``formula``
    names ``elements`` in the message."""
    require_tensor(op, "dropMask", drop_mask)
    check_dtype(op, "dropMask", drop_mask, (torch.uint8,))
    need = math.ceil(elements / 8)
    if drop_mask.numel() < need:
        raise invalid(op, "dropMask", f"must hold at least ceil({formula}) = {need} bytes", drop_mask.numel())


# ----------------------------------------------------------------------------------------- results
def check_output(op: str, name: str, t, shape, dtype: torch.dtype) -> None:
    """An aclnn output: given, of ``dtype`` and ``shape``, not overlapping itself."""
    require_tensor(op, name, t)
    if t.dtype != dtype:
        raise invalid(op, name, f"dtype must be {dtype}", t.dtype)
    check_shape(op, name, t, shape)
    check_output_view(op, name, t)


def check_forward_outputs(op: str, outputs: tuple, stats_shape, out_shape, dtype: torch.dtype) -> None:
    """The forward's aclnn ``outputs``: softmaxMaxOut / softmaxSumOut float32 ``stats_shape``,
    attentionOutOut ``out_shape`` in query's ``dtype``."""
    for name, t, shape, want in zip(FORWARD_OUTPUTS, outputs, (stats_shape, stats_shape, out_shape),
                                    (torch.float32, torch.float32, dtype)):
        check_output(op, name, t, shape, want)


def check_grad_outputs(op: str, outputs: tuple, query, key, value) -> None:
    """The grad's aclnn ``outputs``: dqOut / dkOut / dvOut have query's / key's / value's shape and dtype."""
    for name, t, ref in zip(GRAD_OUTPUTS, outputs, (query, key, value)):
        check_output(op, name, t, ref.shape, ref.dtype)


def saved_stats(op: str, softmax_max, softmax_sum, shape, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The given softmaxMax / softmaxSum: float32 of ``shape`` (``rule`` names it, e.g. "[B, N1, Sq, 8]");
    returns element 0 of their 8 copies, contiguous (``shape[:-1]``)."""
    for name, t in (("softmaxMax", softmax_max), ("softmaxSum", softmax_sum)):
        check_dtype(op, name, t, (torch.float32,))
        check_shape(op, name, t, shape, rule)
    return softmax_max[..., 0].contiguous(), softmax_sum[..., 0].contiguous()
