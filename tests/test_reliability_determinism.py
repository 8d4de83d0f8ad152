"""Determinism: identical bits across repeated calls, across thread counts and,
for flash attention, across tile schedules (batch splits and the backward's key-chunk count).
"""

from __future__ import annotations

import pytest
import torch

import attngrad
from attngrad.kernels import flash_attention as fa_kernels
from helpers import same_bits, torch_threads
from reliability_cases import FA_DEFAULTS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def workloads(dtype):
    """One call per operator, big enough that every kernel splits its work over both threads."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, mask = r(2, 3, 33, 300), torch.rand(1, 3, 33, 300, generator=g) < 0.3
    y = attngrad.scaled_masked_softmax(x, mask, 0.7)
    xs = r(1, 2, 77) * 0.1
    seg = attngrad.exp_segsum(xs)
    q, k, v, dy = r(1, 300, 4, 32), r(1, 600, 2, 32), r(1, 600, 2, 16), r(1, 300, 4, 16)
    return {
        "sms_forward": lambda: attngrad.scaled_masked_softmax(x, mask, 0.7),
        "sms_backward": lambda: attngrad.scaled_masked_softmax_backward(r_like(x, 2), y, mask, 0.7),
        "segsum_forward": lambda: attngrad.exp_segsum(xs),
        "segsum_backward": lambda: attngrad.exp_segsum_backward(r_like(seg, 3), seg),
        "fa_forward": lambda: attngrad.flash_attention_score(q, k, v, 4, "BSND", scale_value=0.2),
        "fa_grad": lambda: attngrad.flash_attention_score_grad(q, k, v, dy, 4, "BSND", scale_value=0.2)[:3],
    }


def r_like(t, seed):
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.dtype)


def flat(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def assert_same(a, b, what):
    for i, (x, y) in enumerate(zip(flat(a), flat(b))):
        assert same_bits(x, y), f"{what}: output {i} differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_calls_and_thread_counts_same_bits(dtype):
    calls = workloads(dtype)
    for name, call in calls.items():
        first = call()
        assert_same(first, call(), f"{name} repeated")
        for count in (1, 2):
            with torch_threads(count):
                assert_same(first, call(), f"{name} with {count} threads")


def _fa(q, k, v, dy):
    out, m, s = attngrad.flash_attention_score(q, k, v, q.shape[1], "BNSD", scale_value=0.3)
    return (out, m, s, *attngrad.flash_attention_score_grad(q, k, v, dy, q.shape[1], "BNSD", scale_value=0.3,
                                                            softmax_max=m, softmax_sum=s, attention_in=out)[:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_batch_split_same_bits(dtype):
    """Running the batches one at a time (other B*N task splits, other key-chunk counts) changes no bit of
    out, max, sum, dk and dv; dq too when both runs use the same number of key chunks."""
    g = torch.Generator().manual_seed(2)
    q, k, v, dy = (torch.randn(s, generator=g).to(dtype) for s in
                   ((3, 4, 70, 16), (3, 2, 1100, 16), (3, 2, 1100, 8), (3, 4, 70, 8)))
    whole = _fa(q, k, v, dy)
    for b in range(3):
        part = _fa(q[b:b + 1], k[b:b + 1], v[b:b + 1], dy[b:b + 1])
        for i in (0, 1, 2, 4, 5):
            assert same_bits(whole[i][b:b + 1], part[i]), f"batch {b}: output {i}"
        torch.testing.assert_close(whole[3][b:b + 1].float(), part[3].float(), rtol=1e-2, atol=1e-2)
    assert fa_kernels.backward_chunks(6, 1100) != fa_kernels.backward_chunks(2, 1100)  # the split really differs


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_flash_attention_key_chunks_only_reassociate_dq(monkeypatch, chunks):
    """Other key-chunk schedules of the backward: dk and dv keep their bits (one task owns a key block);
    dq is the same sum in another order (close, and bit-identical for the same chunk count)."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dy = (torch.randn(s, generator=g) for s in ((1, 2, 40, 8), (1, 1, 700, 8), (1, 1, 700, 8),
                                                          (1, 2, 40, 8)))
    base = _fa(q, k, v, dy)
    monkeypatch.setattr(fa_kernels, "backward_chunks", lambda batch_kv_heads, skv: chunks)
    again = _fa(q, k, v, dy)
    for i in (0, 1, 2, 4, 5):
        assert same_bits(base[i], again[i]), f"output {i} with {chunks} chunks"
    torch.testing.assert_close(base[3], again[3], rtol=1e-5, atol=1e-6)
    assert same_bits(again[3], _fa(q, k, v, dy)[3])


def test_aclnn_and_npu_layers_same_bits_as_torch_layer():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    kw = {key: FA_DEFAULTS[key] for key in ("scale_value", "keep_prob")}
    ref = attngrad.flash_attention_score(q, k, v, 3, "BSND", **kw)
    got = attngrad.npu.npu_fusion_attention(q, k, v, 3, "BSND", scale=kw["scale_value"])
    assert_same(ref, tuple(got[:3]), "npu_fusion_attention")
