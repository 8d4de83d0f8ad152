"""The optional inputs of FlashAttentionScore(Grad) for MLA and attention sinks: their checks (see
docs/cann-semantics.md, 'Rope parts and attention sink').

* ``query_rope`` / ``key_rope`` (MLA's rope parts): the scores are ``[query, query_rope] [key, key_rope]^T``
  (value unchanged); query_rope is query's shape with D -> Dr, key_rope key's shape with D -> Dr and N2 heads or
  a single head shared by all heads. Both or neither; query's dtype. Every layout, dtype, mask, pse and dropout
  (CANN: TND, bfloat16, mask required, no pse / dropout).
* ``sink`` float32 ``[N1]``: head n's softmax has one more logit ``sink[n]`` without a value.
  ``dsink[n] = -sum_{b,i} Psink[b,n,i] * Dr[b,n,i]`` with ``Psink = exp(sink[n] - max) / sum`` (the given
  statistics) and ``Dr = rowsum(dy * out) = sum_j P dPd``, where ``dPd`` is dP after the dropout factor (the
  dP of dS): the exact gradient with dropout too, computed by the grad kernel from its own Dr (in golden mode
  from the unrounded output).
"""

from __future__ import annotations

import torch

from ..errors import ACLNN_ERR_PARAM_NULLPTR, AclnnError
from ..validation import check_dtype, check_rank, check_same_dtype, invalid, require_tensor
from .flash_attention_checks import absent, check_output

# the aclnn grad outputs of the optional inputs: output -> (its input's AttentionTensors field, Grads field)
EXTRA_GRAD_OUTPUTS = {"dqRopeOut": ("query_rope", "dq_rope"), "dkRopeOut": ("key_rope", "dk_rope"),
                      "dsinkOut": ("sink", "dsink")}

_HEAD_SPLIT = ("BSH", "SBH")   # layouts whose last dim holds N * D


def _pair(op: str, query_rope, key_rope) -> tuple | None:
    """None when neither rope part is given; a missing partner is 161001."""
    if absent(query_rope) and absent(key_rope):
        return None
    for name, t, other in (("queryRope", query_rope, "keyRope"), ("keyRope", key_rope, "queryRope")):
        if absent(t):
            raise AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{op}: {name} must not be null (None) when {other} is "
                             "given (the rope parts come in pairs)", name)
    return require_tensor(op, "queryRope", query_rope), require_tensor(op, "keyRope", key_rope)


def _rope_dims(op: str, layout: str, name: str, t: torch.Tensor, ref: torch.Tensor, heads: tuple[int, ...],
               dim: int | None) -> tuple[int, int]:
    """(heads, Dr) of rope part ``t`` against its partner ``ref`` (query or key): every dim but the head and D
    axes equal ref's; heads in ``heads``; Dr == ``dim`` when given, else > 0."""
    check_same_dtype(op, name, t, "query", ref)
    check_rank(op, name, t, (ref.dim(),))
    split = layout in _HEAD_SPLIT
    n_dim = None if split else {"BNSD": 1, "BSND": 2, "TND": 1}[layout]
    for axis in range(ref.dim() - 1):
        if axis != n_dim and t.shape[axis] != ref.shape[axis]:
            raise invalid(op, name, f"dim {axis} must equal {'query' if name == 'queryRope' else 'key'}'s "
                          f"size {ref.shape[axis]}", list(t.shape))
    if split:
        width = t.shape[-1]
        options = [(h, width // h) for h in heads if width % h == 0 and (dim is None or width // h == dim)]
        if not options or options[0][1] == 0:
            rule = f"H must be {' or '.join(str(h) for h in heads)} heads x Dr" + ("" if dim is None else f" = {dim}")
            raise invalid(op, name, rule + " (Dr > 0)", width)
        return options[0]
    n, d = t.shape[n_dim], t.shape[-1]
    if n not in heads:
        raise invalid(op, name, f"N axis must be one of {list(dict.fromkeys(heads))}", n)
    if d == 0 or (dim is not None and d != dim):
        raise invalid(op, name, "D axis Dr must be > 0" + ("" if dim is None else f" and equal queryRope's {dim}"),
                      d)
    return n, d


def check_rope(op: str, layout: str, n1: int, n2: int, query, key, query_rope, key_rope) -> tuple | None:
    """``(query_rope, key_rope, key_rope heads)`` checked against query / key, or None when both are absent.
    Both or neither (161001); query's dtype and rank, query's / key's sizes but the head and D axes, N1 and
    N2-or-1 heads, one Dr > 0 (161002)."""
    pair = _pair(op, query_rope, key_rope)
    if pair is None:
        return None
    query_rope, key_rope = pair
    _, dr = _rope_dims(op, layout, "queryRope", query_rope, query, (n1,), None)
    nr, _ = _rope_dims(op, layout, "keyRope", key_rope, key, (n2, 1), dr)
    return query_rope.detach(), key_rope.detach(), nr


def check_sink(op: str, sink, n1: int) -> torch.Tensor | None:
    """sink: float32 ``[N1]`` (161002 otherwise), or None when absent."""
    if absent(sink):
        return None
    sink = require_tensor(op, "sinkIn", sink)
    check_dtype(op, "sinkIn", sink, (torch.float32,))
    if tuple(sink.shape) != (n1,):
        raise invalid(op, "sinkIn", f"shape must be [headNum] = [{n1}]", list(sink.shape))
    return sink.detach()


def check_extra_outputs(op: str, outputs: dict, tensors) -> None:
    """The aclnn grad's dqRopeOut / dkRopeOut / dsinkOut given in ``outputs`` (by name): required when their
    input is given (161001), then its shape and dtype (161002)."""
    for name, t in outputs.items():
        source = getattr(tensors, EXTRA_GRAD_OUTPUTS[name][0])
        if not absent(source):
            check_output(op, name, t, tuple(source.shape), source.dtype)
