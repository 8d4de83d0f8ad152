"""The precision mode: golden results against the float64 references by CANN's element rule, the npu default
unchanged, the kernel flags independent, and how the mode is set (context per thread, setter, environment)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import attngrad
from attngrad import AclnnError, precision_mode
from attngrad.kernels import flash_attention as fa_kernels
from attngrad.kernels.dropout import generate_drop_mask
from attngrad.kernels.flash_attention_plan import AttentionPlan
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                        flash_attention_dpse_reference,
                                                        flash_attention_forward_reference)
from attngrad.kernels.scaled_masked_softmax_reference import scaled_masked_softmax_reference
from attngrad.ops.flash_attention import to_bnsd
from attngrad.precision import ELEMENT_BAD_RATIO, element_bad
from attngrad.precision_mode import ENV_VAR, current_precision

from helpers import attention_inputs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALE = 0.125


def bad_ratio(actual, golden) -> float:
    return float(element_bad(actual, golden).double().mean())


def assert_golden(actual, golden, dtype):
    """fp32: no bad element; bf16/fp16: within CANN's 0.5% bad ratio."""
    ratio = bad_ratio(actual, golden)
    assert ratio <= (0.0 if dtype == torch.float32 else ELEMENT_BAD_RATIO), ratio


CASES = [  # layout, dtype, (B, N1, N2, Sq, Skv, D), extras
    ("BNSD", torch.float32, (1, 2, 1, 300, 280, 64), "plain"),
    ("BSH", torch.bfloat16, (2, 2, 2, 260, 260, 32), "pse+dropout"),
    ("BSND", torch.float16, (1, 4, 2, 200, 330, 48), "causal"),
    ("SBH", torch.bfloat16, (1, 2, 1, 130, 130, 64), "plain"),
]


@pytest.mark.parametrize("layout,dtype,dims,extras", CASES)
def test_flash_attention_golden_against_float64(layout, dtype, dims, extras):
    b, n1, n2, sq, skv, d = dims
    q, k, v, dy = attention_inputs(layout, b, n1, n2, sq, skv, d, d, dtype, seed=3)
    kw, plan_kw = dict(scale_value=SCALE), dict(scale=SCALE)
    if extras == "pse+dropout":
        pse = torch.randn(b, n1, sq, skv, generator=torch.Generator().manual_seed(1)).to(dtype)
        drop = generate_drop_mask(seed=1, offset=0, numels=b * n1 * sq * skv, keep_prob=0.8)
        kw.update(pse=pse, drop_mask=drop, keep_prob=0.8)
        plan_kw.update(pse=pse, keep_prob=0.8, drop_mask=drop)
    if extras == "causal":
        kw.update(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=3)
        plan_kw.update(atten_mask=torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq + 1).view(1, 1, sq, skv))
    with precision_mode("golden"):
        out, smax, ssum = attngrad.flash_attention_score(q, k, v, n1, layout, **kw)
        dq, dk, dv, dpse = attngrad.flash_attention_score_grad(q, k, v, dy, n1, layout, softmax_max=smax,
                                                               softmax_sum=ssum, attention_in=out, **kw)
    plan = AttentionPlan(**plan_kw)
    bq, bk, bv, bdy = to_bnsd(q, layout, n1), to_bnsd(k, layout, n2), to_bnsd(v, layout, n2), to_bnsd(dy, layout, n1)
    g_out, _, _ = flash_attention_forward_reference(bq, bk, bv, plan)
    assert_golden(to_bnsd(out, layout, n1), g_out, dtype)
    stats = smax[..., 0], ssum[..., 0]
    golden = flash_attention_backward_reference(bq, bk, bv, bdy, g_out, *stats, plan)  # D = rowsum(P dP)
    for got, want, heads in zip((dq, dk, dv), golden, (n1, n2, n2)):
        assert_golden(to_bnsd(got, layout, heads), want, dtype)
    if extras == "pse+dropout":
        assert_golden(dpse, flash_attention_dpse_reference(bq, bk, bv, bdy, g_out, *stats, plan), dtype)


