"""The cost of running attngrad's operators as torch.library custom ops, and what torch.compile makes of a model.

* call overhead: the public functions (custom op: schema parsing, dispatcher, fake-free eager kernel, autograd
  registration) against the contracts called directly (the path the public functions took before the custom
  ops), on tiny shapes where the kernels cost little: FlashAttentionScore B1 N1 S128 D64 bf16 and its grad,
  ScaledMaskedSoftmax [1, 1, 128, 128];
* a GQA causal attention block with RoPE (B1 S2048, 8 query heads, 2 kv heads, D64, bf16): one training step
  (forward + backward) eager against ``torch.compile(fullgraph=True)`` with inductor.
"""

from __future__ import annotations

import torch

import attngrad
from attngrad.bench import BenchCase
from attngrad.ops import scaled_masked_softmax as softmax_contract
from attngrad.ops.flash_attention import check_backward, check_forward, run_backward, run_forward
from attngrad.ops.flash_attention_core import split_kwargs

OPS = ("FlashAttentionScore", "FlashAttentionScoreGrad", "ScaledMaskedSoftmax", "AttentionBlock step")
_DIRECT = "direct contract call (no custom op)"


def _attention_overhead() -> list[BenchCase]:
    gen = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(1, 1, 128, 64, generator=gen).bfloat16() for _ in range(4))
    kw = dict(scale_value=0.125)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, 1, "BNSD", **kw)
    saved = dict(kw, softmax_max=smax, softmax_sum=ssum, attention_in=out)
    label = "B1 N1 S128 D64 BNSD (call overhead)"
    return [
        BenchCase(op="FlashAttentionScore", dtype=torch.bfloat16, label=label, roofline="none", impls={
            "attngrad (custom op)": lambda: attngrad.flash_attention_score(q, k, v, 1, "BNSD", **kw),
            _DIRECT: lambda: run_forward(check_forward(q, k, v, *split_kwargs(1, "BNSD", **kw)))}),
        BenchCase(op="FlashAttentionScoreGrad", dtype=torch.bfloat16, label=label, roofline="none", impls={
            "attngrad (custom op)": lambda: attngrad.flash_attention_score_grad(q, k, v, dy, 1, "BNSD", **saved),
            _DIRECT: lambda: run_backward(check_backward(q, k, v, dy, *split_kwargs(1, "BNSD", **saved)), False)}),
    ]


def _softmax_overhead() -> BenchCase:
    x = torch.randn(1, 1, 128, 128)
    mask = torch.ones(128, 128, dtype=torch.bool).triu(1).view(1, 1, 128, 128)
    return BenchCase(op="ScaledMaskedSoftmax", dtype=torch.float32, label="[1, 1, 128, 128] (call overhead)",
                     roofline="none", impls={
        "attngrad (custom op)": lambda: attngrad.scaled_masked_softmax(x, mask, 0.125),
        _DIRECT: lambda: softmax_contract.forward_kernel(*softmax_contract.check_forward(x, mask, 0.125))})


class AttentionBlock(torch.nn.Module):
    """Pre-norm GQA causal self-attention with RoPE and an output projection, on attngrad's flash attention."""

    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.norm = torch.nn.RMSNorm(width)
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * self.dim, bias=False)
        self.out = torch.nn.Linear(heads * self.dim, width, bias=False)
        self.register_buffer("causal", torch.ones(2048, 2048, dtype=torch.bool).triu(1), persistent=False)

    def rope(self, x):
        s, d = x.shape[1], x.shape[3]
        angle = torch.arange(s, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
        cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, -1, self.dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], 2)
        out = attngrad.flash_attention_score(self.rope(q), self.rope(k), v, self.heads, "BSND",
                                             atten_mask=self.causal, sparse_mode=3, scale_value=self.dim ** -0.5)[0]
        return x + self.out(out.reshape(b, s, -1))


def _block_step_case(seq: int) -> BenchCase:
    torch.manual_seed(0)
    block = AttentionBlock(512, 8, 2).to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(1, seq, 512, dtype=torch.bfloat16, requires_grad=True)

    def step(model):
        def run():
            model(x).float().square().mean().backward()
        return run

    return BenchCase(op="AttentionBlock step", dtype=torch.bfloat16, label=f"B1 S{seq} N8/2 D64 causal+RoPE",
                     roofline="none",
                     impls={"attngrad torch.compile(fullgraph)": step(compiled), "attngrad eager": step(block)},
                     notes="forward + backward of one block; compiled first in the warm-up call")


def cases(quick: bool = False) -> list[BenchCase]:
    return [*_attention_overhead(), _softmax_overhead(), _block_step_case(512 if quick else 2048)]
