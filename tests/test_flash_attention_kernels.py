"""The fused FlashAttention kernels against the float64 reference (BNSD, every dtype, GQA, odd sizes)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from numba import njit

from attngrad.kernels import flash_attention, layouts
from attngrad.kernels.flash_attention import (_EDGE_ROWS, Gradients, Sequence, _backward_tasks, _chunk_bounds,
                                              _contiguous_copy, _dq_adds, _forward_tasks, _transposed, backward_chunks,
                                              flash_attention_backward, flash_attention_forward)
from attngrad.kernels.flash_attention_plan import FLT_MAX, MASKED_LOGIT, UNBOUNDED_TOKENS, AttentionPlan
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                        flash_attention_forward_reference)
from attngrad.kernels.gemm import _gemm_for_test
from attngrad.kernels.layouts import strided_signature
from attngrad.kernels.tensor_view import kernel_view
from attngrad.precision import assert_close

from helpers import attention_inputs, same_up_to_gemm_order, torch_threads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check_forward(q, k, v, plan):
    out, smax, ssum = flash_attention_forward(q, k, v, plan)
    ref_out, ref_max, ref_sum = flash_attention_forward_reference(q, k, v, plan)
    assert out.dtype == q.dtype and smax.dtype == ssum.dtype == torch.float32
    assert_close(out, ref_out, q.dtype)
    assert_close(smax, ref_max, torch.float32)
    assert_close(ssum, ref_sum, torch.float32)


def _golden_stats(q, k, v, plan):
    """out / max / sum from the reference, in the types the backward receives."""
    out, smax, ssum = flash_attention_forward_reference(q, k, v, plan)
    return out.to(q.dtype), smax.float(), ssum.float()


def _check_backward(q, k, v, dy, plan):
    stats = _golden_stats(q, k, v, plan)
    grads = flash_attention_backward(q, k, v, dy, *stats, plan)
    golden = flash_attention_backward_reference(q, k, v, dy, *stats, plan)
    for got, want, like in zip(grads, golden, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert_close(got, want, q.dtype)
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n1,n2", [(4, 2), (3, 3), (4, 1)])
def test_odd_sizes_gqa_and_dv(dtype, n1, n2):
    q, k, v, dy = attention_inputs("BNSD", 2, n1, n2, 300, 270, 40, 24, dtype)
    plan = AttentionPlan(scale=1 / math.sqrt(40))
    _check_forward(q, k, v, plan)
    _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_query_row(dtype):
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, 1, 77, 16, 16, dtype)
    plan = AttentionPlan(scale=0.3)
    _check_forward(q, k, v, plan)
    _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    base = [t.transpose(1, 2).contiguous().transpose(1, 2)
            for t in attention_inputs("BNSD", 1, 2, 2, 65, 90, 32, 32, dtype)]
    q, k, v, dy = base[0], base[1], base[2], base[3]
    v = torch.cat([v, v], -1)[..., ::2]  # stride 2 on the last dim
    assert not q.is_contiguous() and not v.is_contiguous()
    plan = AttentionPlan(scale=0.2)
    _check_forward(q, k, v, plan)
    _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_head_is_split_and_deterministic(dtype):
    """B*N1 == 1: the backward splits the keys in chunks; same bits twice and with 1 or 2 threads."""
    q, k, v, dy = attention_inputs("BNSD", 1, 1, 1, 520, 1100, 64, 64, dtype)
    assert backward_chunks(1, 1100) > 1
    plan = AttentionPlan(scale=0.125)
    first = _check_backward(q, k, v, dy, plan)
    stats = _golden_stats(q, k, v, plan)
    with torch_threads(1):
        single = flash_attention_backward(q, k, v, dy, *stats, plan)
        single_fwd = flash_attention_forward(q, k, v, plan)
    again = flash_attention_backward(q, k, v, dy, *stats, plan)
    for a, b, c in zip(first, single[:3], again[:3]):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(flash_attention_forward(q, k, v, plan), single_fwd):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pre,nxt", [(2**31 - 1, 0), (40, 3), (2**31 - 1, -5)])
def test_band_and_mask(dtype, pre, nxt):
    """Left-up band (causal, sliding window, negative next) plus a broadcast [1, N1, Sq, Skv] mask."""
    q, k, v, dy = attention_inputs("BNSD", 2, 2, 1, 300, 280, 32, 32, dtype)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(1, 2, 300, 280, generator=gen) < 0.2
    for plan in (AttentionPlan(scale=0.2, pre_tokens=pre, next_tokens=nxt),
                 AttentionPlan(scale=0.2, pre_tokens=pre, next_tokens=nxt, atten_mask=mask)):
        _check_forward(q, k, v, plan)
        _check_backward(q, k, v, dy, plan)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("invalid_rows", [False, True])
@pytest.mark.parametrize("sq,skv,pre", [(270, 300, UNBOUNDED_TOKENS), (192, 192, 30)])
def test_fully_masked_rows(dtype, invalid_rows, sq, skv, pre):
    """Rows without any visible key: uniform P (sum = Skv) or invalid-row mode; never nan in the grad. The
    band skips keys of rows that the mask empties, in whole tiles and in the edge tiles' trimmed columns (192: one
    query block, whose key block the band does not cut as a whole)."""
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 2, sq, skv, 32, 32, dtype)
    mask = torch.zeros(1, 1, sq, skv, dtype=torch.bool)
    mask[..., 5, :] = True
    mask[..., sq - 10:, :] = True
    plan = AttentionPlan(scale=0.2, atten_mask=mask, pre_tokens=pre, next_tokens=0, invalid_rows=invalid_rows)
    _check_forward(q, k, v, plan)
    _, smax, ssum = flash_attention_forward(q, k, v, plan)
    assert (smax[..., 5] == MASKED_LOGIT).all()
    assert (ssum[..., 5] == (FLT_MAX if invalid_rows else skv)).all()
    grads = _check_backward(q, k, v, dy, plan)
    assert all(not g.float().isnan().any() for g in grads[:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_precision_gemm_keeps_fp32_output(dtype):
    a = torch.randn(70, 33).to(dtype)
    b = torch.randn(50, 33).to(dtype)
    c = torch.zeros(70, 50)
    _gemm_for_test(kernel_view(a), kernel_view(b), c.numpy(), True)
    assert_close(c, a.double() @ b.double().T, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jumps", [(5.0, 7.5), (3.0, 30.0), (40.0, -20.0)])
def test_row_max_growing_across_key_blocks(dtype, jumps):
    """Online softmax over 3 key blocks whose row max jumps up (or down) by small and large steps: the
    accumulator rescaling against the golden, fp16's range included."""
    gen = torch.Generator().manual_seed(3)
    skv, d = 1300, 16
    logits = torch.randn(2, 1, 1, skv, generator=gen)
    logits[..., 512:1024] += jumps[0]
    logits[..., 1024:] += jumps[1]
    q = torch.zeros(2, 1, 37, d)
    q[..., 0] = 1.0 + torch.rand(2, 1, 37, generator=gen) * 0.1
    k = torch.zeros(2, 1, skv, d)
    k[..., 0] = logits[:, :, 0]
    v = torch.randn(2, 1, skv, 8, generator=gen)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    _check_forward(q, k, v, AttentionPlan(scale=1.0))


