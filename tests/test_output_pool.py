"""The output pool behind large kernel outputs: blocks come back when their tensors die, live views keep them,
the pool keeps at most its limit, and a pooled output through the public functions equals an unpooled one."""

from __future__ import annotations

import gc

import pytest
import torch

import attngrad
from attngrad.kernels import tensor_view
from attngrad.kernels.tensor_view import OutputPool, new_output, output_pool

BIG = (8, 512, 1024)  # 8 MiB in bfloat16


def test_freed_block_is_reused():
    a = new_output(BIG, torch.bfloat16)
    assert (a.shape, a.dtype, a._base, a.is_contiguous()) == (BIG, torch.bfloat16, None, True)
    assert a.data_ptr() % (2 << 20) == 0
    address = a.data_ptr()
    del a
    b = new_output(BIG, torch.bfloat16)
    assert b.data_ptr() == address
    c = new_output((4, 1024, 1024), torch.float32)  # same block size, other shape and dtype: a block of its own
    assert c.data_ptr() != address


def test_outputs_from_one_mib_up_are_pooled(monkeypatch):
    """From 1 MiB up an output comes from the pool and goes back to it; smaller ones are torch's own."""
    monkeypatch.setattr(output_pool, "limit", 1 << 40)  # no block released while this test counts them
    small = new_output(((1 << 20) - 1,), torch.uint8)
    before = output_pool.free_bytes
    del small
    assert output_pool.free_bytes == before
    pooled = new_output((1 << 18,), torch.float32)
    assert pooled.data_ptr() % (2 << 20) == 0
    before = output_pool.free_bytes  # it may have taken a free block
    del pooled
    assert output_pool.free_bytes == before + (2 << 20)


def test_live_view_keeps_the_block():
    a = new_output(BIG, torch.float32)
    address = a.data_ptr()
    view = a[1:]
    del a
    gc.collect()
    assert new_output(BIG, torch.float32).data_ptr() != address
    del view
    assert new_output(BIG, torch.float32).data_ptr() == address


def test_limit_releases_the_oldest_block():
    pool = OutputPool(limit=16 << 20)
    first, second = pool.tensor((8 << 20,), torch.uint8), pool.tensor((16 << 20,), torch.uint8)
    del first
    assert pool.free_bytes == 8 << 20
    del second  # 24 MiB free: over the limit, so the oldest (first) is released
    assert pool.free_bytes == 16 << 20
    third = pool.tensor((8 << 20,), torch.uint8)  # a new block: the 8 MiB one is gone, the 16 MiB one stays
    assert pool.free_bytes == 16 << 20
    del third
    assert pool.free_bytes == 8 << 20  # 24 MiB again: the 16 MiB block, now the oldest, is released
    pool.clear()
    assert pool.free_bytes == 0


def test_pool_size_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNGRAD_OUTPUT_POOL_MB", "0")
    assert tensor_view._pool_limit() == 0
    monkeypatch.setenv("ATTNGRAD_OUTPUT_POOL_MB", "lots")
    with pytest.raises(ValueError, match="ATTNGRAD_OUTPUT_POOL_MB"):
        tensor_view._pool_limit()


def test_pooled_softmax_equals_unpooled(monkeypatch):
    x = torch.randn(2, 4, 512, 1024, generator=torch.Generator().manual_seed(0)).requires_grad_()
    mask = torch.rand(2, 1, 512, 1024, generator=torch.Generator().manual_seed(1)) < 0.2
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))

    def run():
        y = attngrad.scaled_masked_softmax(x, mask, 0.5)
        (dx,) = torch.autograd.grad(y, x, dy)
        return y.detach(), dx

    y, dx = run()
    pooled = y.data_ptr()
    del y
    y_again, dx_again = run()
    assert y_again.data_ptr() == pooled  # the freed output's block served the next call
    monkeypatch.setattr(output_pool, "limit", 0)
    y_plain, dx_plain = run()
    assert torch.equal(y_again, y_plain) and torch.equal(dx_again, dx_plain)
    assert torch.equal(dx, dx_plain)


def test_flash_attention_outputs_are_pooled(monkeypatch):
    """The forward's output and the grads (1 MiB each here) come from the pool and go back to it when freed, and
    the results equal those on torch's own memory."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(1, 4, 1024, 128, generator=gen).to(torch.bfloat16) for _ in range(4))

    def run():
        out, smax, ssum = attngrad.flash_attention_score(q, k, v, 4, "BNSD", scale_value=0.1)
        grads = attngrad.flash_attention_score_grad(q, k, v, dy, 4, "BNSD", scale_value=0.1, softmax_max=smax,
                                                     softmax_sum=ssum, attention_in=out)
        return out, grads[:3]

    monkeypatch.setattr(output_pool, "limit", 1 << 40)  # no block released while this test counts them
    out, grads = run()
    assert all(t.data_ptr() % (2 << 20) == 0 for t in (out, *grads))
    before = output_pool.free_bytes
    expected = (out.detach().clone(), *(g.clone() for g in grads))
    del out, grads
    assert output_pool.free_bytes == before + 4 * (2 << 20)  # the four 1 MiB outputs' blocks went back
    monkeypatch.setattr(output_pool, "limit", 0)
    out_plain, grads_plain = run()
    assert all(torch.equal(a, b) for a, b in zip(expected, (out_plain, *grads_plain)))
