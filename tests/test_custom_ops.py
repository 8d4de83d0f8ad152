"""attngrad's operators as torch.library custom ops: schema, fake kernels, autograd, torch.compile and torch.export.

Compiled and exported graphs call the same kernels as eager, so attngrad's results must be bitwise equal; a bad
input raises the contract's AclnnError while dynamo traces (found in the error chain dynamo raises).
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import attngrad
from attngrad import AclnnError, aclnn_error_of

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_scaled_masked_softmax(dtype):
    x = _rand(2, 3, 8, 24, dtype=dtype, grad=True)
    mask = torch.rand(2, 1, 8, 24) > 0.7
    ops = torch.ops.attngrad
    opcheck(ops.scaled_masked_softmax.default, (x, mask, 0.5, False))
    opcheck(ops.scaled_masked_softmax.default, (x, None, 1.0, True))
    opcheck(ops.scaled_masked_softmax.default, (x, mask, 0.5, False, "golden"))
    y = attngrad.scaled_masked_softmax(x.detach(), mask, 0.5)
    opcheck(ops.scaled_masked_softmax_backward.default, (_rand(2, 3, 8, 24, dtype=dtype), y, mask, 0.5, False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_exp_segsum(dtype):
    x = (-torch.rand(2, 3, 4, 16)).to(dtype).requires_grad_()
    ops = torch.ops.attngrad
    opcheck(ops.exp_segsum.default, (x,))
    out = attngrad.exp_segsum(x.detach())
    opcheck(ops.exp_segsum_backward.default, (_rand(*out.shape, dtype=dtype), out))


class _SoftmaxSegsumBlock(torch.nn.Module):
    """A toy block around the memory-bound operators: a projection, a masked softmax, a segsum decay."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, mask, a):
        y = attngrad.scaled_masked_softmax(self.proj(x), mask, 0.125)
        return y, attngrad.exp_segsum(a * 0.5)


def _softmax_and_segsum(x, mask, a):
    return attngrad.scaled_masked_softmax(x, mask, 0.125), attngrad.exp_segsum(a)


def _outputs_and_grads(fn, x, mask, a):
    x, a = x.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()
    y, decay = fn(x, mask, a)
    torch.autograd.backward((y, decay), (torch.ones_like(y), torch.full_like(decay, 0.5)))
    return y, decay, x.grad, a.grad


