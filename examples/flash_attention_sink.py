"""Attention with a learnable per-head sink (gpt-oss style) through the torch functions, trained for a few steps.

``sink`` float32 [N1] is one more logit of every row's softmax that carries no value: a head can put weight on
"nothing". B = 2, N1 = 4 query heads on N2 = 2 kv heads, S = 64, D = 32, bfloat16, causal (sparseMode 2). The
example checks the forward and dsink against plain float64 PyTorch (softmax over [scores, sink], sink column
dropped), then takes a few SGD steps on the sink alone and prints how the loss falls.
"""

import torch

import attngrad

B, N1, N2, S, D = 2, 4, 2, 64, 32


def plain_attention(q, k, v, sink, scale):
    """Float64 reference: softmax over [scores, sink] with the causal mask, the sink column dropped."""
    s = q.double() @ k.double().repeat_interleave(N1 // N2, 1).transpose(-1, -2) * scale
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([s, sink.double().view(1, N1, 1, 1).expand(B, N1, S, 1)], -1)
    return torch.softmax(full, -1)[..., :-1] @ v.double().repeat_interleave(N1 // N2, 1)


def main() -> int:
    torch.manual_seed(0)
    q = torch.randn(B, N1, S, D).bfloat16()
    k, v = (torch.randn(B, N2, S, D).bfloat16() for _ in range(2))
    target = torch.randn(B, N1, S, D)
    sink = torch.zeros(N1, requires_grad=True)
    causal = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    scale = D ** -0.5

    def loss_of(sink_logits):
        out, _, _ = attngrad.flash_attention_score(q, k, v, N1, "BNSD", scale_value=scale, atten_mask=causal,
                                                   sparse_mode=2, sink=sink_logits)
        return ((out.float() - target) ** 2).mean(), out

    loss, out = loss_of(sink)
    loss.backward()
    leaf = sink.detach().double().requires_grad_()
    ref = plain_attention(q, k, v, leaf, scale)
    ((ref - target.double()) ** 2).mean().backward()
    out_err = ((out.double() - ref).norm() / ref.norm()).item()
    dsink_err = ((sink.grad.double() - leaf.grad).norm() / leaf.grad.norm()).item()
    print(f"forward rel. error vs float64: {out_err:.2e}; dsink rel. error: {dsink_err:.2e}")
    print("dsink:", " ".join(f"{x:+.5f}" for x in sink.grad.tolist()))
    optimizer = torch.optim.SGD([sink], lr=20.0)
    for step in range(5):
        optimizer.zero_grad()
        loss, _ = loss_of(sink)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.5f}, sink " + " ".join(f"{x:+.3f}" for x in sink.tolist()))
    return 0 if out_err < 1.5e-2 and dsink_err < 1.5e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
