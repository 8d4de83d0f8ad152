"""torch_npu's ``npu_fusion_attention(_v2)`` and ``npu_fusion_attention_grad(_v2)``.

Names, defaults (``pre_tockens`` / ``next_tockens`` spellings in v1) and return tuples follow torch_npu:
the forward returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)`` with an
empty ``softmax_out`` (reserved) and ``numels = B * N1 * Sq * Skv``; the grads return ``(dq, dk, dv, dpse,
dsink)`` (v1) and ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` (v2), absent ones as empty tensors.
``gen_mask_parallel`` and ``sync`` only steer the NPU's mask generation and are accepted without effect.

Dropout (keep_prob < 1): the forward draws the keep mask from ``(seed, offset)`` with attngrad's documented
counter-based generator (:func:`attngrad.kernels.dropout.generate_drop_mask`) and returns ``(seed, offset,
numels)``; the grads regenerate the very same mask from them, as torch_npu does. attngrad extensions (torch_npu's
NPU draws the mask itself): the forwards take ``seed`` and ``offset``, and every name takes an explicit bit-packed
keep mask ``dropout_mask`` (e.g. one dumped from an NPU run), which the grad then needs too: the returned
``(seed, offset)`` do not describe it. ``sink`` (float32 ``[N1]``) and ``query_rope`` /
``key_rope`` (MLA's rope parts) run on every layout and dtype (see :mod:`attngrad.ops.flash_attention_sink_rope`);
the forwards are differentiable w.r.t. them.
"""

from __future__ import annotations

import numbers

import torch

from ..kernels.dropout import generate_drop_mask
from ..kernels.flash_attention_plan import UNBOUNDED_TOKENS
from ..ops.flash_attention import score, score_grad
from ..ops.flash_attention_core import BATCH_DIM, SEQ_DIM, split_kwargs


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype)


def _lengths(cumulative) -> list[int]:
    values = [int(x) for x in cumulative]
    return [b - a for a, b in zip([0] + values[:-1], values)]


def _numels(query, key, head_num, input_layout, actual_seq_qlen=None, actual_seq_kvlen=None) -> int:
    """torch_npu's dropout element count: B * N1 * Sq * Skv, or N1 * sum_b Sq_b * Skv_b for TND (0 when the
    shapes are malformed: the contract then reports them)."""
    try:
        if str(input_layout).upper() == "TND":
            pairs = zip(_lengths(actual_seq_qlen), _lengths(actual_seq_kvlen))
            return int(head_num) * sum(sq * skv for sq, skv in pairs)
        layout = str(input_layout).upper()
        return int(query.shape[BATCH_DIM[layout]] * int(head_num) * query.shape[SEQ_DIM[layout]]
                   * key.shape[SEQ_DIM[layout]])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, NotImplementedError):
        return 0


def _drop_mask(keep_prob, dropout_mask, seed, offset, numels):
    """The explicit mask, or the generated one for (seed, offset, numels) when keep_prob < 1."""
    if dropout_mask is not None or not isinstance(keep_prob, numbers.Real) or isinstance(keep_prob, bool) \
            or not 0 < keep_prob < 1:
        return dropout_mask
    return generate_drop_mask(seed, offset, numels, keep_prob)


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=UNBOUNDED_TOKENS, next_tockens=UNBOUNDED_TOKENS,
                         inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    """torch_npu ``npu_fusion_attention`` -> ``(attention_out, softmax_max, softmax_sum, softmax_out, seed,
    offset, numels)``: :func:`npu_fusion_attention_v2` with pse_type 1."""
    return npu_fusion_attention_v2(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        scale=scale, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout,
        sink=sink, dropout_mask=dropout_mask, seed=seed, offset=offset)


def npu_fusion_attention_v2(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                            atten_mask=None, query_rope=None, key_rope=None, scale=1., keep_prob=1.,
                            pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, inner_precise=0, prefix=None,
                            actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                            sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None, softmax_layout="",
                            sink=None, dropout_mask=None, seed=0, offset=0):
    """torch_npu ``npu_fusion_attention_v2``: v1 plus pse_type, q/kv_start_idx, query_rope / key_rope."""
    numels = _numels(query, key, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen)
    drop_mask = _drop_mask(keep_prob, dropout_mask, seed, offset, numels)
    out, softmax_max, softmax_sum = score(query, key, value, *split_kwargs(
        head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask, atten_mask=atten_mask,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, scale_value=scale, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
        softmax_layout=softmax_layout, query_rope=query_rope, key_rope=key_rope, sink=sink))
    return out, softmax_max, softmax_sum, _empty_like(query), seed, offset, numels


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=UNBOUNDED_TOKENS,
                              next_tockens=UNBOUNDED_TOKENS, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None, dropout_mask=None):
    """torch_npu ``npu_fusion_attention_grad`` -> ``(dq, dk, dv, dpse, dsink)``:
    :func:`npu_fusion_attention_grad_v2` with pse_type 1."""
    dq, dk, dv, dpse, _, _, dsink = npu_fusion_attention_grad_v2(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
        softmax_layout=softmax_layout, sink=sink, dropout_mask=dropout_mask)
    return dq, dk, dv, dpse, dsink


def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, query_rope=None, key_rope=None, scale_value=1., keep_prob=1.,
                                 pre_tokens=UNBOUNDED_TOKENS, next_tokens=UNBOUNDED_TOKENS, inner_precise=0, seed=0,
                                 offset=0, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                 sparse_mode=0, gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None,
                                 kv_start_idx=None, softmax_layout="", sink=None, dropout_mask=None):
    """torch_npu ``npu_fusion_attention_grad_v2`` -> ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``; the drop
    mask is ``dropout_mask`` or regenerated from (seed, offset, numels) (numels 0: from the shapes)."""
    numels = numels or _numels(query, key, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen)
    drop_mask = _drop_mask(keep_prob, dropout_mask, seed, offset, numels)
    dq, dk, dv, dpse, *extras = score_grad(query, key, value, dy, *split_kwargs(
        head_num, input_layout, pse=pse, drop_mask=drop_mask, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_in, attention_in=attention_in,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, q_start_idx=q_start_idx,
        kv_start_idx=kv_start_idx, scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, sparse_mode=sparse_mode, pse_type=pse_type,
        softmax_layout=softmax_layout, query_rope=query_rope, key_rope=key_rope, sink=sink))
    dq_rope, dk_rope, dsink = extras or (None, None, None)
    return (dq, dk, dv, *(_empty_like(query) if g is None else g for g in (dpse, dq_rope, dk_rope, dsink)))