def _strided(t, lead=3, tail=5, pad=3):
    """A [1, N, S, D] tensor stored as rows [lead, lead+S) of a nan-filled TND buffer [lead+S+tail, N, D+pad],
    seen as [1, N, S, D] again: strides (., D+pad, N*(D+pad), 1), the layout of a varlen batch. Returns
    (view, buffer)."""
    _, n, s, d = t.shape
    buf = torch.full((lead + s + tail, n, d + pad), float("nan"), dtype=t.dtype)
    view = buf[lead:lead + s, :, :d].permute(1, 0, 2).unsqueeze(0)
    view.copy_(t)
    return view, buf


def _strided_stats(b, n, s):
    """A nan-filled [S+4, N] float32 buffer whose rows [2, 2+S) seen as [1, N, S] (the varlen stats view)."""
    buf = torch.full((s + 4, n), float("nan"))
    return buf[2:2 + s].T.unsqueeze(0), buf


def _untouched(buf, view):
    """Every element of buf outside the view is still nan (the kernels wrote only through the view)."""
    mask = torch.ones(buf.shape, dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
    return bool(buf.float()[mask].isnan().all())


def _same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to the GEMMs' summation order: fp32 within a few fp32 ulps, fp16/bf16 as
    :func:`helpers.same_up_to_gemm_order` says."""
    if dtype == torch.float32:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    return same_up_to_gemm_order(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n1,n2,d,dv", [(4, 2, 40, 24), (3, 1, 33, 17)])
def test_strided_views_and_preallocated_outputs_match_contiguous(dtype, n1, n2, d, dv):
    """TND-batch-like views (non-contiguous sequence axis) in, preallocated strided views out: equal (up to the
    last bits, :func:`_same`) to the same problem on contiguous copies, forward and backward (GQA, odd head dims,
    causal, >1 tile)."""
    q, k, v, dy = attention_inputs("BNSD", 1, n1, n2, 300, 270, d, dv, dtype, seed=4)
    plan = AttentionPlan(scale=1 / math.sqrt(d), next_tokens=0)
    (sq_, _), (sk, _), (sv, _), (sdy, _) = (_strided(t) for t in (q, k, v, dy))
    assert not any(t.is_contiguous() for t in (sq_, sk, sv, sdy))
    want = flash_attention_forward(q, k, v, plan)
    outs = [_strided(torch.empty(1, n1, 300, dv, dtype=dtype)), _strided_stats(1, n1, 300),
            _strided_stats(1, n1, 300)]
    got = flash_attention_forward(sq_, sk, sv, plan, *(view for view, _ in outs))
    for g, w, (view, buf) in zip(got, want, outs):
        assert g is view and _same(g, w, dtype) and _untouched(buf, view)
    want = flash_attention_backward(q, k, v, dy, *want, plan)
    grads = [_strided(torch.empty(like.shape, dtype=dtype)) for like in (q, k, v)]
    got = flash_attention_backward(sq_, sk, sv, sdy, *got, plan, dq=grads[0][0], dk=grads[1][0], dv=grads[2][0])
    for g, w, (view, buf) in zip(got[:3], want[:3], grads):
        assert g is view and _same(g, w, dtype) and _untouched(buf, view)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,d", [(300, 40), (64, 128), (7, 17)])
def test_contiguous_copy_of_strided_inputs(monkeypatch, dtype, s, d, stream):
    """:func:`_contiguous_copy`: C-contiguous copies in the input's dtype and widened to float32, equal to torch's
    bit for bit, of a TND-like view (by the streaming kernel when ``stream``) and of one whose rows are not
    unit-stride (by torch)."""
    monkeypatch.setattr(flash_attention, "streams", lambda nbytes: stream)
    tnd = torch.randn(s, 3, d).to(dtype)
    column_major = torch.randn(1, 3, d, s).to(dtype).transpose(-1, -2)
    for t in (tnd.transpose(0, 1).unsqueeze(0), column_major):
        for target in (dtype, torch.float32):
            got = _contiguous_copy(t, target)
            assert got.is_contiguous() and got.dtype == target and torch.equal(got, t.to(target))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,d", [(300, 40), (64, 128), (7, 17)])
def test_transposed_copy_of_strided_and_contiguous_inputs(monkeypatch, dtype, s, d, stream):
    """The backward's transposed copies (whole 16-blocks and edge blocks) equal torch's transpose bit for bit, from
    a TND-like strided view, from a contiguous tensor and from one whose rows are not unit-stride (element by
    element); two parts (``[Q | Q_rope]^T``) stack along the head dim. ``stream``: written as a copy too large for
    the caches is (non-temporal stores where the rows are 64-byte aligned: float32 at s = 64)."""
    monkeypatch.setattr(flash_attention, "streams", lambda nbytes: stream)
    tnd = torch.randn(s, 3, d).to(dtype)
    column_major = torch.randn(1, 3, d, s).to(dtype).transpose(-1, -2)
    for t in (tnd.transpose(0, 1).unsqueeze(0), tnd.transpose(0, 1).unsqueeze(0).contiguous(), column_major):
        got = torch.from_numpy(_transposed((t,), True, t)).view(dtype)
        assert got.shape == (1, 3, d, s) and torch.equal(got, t.transpose(-1, -2))
        tail = torch.randn(1, 3, s, d // 2 + 1).to(dtype)
        got = torch.from_numpy(_transposed((t, tail), True, t)).view(dtype)
        assert torch.equal(got, torch.cat([t, tail], -1).transpose(-1, -2))


@njit
def _dq_adds_for_test(dq_acc, written, chunk, b, n, i0, rows):
    placeholder = np.zeros((1, 1, 1, 1), np.float32)
    grads = Gradients(dq_acc, written, placeholder, placeholder, placeholder, placeholder)
    return _dq_adds(grads, chunk, b, n, i0, rows)


def test_dq_product_writes_its_first_rows_and_adds_after():
    """:func:`_dq_adds`: a tile whose row groups are all unwritten writes them, one whose groups are all written
    adds; one that covers both zeroes the unwritten groups' rows (and only those) first, then adds. Every group
    it covers is marked written, in its own chunk, batch and head only."""
    E = _EDGE_ROWS
    dq_acc = np.full((2, 1, 2, 4 * E + 10, 3), np.nan, np.float32)
    written = np.zeros((2, 1, 2, 5), np.uint8)
    assert not _dq_adds_for_test(dq_acc, written, 1, 0, 1, E, E)
    assert written[1, 0, 1].tolist() == [0, 1, 0, 0, 0] and written.sum() == 1
    assert np.isnan(dq_acc).all()  # a write needs no zeros
    assert _dq_adds_for_test(dq_acc, written, 1, 0, 1, 0, 4 * E + 10)
    assert written[1, 0, 1].tolist() == [1] * 5 and written.sum() == 5
    head = dq_acc[1, 0, 1]
    assert np.isnan(head[E:2 * E]).all() and (head[:E] == 0).all() and (head[2 * E:] == 0).all()
    assert np.isnan(np.delete(dq_acc.reshape(4, -1), 3, axis=0)).all()
    assert _dq_adds_for_test(dq_acc, written, 1, 0, 1, 2 * E, E)


def _nan_filled(new_output):
    """new_output whose float tensors come filled with nan: a kernel that reads memory it did not write shows."""
    def filled(shape, dtype):
        t = new_output(shape, dtype)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return filled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,n,sq,skv,nxt", [(1, 1, 700, 1100, 0), (1, 16, 600, 600, 0), (2, 2, 300, 300, -100)])
def test_dq_slices_need_no_zeroing(monkeypatch, dtype, b, n, sq, skv, nxt):
    """The dQ slices come uninitialised (here: nan): a causal band over several key chunks (one key block each,
    or all blocks in one chunk), and a band whose first 100 rows see no key while the statistics given do not
    mark them masked, so that no tile writes their dQ (then 0, as in the reference)."""
    monkeypatch.setattr(flash_attention, "new_output", _nan_filled(flash_attention.new_output))
    q, k, v, dy = attention_inputs("BNSD", b, n, n, sq, skv, 32, 32, dtype)
    plan = AttentionPlan(scale=0.2, pre_tokens=UNBOUNDED_TOKENS, next_tokens=nxt)
    stats = _golden_stats(q, k, v, AttentionPlan(scale=0.2) if nxt < 0 else plan)
    grads = flash_attention_backward(q, k, v, dy, *stats, plan)
    golden = flash_attention_backward_reference(q, k, v, dy, *stats, plan)
    for got, want in zip(grads[:3], golden):
        assert_close(got, want, dtype)
    if nxt < 0:
        assert (grads[0][:, :, :100] == 0).all()


def test_task_lists_cover_every_block_once_costliest_first():
    """A launch's task lists (:func:`_forward_tasks`, :func:`_backward_tasks`): every query block / key chunk of
    every sequence, batch and head exactly once; under a causal band the forward goes head by head (a head's
    blocks consecutive, its last block first) from the longest sequence down, the backward chunk costs never rise."""
    causal = AttentionPlan(scale=1.0, next_tokens=0)
    sequences = [Sequence(0, 300, 0, 300, causal), Sequence(300, 1100, 300, 1100, causal),
                 Sequence(1100, 1101, 1100, 1105, AttentionPlan(scale=1.0))]
    tasks = _forward_tasks(sequences, 1, 2)
    want = {(s, 0, n, i0) for s, seq in enumerate(sequences) for n in range(2) for i0 in range(0, seq.q1 - seq.q0, 256)}
    assert sorted(map(tuple, tasks.tolist())) == sorted(want)
    assert tasks[:, 0].tolist() == [1] * 8 + [0] * 4 + [2] * 2
    assert tasks[:4, 3].tolist() == [768, 512, 256, 0] and tasks[:8, 2].tolist() == [0] * 4 + [1] * 4
    splits = [(1, 3), (1, 2), (1, 1)]
    tasks = _backward_tasks(sequences, splits, 2)
    want = {(s, 0, n, c) for s, (_, chunks) in enumerate(splits) for n in range(2) for c in range(chunks)}
    assert sorted(map(tuple, tasks[:, :4].tolist())) == sorted(want)
    for s, (_, chunks) in enumerate(splits):  # each chunk a run of key blocks, together all blocks in order
        bounds = sorted({tuple(t) for t in tasks[tasks[:, 0] == s][:, 3:].tolist()})
        assert [b0 for _, b0, _ in bounds] + [bounds[-1][2]] == [0] + [b1 for _, _, b1 in bounds]
        assert bounds[-1][2] == -(-(sequences[s].k1 - sequences[s].k0) // 256) and len(bounds) == chunks
    assert tasks[0].tolist() == [1, 0, 0, 0, 0, 1]  # the longest causal sequence's first key block sees the most
    # rows: a chunk of its own (the other 3 blocks, 900 rows less, make the second chunk)
    assert tasks[2].tolist()[3:] == [1, 1, 4]


def test_key_chunks_of_about_equal_cost():
    """:func:`_chunk_bounds`: equal costs give equal runs (the earlier chunk the shorter on a tie); a causal
    band's early blocks cost the most and get shorter chunks; never an empty chunk while blocks last."""
    assert _chunk_bounds(np.ones(8), 2).tolist() == [0, 4, 8]
    assert _chunk_bounds(np.ones(5), 2).tolist() == [0, 2, 5]
    assert _chunk_bounds(np.arange(8, 0, -1), 2).tolist() == [0, 2, 8]  # 15 | 21 (even runs: 26 | 10)
    assert _chunk_bounds(np.array([100, 1, 1, 1]), 3).tolist() == [0, 1, 2, 4]
    assert _chunk_bounds(np.ones(2), 4).tolist() == [0, 1, 2, 2, 2]
    assert _chunk_bounds(np.zeros(0), 1).tolist() == [0, 0]


def test_one_launch_of_sequences_equals_each_alone_with_dpse():
    """Sequences of one launch with different plans (a dense per-sequence pse written straight into its dpse, a
    row-broadcast one summed in an fp32 accumulator: the launch then sums both in fp32) give each sequence's
    results of a call of its own, dpse included, and leave the rows of no sequence alone."""
    dtype, n1, d = torch.bfloat16, 2, 16
    g = torch.Generator().manual_seed(5)
    rows = [(0, 40, 0, 50), (45, 75, 55, 60)]  # rows 40-45 and 50-55 belong to no sequence
    q, k, v, dy = (torch.randn(1, n1, 80, d, generator=g).to(dtype) for _ in range(4))
    pses = [torch.randn(1, n1, 40, 50, generator=g).to(dtype), torch.randn(1, n1, 1, 5, generator=g).to(dtype)]
    plans = [AttentionPlan(scale=0.3, pse_type=0, pse=pses[0], next_tokens=10), AttentionPlan(scale=0.3, pse=pses[1])]
    sequences = [Sequence(*r, p) for r, p in zip(rows, plans)]
    out, smax, ssum = (torch.full(shape, 7.0, dtype=t) for shape, t in (((1, n1, 80, d), dtype),
                                                                         ((1, n1, 80), torch.float32),
                                                                         ((1, n1, 80), torch.float32)))
    flash_attention_forward(q, k, v, plans[0], out, smax, ssum, sequences=sequences)
    grads = [torch.full(t.shape, 7.0, dtype=dtype) for t in (q, k, v)]
    dq, dk, dv, dpse = flash_attention_backward(q, k, v, dy, out, smax, ssum, plans[0], True, *grads,
                                                sequences=sequences)[:4]
    for (q0, q1, k0, k1), plan, got_dpse in zip(rows, plans, dpse):
        alone = flash_attention_forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], plan)
        for got, want in zip((out[:, :, q0:q1], smax[:, :, q0:q1], ssum[:, :, q0:q1]), alone):
            assert same_up_to_gemm_order(got, want, dtype)
        want = flash_attention_backward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], dy[:, :, q0:q1], *alone, plan,
                                        with_dpse=True)
        for got, want_grad in zip((dq[:, :, q0:q1], dk[:, :, k0:k1], dv[:, :, k0:k1], got_dpse), want):
            assert got.shape == want_grad.shape and same_up_to_gemm_order(got, want_grad, dtype)
    assert (out[:, :, 40:45] == 7).all() and (smax[:, :, 75:] == 7).all() and (dq[:, :, 40:45] == 7).all()
    assert (dk[:, :, 50:55] == 7).all() and (dv[:, :, 60:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_pse_a_dense_pse_and_alibi_share_one_kernel_specialisation(monkeypatch, dtype):
    """An absent pse (and dpse) stands in as a placeholder of the query's dtype and the alibi slopes have a field of
    their own, so a call without pse, one with a dense pse and its gradient and one with alibi slopes launch both
    kernels with the same argument types (one compiled specialisation, not one per pse form)."""
    launched = {"_forward_kernel": set(), "_backward_kernel": set()}
    launch = layouts.launch_strided

    def recording_launch(kernel, *args, exact=()):
        if kernel.py_func.__name__ in launched:
            launched[kernel.py_func.__name__].add(strided_signature(args, exact))
        return launch(kernel, *args, exact=exact)

    monkeypatch.setattr(layouts, "launch_strided", recording_launch)
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 2, 24, 24, 16, 16, dtype)
    dense, slopes = torch.randn(1, 2, 24, 24).to(dtype), torch.tensor([[0.5, 0.25]])
    for plan in (AttentionPlan(scale=0.3), AttentionPlan(scale=0.3, pse_type=0, pse=dense),
                 AttentionPlan(scale=0.3, pse_type=2, pse=slopes)):
        stats = flash_attention_forward(q, k, v, plan)
        flash_attention_backward(q, k, v, dy, *stats, plan, with_dpse=plan.pse_type == 0)
    assert [len(types) for types in launched.values()] == [1, 1]