def test_flash_attention_varlen_golden_and_npu_default():
    """TND in golden mode against float64; the default (npu) mode rounds P and dS: more bad elements in bf16."""
    lens = [70, 190]
    cu = torch.tensor([0, 70, 260], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q, k, v, dy = (torch.randn(260, 2, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    kw = dict(actual_seq_qlen=cu[1:].tolist(), actual_seq_kvlen=cu[1:].tolist(), scale_value=SCALE)
    ratios = {}
    for mode in ("golden", "npu"):
        with precision_mode(mode):
            out, _, _ = attngrad.flash_attention_score(q, k, v, 2, "TND", **kw)
        ratios[mode] = []
        for s, n in zip(cu[:-1].tolist(), lens):
            one = lambda t: t[s:s + n].permute(1, 0, 2).unsqueeze(0)  # noqa: E731
            g_out, _, _ = flash_attention_forward_reference(one(q), one(k), one(v), AttentionPlan(scale=SCALE))
            ratios[mode].append(bad_ratio(one(out), g_out))
    assert max(ratios["golden"]) <= ELEMENT_BAD_RATIO
    assert min(ratios["npu"]) > max(ratios["golden"])


def test_kernel_flags_widened_gemm_with_rounded_probs_matches_npu(dtype=torch.bfloat16):
    """widen_gemm with round_probs: the npu mode's values (rounded P and dS, widened exactly) through float32
    GEMMs; equal to the npu mode up to float32 accumulation order. A score summed in another order (AMX sums bf16
    products in another order than the float32 brgemm) may round P to the neighbouring bf16 value, which moves an
    output that is a small difference of large terms by more than its last place: hence the absolute tolerances."""
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, 200, 300, 64, 64, dtype, seed=7)
    npu = AttentionPlan(scale=SCALE)
    fast = dataclasses.replace(npu, widen_gemm=True, round_probs=True)
    out, smax, ssum = fa_kernels.flash_attention_forward(q, k, v, npu)
    out_f, smax_f, ssum_f = fa_kernels.flash_attention_forward(q, k, v, fast)
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(out_f, out, rtol=ulp, atol=1e-4)
    torch.testing.assert_close(smax_f, smax, rtol=1e-6, atol=0)
    grads = fa_kernels.flash_attention_backward(q, k, v, dy, out, smax, ssum, npu)[:3]
    grads_f = fa_kernels.flash_attention_backward(q, k, v, dy, out, smax, ssum, fast)[:3]
    for got, want in zip(grads_f, grads):
        torch.testing.assert_close(got, want, rtol=ulp, atol=1e-4)
    golden = dataclasses.replace(npu, widen_gemm=True, round_probs=False)
    assert not torch.equal(fa_kernels.flash_attention_forward(q, k, v, golden)[0], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_golden_grad_reads_a_float32_attention_in_and_recomputes_a_rounded_one(dtype):
    """Golden mode takes D = rowsum(dy * out) from the given attention_in when it is float32 (context
    parallelism passes the merged output of all key blocks) and from the output recomputed in float32 when the
    given one is rounded to bf16 / fp16."""
    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, 64, 80, 32, 32, dtype, seed=5)
    with precision_mode("golden"):
        out, smax, ssum = attngrad.flash_attention_score(q, k, v, 2, "BNSD", scale_value=SCALE)
        kw = dict(scale_value=SCALE, softmax_max=smax, softmax_sum=ssum)
        given = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", attention_in=out, **kw)[0]
        other = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", attention_in=out * 0.5, **kw)[0]
    assert torch.equal(given, other) == (dtype != torch.float32)
    if dtype == torch.float32:  # D from out / 2: the float64 backward with that out
        ref = flash_attention_backward_reference(*(t.double() for t in (q, k, v, dy, out * 0.5)), smax[..., 0],
                                                 ssum[..., 0], AttentionPlan(scale=SCALE))[0]
        assert_golden(other, ref, dtype)


def test_npu_default_is_unchanged():
    """Without a mode the kernels round P (bf16 results differ from golden) and the mode is 'npu'."""
    assert current_precision() == "npu"
    q, k, v, _ = attention_inputs("BNSD", 1, 1, 1, 64, 64, 32, 32, torch.bfloat16, seed=2)
    npu = attngrad.flash_attention_score(q, k, v, 1, "BNSD")[0]
    with precision_mode("npu"):
        assert torch.equal(attngrad.flash_attention_score(q, k, v, 1, "BNSD")[0], npu)
    with precision_mode("golden"):
        assert not torch.equal(attngrad.flash_attention_score(q, k, v, 1, "BNSD")[0], npu)


def test_scaled_masked_softmax_golden_scales_float16_in_float32():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 2, 8, 100, generator=g) * 8).half()
    mask = torch.rand(2, 1, 8, 100, generator=g) < 0.2
    scale = 0.3
    with precision_mode("golden"):
        y = attngrad.scaled_masked_softmax(x, mask, scale)
    want = torch.softmax((x.double() * float(torch.tensor(scale, dtype=torch.float32))).masked_fill(mask, -10000.0), -1)
    assert bad_ratio(y, want) == 0.0
    npu = attngrad.scaled_masked_softmax(x, mask, scale)  # CANN's order: x * scale rounded to float16
    assert bad_ratio(npu, scaled_masked_softmax_reference(x, mask, scale)) == 0.0 and not torch.equal(npu, y)


