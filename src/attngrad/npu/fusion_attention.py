"""torch_npu's ``npu_fusion_attention(_v2)`` and ``npu_fusion_attention_grad(_v2)`` (spec section 1.6).

Names, defaults (``pre_tockens`` / ``next_tockens`` spellings in v1) and return tuples follow torch_npu:
the forward returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)`` with an
empty ``softmax_out`` (reserved) and ``numels = B * N1 * Sq * Skv``; the grads return ``(dq, dk, dv, dpse,
dsink)`` (v1) and ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` (v2), absent ones as empty tensors.
``gen_mask_parallel`` and ``sync`` only steer the NPU's mask generation and are accepted without effect.

Not supported yet (AclnnError 161002): dropout (keep_prob < 1; torch_npu regenerates the mask from seed,
offset and numels), ``sink``, ``query_rope`` / ``key_rope``.
"""

from __future__ import annotations

import torch

from ..ops.flash_attention import SEQ_DIM, flash_attention_score, flash_attention_score_grad
from ..validation import invalid

_FORWARD = "npu_fusion_attention"
_GRAD = "npu_fusion_attention_grad"


def _reject_unsupported(op: str, keep_prob, dropout_mask=None, **optional) -> None:
    """Dropout mask generation, sink and rope are later issues: refuse them rather than ignore them.

    An explicit ``dropout_mask`` goes to the contract (ignored when keep_prob == 1, as in CANN).
    """
    if dropout_mask is None and isinstance(keep_prob, (int, float)) and not isinstance(keep_prob, bool) \
            and keep_prob < 1:
        raise invalid(op, "keep_prob", "dropout (keep_prob < 1, mask generated from seed/offset) is not "
                                       "supported yet", keep_prob)
    for name, value in optional.items():
        if value is not None:
            raise invalid(op, name, "is not supported yet", type(value).__name__)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype)


def _numels(key, input_layout, softmax_max) -> int:
    """torch_npu's dropout element count B * N1 * Sq * Skv (non-TND)."""
    b, n1, sq = softmax_max.shape[:3]
    return int(b * n1 * sq * key.shape[SEQ_DIM[input_layout]])


def _forward(query, key, value, head_num, input_layout, seed, offset, **kw):
    out, softmax_max, softmax_sum = flash_attention_score(query, key, value, head_num, input_layout, **kw)
    numels = _numels(key, input_layout, softmax_max)
    return out, softmax_max, softmax_sum, _empty_like(query), seed, offset, numels


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    """torch_npu ``npu_fusion_attention`` -> ``(attention_out, softmax_max, softmax_sum, softmax_out, seed,
    offset, numels)``."""
    _reject_unsupported(_FORWARD, keep_prob, dropout_mask, sink=sink)
    return _forward(query, key, value, head_num, input_layout, seed, offset, pse=pse, drop_mask=dropout_mask,
                    padding_mask=padding_mask, atten_mask=atten_mask, scale_value=scale, keep_prob=keep_prob,
                    pre_tokens=pre_tockens, next_tokens=next_tockens, inner_precise=inner_precise, prefix=prefix,
                    actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                    softmax_layout=softmax_layout)


def npu_fusion_attention_v2(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                            atten_mask=None, query_rope=None, key_rope=None, scale=1., keep_prob=1.,
                            pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, prefix=None,
                            actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                            sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None, softmax_layout="",
                            sink=None, dropout_mask=None, seed=0, offset=0):
    """torch_npu ``npu_fusion_attention_v2``: v1 plus pse_type, q/kv_start_idx (and rope, not supported)."""
    _reject_unsupported(_FORWARD + "_v2", keep_prob, dropout_mask, query_rope=query_rope, key_rope=key_rope,
                        sink=sink)
    return _forward(query, key, value, head_num, input_layout, seed, offset, pse=pse, drop_mask=dropout_mask,
                    padding_mask=padding_mask, atten_mask=atten_mask, scale_value=scale, keep_prob=keep_prob,
                    pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise, prefix=prefix,
                    actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                    pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx,
                    softmax_layout=softmax_layout)


def _grad(query, key, value, dy, head_num, input_layout, pse, **kw):
    dq, dk, dv, dpse = flash_attention_score_grad(query, key, value, dy, head_num, input_layout, pse=pse, **kw)
    return dq, dk, dv, _empty_like(query) if dpse is None else dpse


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    """torch_npu ``npu_fusion_attention_grad`` -> ``(dq, dk, dv, dpse, dsink)`` (pseType 1)."""
    _reject_unsupported(_GRAD, keep_prob, sink=sink)
    dq, dk, dv, dpse = _grad(query, key, value, dy, head_num, input_layout, pse, padding_mask=padding_mask,
                             atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
                             softmax_in=softmax_in, attention_in=attention_in, scale_value=scale_value,
                             keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
                             inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
                             actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                             softmax_layout=softmax_layout)
    return dq, dk, dv, dpse, _empty_like(query)


def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, query_rope=None, key_rope=None, scale_value=1., keep_prob=1.,
                                 pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, seed=0, offset=0,
                                 numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                 sparse_mode=0, gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None,
                                 kv_start_idx=None, softmax_layout="", sink=None):
    """torch_npu ``npu_fusion_attention_grad_v2`` -> ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``."""
    _reject_unsupported(_GRAD + "_v2", keep_prob, query_rope=query_rope, key_rope=key_rope, sink=sink)
    dq, dk, dv, dpse = _grad(query, key, value, dy, head_num, input_layout, pse, padding_mask=padding_mask,
                             atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
                             softmax_in=softmax_in, attention_in=attention_in, scale_value=scale_value,
                             keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens,
                             inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
                             actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=pse_type,
                             q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, softmax_layout=softmax_layout)
    empty = _empty_like(query)
    return dq, dk, dv, dpse, empty, empty, empty