def _inputs(rows: int, dtype=torch.float32):
    return _rand(2, 4, rows, 32, dtype=dtype), torch.rand(2, 1, rows, 32) > 0.8, (-torch.rand(2, 4, rows)).to(dtype)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_is_bitwise_eager(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(_softmax_and_segsum, fullgraph=True, dynamic=dynamic)
    for rows, dtype in ((16, torch.float32), (24, torch.float32), (24, torch.bfloat16)):
        inputs = _inputs(rows, dtype)
        # dynamic=True: a new sequence length reuses the graph (the stance raises on a recompile)
        stance = "fail_on_recompile" if dynamic and rows == 24 and dtype == torch.float32 else "default"
        with torch.compiler.set_stance(stance):
            got = _outputs_and_grads(compiled, *inputs)
        for g, want in zip(got, _outputs_and_grads(_softmax_and_segsum, *inputs)):
            torch.testing.assert_close(g, want, rtol=0, atol=0)


def test_compiled_block_matches_eager():
    torch._dynamo.reset()
    block = _SoftmaxSegsumBlock(32)
    compiled = torch.compile(block, fullgraph=True)
    inputs = _inputs(16)
    for got, want in zip(_outputs_and_grads(compiled, *inputs), _outputs_and_grads(block, *inputs)):
        torch.testing.assert_close(got, want)


def test_export_round_trip():
    block = _SoftmaxSegsumBlock(32).eval()
    x, a = _rand(2, 4, 16, 32), -torch.rand(2, 4, 16)
    mask = torch.rand(2, 1, 16, 32) > 0.8
    program = torch.export.export(block, (x, mask, a))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"attngrad.scaled_masked_softmax.default", "attngrad.exp_segsum.default"} <= targets
    for got, want in zip(program.module()(x, mask, a), block(x, mask, a)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _eager_error(fn, *args) -> AclnnError:
    with pytest.raises(AclnnError) as info:
        fn(*args)
    return info.value


def _attention_with_mask(q, k, v, mask):
    return attngrad.flash_attention_score(q, k, v, 2, "BNSD", atten_mask=mask)[0]


@pytest.mark.parametrize("case", ["float mask", "3-D segsum", "attention mask shape"])
def test_bad_input_under_compile_raises_the_eager_error(case):
    torch._dynamo.reset()
    if case == "float mask":
        fn = lambda x, m: attngrad.scaled_masked_softmax(x, m, 0.5)  # noqa: E731
        args = (_rand(1, 2, 4, 8), torch.zeros(1, 1, 4, 8))
    elif case == "3-D segsum":
        fn, args = attngrad.exp_segsum_backward, (_rand(2, 4, 4), _rand(2, 4, 4))
    else:
        fn, args = _attention_with_mask, (*(_rand(1, 2, 8, 4) for _ in range(3)), torch.zeros(8, 9, dtype=torch.bool))
    expected = _eager_error(fn, *args)
    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
    found = aclnn_error_of(info.value)
    assert found is not None, f"no AclnnError in the chain of {type(info.value).__name__}: {info.value}"
    assert (found.status, str(found)) == (expected.status, str(expected))


# ------------------------------------------------------------------------------------------ flash attention
def _rope(x, base: float = 10000.0):
    """Rotary embedding of x [B, S, N, D] (pairs of halves), as a model would apply it before attention."""
    s, d = x.shape[1], x.shape[3]
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(s, dtype=torch.float32)[:, None] * freq
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


class _AttentionBlock(torch.nn.Module):
    """A GQA causal attention block with RoPE on attngrad's FlashAttentionScore, in one of five variants:
    'causal' (sparse mode 3), 'alibi' (generated pse, pse_type 2), 'pse' (a learnable dense bias, pse_type 1),
    'dropout' (keep_prob 0.9 with a fixed drop mask) and 'tnd' (two packed documents, varlen)."""

    def __init__(self, variant: str, width=64, heads=4, kv_heads=2, seq=32):
        super().__init__()
        self.variant, self.heads, self.kv_heads, self.dim = variant, heads, kv_heads, width // heads
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * self.dim, bias=False)
        self.out = torch.nn.Linear(heads * self.dim, width, bias=False)
        self.register_buffer("mask", torch.ones(2048, 2048, dtype=torch.bool).triu(1), persistent=False)
        self.register_buffer("slopes", 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)), persistent=False)
        self.pse = torch.nn.Parameter(0.1 * torch.randn(1, heads, seq, seq))
        bits = torch.Generator().manual_seed(1)
        self.register_buffer("drop", torch.randint(0, 256, (2 * heads * seq * seq // 8,), dtype=torch.uint8,
                                                   generator=bits), persistent=False)
        self.register_buffer("cu", torch.tensor([seq // 4, seq], dtype=torch.int64), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.dim).split([self.heads, self.kv_heads, self.kv_heads], 2)
        q, k = _rope(q), _rope(k)
        kw = dict(atten_mask=self.mask, sparse_mode=3, scale_value=self.dim ** -0.5)
        if self.variant == "alibi":
            kw.update(pse=self.slopes, pse_type=2)
        elif self.variant == "pse":
            kw.update(pse=self.pse.to(q.dtype), pse_type=1)
        elif self.variant == "dropout":
            kw.update(drop_mask=self.drop, keep_prob=0.9)
        if self.variant == "tnd":  # the batch is one packed row of documents [0, s/4) and [s/4, s)
            out = attngrad.flash_attention_score(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), self.heads,
                                                 "TND", actual_seq_qlen=self.cu, actual_seq_kvlen=self.cu, **kw)[0]
        else:
            out = attngrad.flash_attention_score(q, k, v, self.heads, "BSND", **kw)[0]
        return self.out(out.reshape(b, s, -1))


def _block_step(block, x):
    x = x.detach().clone().requires_grad_()
    y = block(x)
    y.float().square().mean().backward()
    grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    block.zero_grad(set_to_none=True)
    return [y, x.grad, *grads]


@pytest.mark.parametrize("variant", ["causal", "alibi", "pse", "dropout", "tnd"])
def test_compiled_attention_block_is_bitwise_eager(variant):
    """aot_eager runs the same aten ops as eager around attngrad's ops, so the whole step is bitwise equal."""
    torch._dynamo.reset()
    block = _AttentionBlock(variant)
    batch = 1 if variant == "tnd" else 2
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    x = torch.randn(batch, 32, 64)
    for got, want in zip(_block_step(compiled, x), _block_step(block, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inductor_attention_block_matches_eager():
    torch._dynamo.reset()
    block = _AttentionBlock("causal").to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    for got, want in zip(_block_step(compiled, x), _block_step(block, x)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_flash_attention_is_bitwise_eager(dynamic):
    torch._dynamo.reset()
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)

    def attention(q, k, v):
        return attngrad.flash_attention_score(q, k, v, 4, "BNSD", atten_mask=mask, sparse_mode=3,
                                             scale_value=0.25)[0]

    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic)
    for seq in (24, 40):
        q, k, v = (_rand(1, n, seq, 16, dtype=torch.bfloat16) for n in (4, 2, 2))

        def step(fn):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
            return [out, *(t.grad for t in leaves)]

        for got, want in zip(step(compiled), step(attention)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_export_attention_block():
    block = _AttentionBlock("tnd").eval()
    x = torch.randn(1, 32, 64)
    program = torch.export.export(block, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "attngrad.flash_attention_score.default" in targets
    torch.testing.assert_close(program.module()(x), block(x), rtol=0, atol=0)


def _attention_cases():
    """(name, dtype, query, key, value, dy, public keyword arguments) for opcheck: the layouts, GQA, Dv < D, masks,
    a dense pse with its gradient, generated alibi, dropout and TND."""
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    for dtype in DTYPES:
        q, k, v = _rand(2, 4, 16, 8, dtype=dtype), _rand(2, 2, 24, 8, dtype=dtype), _rand(2, 2, 24, 4, dtype=dtype)
        dy = _rand(2, 4, 16, 4, dtype=dtype)
        yield "BNSD gqa dv<d", dtype, q, k, v, dy, dict(head_num=4, input_layout="BNSD", scale_value=0.3)
        yield "BSH causal", dtype, *(t.transpose(1, 2).flatten(2) for t in (q, k[:, :, :16], v[:, :, :16], dy)), dict(
            head_num=4, input_layout="BSH", atten_mask=mask, sparse_mode=3)
        pse = _rand(1, 4, 16, 24, dtype=dtype)
        yield "pse dense", dtype, q, k, v, dy, dict(head_num=4, input_layout="BNSD", pse=pse, pse_type=1,
                                                   atten_mask=torch.rand(2, 1, 16, 24) > 0.8)
    q, k, v, dy = (_rand(1, 4, 32, 8) for _ in range(4))
    slopes = torch.rand(4)
    drop = torch.randint(0, 256, (4 * 32 * 32 // 8,), dtype=torch.uint8)
    yield "alibi + dropout", torch.float32, q, k, v, dy, dict(head_num=4, input_layout="BNSD", pse=slopes, pse_type=2,
                                                             keep_prob=0.9, drop_mask=drop)
    tq, tk, tv, tdy = (t[0].transpose(0, 1) for t in (q, k, v, dy))
    yield "TND", torch.float32, tq, tk, tv, tdy, dict(head_num=4, input_layout="TND", atten_mask=mask, sparse_mode=3,
                                                     actual_seq_qlen=torch.tensor([10, 32]),
                                                     actual_seq_kvlen=torch.tensor([12, 32]))


@pytest.mark.parametrize("case", list(_attention_cases()), ids=lambda c: f"{c[0]}-{c[1]}".replace("torch.", ""))
def test_opcheck_flash_attention(case):
    from attngrad.ops.flash_attention import score_grad_op_args, score_op_args
    from attngrad.ops.flash_attention_core import split_kwargs

    _, _, q, k, v, dy, kwargs = case
    leaves = [t.requires_grad_() for t in (q, k, v)]
    pse = kwargs.get("pse")
    if pse is not None and kwargs.get("pse_type") == 1:
        pse.requires_grad_()
    ops = torch.ops.attngrad
    opcheck(ops.flash_attention_score.default, score_op_args(*leaves, *split_kwargs(**kwargs)))
    with torch.no_grad():  # the grad op has no autograd formula of its own: no input may require grad
        out, smax, ssum = attngrad.flash_attention_score(*leaves, **kwargs)
    grad_kwargs = dict(kwargs, softmax_max=smax, softmax_sum=ssum, attention_in=out)
    if pse is not None:
        grad_kwargs["pse"] = pse.detach()
    opcheck(ops.flash_attention_score_grad.default,
            score_grad_op_args(*(t.detach() for t in leaves), dy, *split_kwargs(**grad_kwargs)))


def test_flash_attn_interface_compiles_without_recompiles():
    """flash_attn_func and flash_attn_varlen_func under fullgraph + dynamic: bitwise eager, and new cu_seqlens
    values (tensors) reuse the graph."""
    torch._dynamo.reset()

    def dense(q, k, v):
        return attngrad.flash_attn_func(q, k, v, causal=True, window_size=(8, -1))

    def packed(q, k, v, cu):
        return attngrad.flash_attn_varlen_func(q, k, v, cu, cu, 32, 32, causal=True)

    def grads(fn, *args):
        leaves = [t.detach().clone().requires_grad_() for t in args[:3]]
        out = fn(*leaves, *args[3:])
        out.backward(torch.ones_like(out))
        return [out, *(t.grad for t in leaves)]

    q, k, v = _rand(2, 24, 4, 16), _rand(2, 24, 2, 16), _rand(2, 24, 2, 16)
    tq, tk, tv = _rand(40, 4, 16), _rand(40, 2, 16), _rand(40, 2, 16)
    compiled_dense = torch.compile(dense, fullgraph=True, dynamic=True, backend="aot_eager")
    compiled_packed = torch.compile(packed, fullgraph=True, dynamic=True, backend="aot_eager")
    for got, want in zip(grads(compiled_dense, q, k, v), grads(dense, q, k, v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for step, cu in enumerate(([0, 10, 40], [0, 25, 40])):
        cu = torch.tensor(cu, dtype=torch.int32)
        with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
            got = grads(compiled_packed, tq, tk, tv, cu)
        for g, want in zip(got, grads(packed, tq, tk, tv, cu)):
            torch.testing.assert_close(g, want, rtol=0, atol=0)