def test_context_is_per_thread_and_setter_is_process_wide():
    seen, barrier = {}, threading.Barrier(2)

    def worker(name, mode):
        if mode is None:
            barrier.wait()
            seen[name] = current_precision()
            barrier.wait()
            return
        with precision_mode(mode):
            barrier.wait()
            seen[name] = current_precision()
            barrier.wait()

    threads = [threading.Thread(target=worker, args=("golden", "golden")), threading.Thread(target=worker,
                                                                                           args=("plain", None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"golden": "golden", "plain": "npu"}
    attngrad.set_precision_mode("golden")
    try:
        assert current_precision() == "golden"
        with precision_mode("npu"):
            assert current_precision() == "npu"
    finally:
        attngrad.set_precision_mode(None)
    assert current_precision() == "npu"


def test_environment_variable_read_at_call_time(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "golden")
    assert current_precision() == "golden"
    q, k, v, _ = attention_inputs("BNSD", 1, 1, 1, 64, 64, 32, 32, torch.bfloat16, seed=2)
    env = attngrad.flash_attention_score(q, k, v, 1, "BNSD")[0]
    with precision_mode("golden"):
        assert torch.equal(env, attngrad.flash_attention_score(q, k, v, 1, "BNSD")[0])
    monkeypatch.setenv(ENV_VAR, "fp64")
    with pytest.raises(AclnnError) as exc:
        attngrad.flash_attention_score(q, k, v, 1, "BNSD")
    assert exc.value.status == 161002 and exc.value.param == ENV_VAR and "'npu' or 'golden'" in str(exc.value)
    with pytest.raises(AclnnError):
        precision_mode("high").__enter__()


def test_layers_honour_the_mode():
    """torch_npu names and the aclnn layer run through the same contract: golden there equals golden here."""
    import attngrad.npu as npu

    q, k, v, _ = attention_inputs("BNSD", 1, 2, 2, 64, 64, 32, 32, torch.bfloat16, seed=4)
    with precision_mode("golden"):
        want = attngrad.flash_attention_score(q, k, v, 2, "BNSD", scale_value=SCALE)[0]
        got = npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=SCALE)[0]
    assert torch.equal(got, want)


def test_compiled_graph_follows_the_mode():
    def attention(q, k, v):
        return attngrad.flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(attention, fullgraph=True)
    q, k, v = (torch.randn(1, 64, 2, 32, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
               for i in range(3))
    for mode in ("npu", "golden"):
        with precision_mode(mode):
            assert torch.equal(compiled(q, k, v), attention(q, k, v)), mode
    with precision_mode("golden"):
        golden = attention(q, k, v)
    assert not torch.equal(golden, attention(q, k, v))
