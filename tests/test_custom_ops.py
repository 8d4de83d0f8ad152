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


@pytest.mark.parametrize("case", ["float mask", "3-D segsum"])
def test_bad_input_under_compile_raises_the_eager_error(case):
    torch._dynamo.reset()
    if case == "float mask":
        fn, args = (lambda x, m: attngrad.scaled_masked_softmax(x, m, 0.5)), (_rand(1, 2, 4, 8), torch.zeros(1, 1, 4, 8))
    else:
        fn, args = attngrad.exp_segsum_backward, (_rand(2, 4, 4), _rand(2, 4, 4))
    expected = _eager_error(fn, *args)
    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
    found = aclnn_error_of(info.value)
    assert found is not None, f"no AclnnError in the chain of {type(info.value).__name__}: {info.value}"
    assert (found.status, str(found)) == (expected.status, str(expected))
