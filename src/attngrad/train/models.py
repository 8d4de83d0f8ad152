"""Two small language models whose core operator runs through attngrad or through plain PyTorch.

Each model class has one switch, ``impl``: ``"attngrad"`` or ``"torch"``; everything else (weights, data
path, initialisation) is shared, so a copy of a model with the other ``impl`` is its plain-PyTorch twin.

* :class:`Llama`: RMSNorm, rotary embeddings, grouped-query attention with smeared keys, SwiGLU MLP, tied
  embeddings. Attention is causal within each packed document. attngrad: one ``flash_attention_score`` call
  in TND layout (cumulative document ends, sparse mode 3 with the compressed [2048, 2048] causal mask);
  torch: ``scaled_dot_product_attention`` over the rows with a block-diagonal causal mask (the explicit
  softmax composition when dropout is on, since SDPA cannot take a given dropout mask).
* :class:`Mamba2`: Mamba2 blocks whose SSD chunk scan builds the intra-chunk and inter-chunk decay matrices
  with ``exp(segsum(a))``: attngrad's ``exp_segsum``, or the cumulative-sum composition in torch.

Inputs: a :class:`attngrad.train.tasks.Batch` (tokens ``[rows, seq]``); output: logits ``[rows, seq, vocab]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import attngrad

from .tasks import VOCAB, Batch

IMPLS = ("attngrad", "torch")
CAUSAL_MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)   # sparse mode 3's compressed mask (True = masked)
RESET_DECAY = 30.0   # Mamba2: log-decay subtracted at each document start (the state keeps exp(-30) of the past)


@dataclass
class LlamaConfig:
    dim: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 256          # SwiGLU inner width
    rope_base: float = 10000.0
    dropout: float = 0.0       # attention dropout probability (1 - keep_prob)
    alibi: bool = False        # add CANN's generated alibi (pseType 2, slopes 2^(-8 h / heads))
    smear_keys: bool = True    # mix each key with the previous token's key (see smear_keys)


@dataclass
class Mamba2Config:
    dim: int = 128
    layers: int = 2
    state: int = 16            # N: SSM state size (one B/C group shared by the heads)
    head_dim: int = 16         # P
    expand: int = 2            # inner width = expand * dim; heads = inner / head_dim
    conv: int = 4              # causal depthwise convolution width
    chunk: int = 64            # SSD chunk length; seq must be a multiple


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last axis, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


# ------------------------------------------------------------------------------------------------- llama
def rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate the two halves of each head of x ``[T, N, D]`` by the angles ``positions [T] * base^(-2i/D)``."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = positions.float()[:, None, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def alibi_slopes(heads: int) -> torch.Tensor:
    """fp32 ``[heads]``: the ALiBi slopes ``2^(-8 (h + 1) / heads)``."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)


def dropout_keep(batch: Batch, heads: int, keep_prob: float, seed: int) -> torch.Tensor:
    """bool keep flags of every in-document score, flat in TND dropout order: document after document (over
    all rows), each ``[heads, L, L]``; drawn from ``torch.Generator(seed)``."""
    count = heads * sum(n * n for row in batch.lengths for n in row)
    return torch.rand(count, generator=torch.Generator().manual_seed(seed)) < keep_prob


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """bool ``[n]`` -> uint8 ``[ceil(n / 8)]``, LSB first (the drop_mask format of FlashAttentionScore)."""
    bits = F.pad(keep, (0, -keep.numel() % 8)).view(-1, 8).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def dense_keep(batch: Batch, heads: int, keep: torch.Tensor) -> torch.Tensor:
    """The flat TND keep flags as bool ``[rows, heads, seq, seq]`` (False outside the documents)."""
    rows, seq = batch.shape
    dense = torch.zeros(rows, heads, seq, seq, dtype=torch.bool)
    start = 0
    for r, row in enumerate(batch.lengths):
        offset = 0
        for n in row:
            dense[r, :, offset:offset + n, offset:offset + n] = keep[start:start + heads * n * n].view(heads, n, n)
            start += heads * n * n
            offset += n
    return dense


def smear_keys(k: torch.Tensor, starts: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """Smeared keys: ``(1 - w) k_t + w k_{t-1}`` with ``w = sigmoid(logit)`` per key head; k ``[T, N, D]``,
    starts bool ``[T]`` (a document's first token has no previous key), logit ``[N, 1]``.

    A key then also says which token came before it, so one attention lookup finds "the token after x"
    (the induction step that associative recall needs) without first growing a previous-token head, which
    the small model did not do within thousands of steps (docs/training.md, 'The models').
    """
    previous = torch.cat([torch.zeros_like(k[:1]), k[:-1]]).masked_fill(starts[:, None, None], 0)
    w = torch.sigmoid(logit).to(k.dtype)
    return (1 - w) * k + w * previous


class Attention(nn.Module):
    """Grouped-query causal self-attention over packed documents (``heads`` query heads share ``kv_heads``),
    with smeared keys when ``cfg.smear_keys``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.smear = nn.Parameter(torch.zeros(cfg.kv_heads, 1)) if cfg.smear_keys else None

    def forward(self, x: torch.Tensor, batch: Batch, impl: str, keep: torch.Tensor | None) -> torch.Tensor:
        """x ``[T, dim]`` (T = rows * seq, TND order) -> ``[T, dim]``; keep: flat TND dropout keep flags."""
        cfg, d = self.cfg, self.head_dim
        positions = batch.positions.reshape(-1)
        q = rotary(self.q(x).view(-1, cfg.heads, d), positions, cfg.rope_base)
        k, v = self.kv(x).view(-1, 2, cfg.kv_heads, d).unbind(1)
        if self.smear is not None:
            k = smear_keys(k, batch.document_starts.reshape(-1), self.smear)
        k = rotary(k, positions, cfg.rope_base)
        attend = attngrad_attention if impl == "attngrad" else torch_attention
        slopes = alibi_slopes(cfg.heads) if cfg.alibi else None    # fp32 whatever the model's dtype
        out = attend(q, k, v.contiguous(), batch, slopes, keep, 1.0 - cfg.dropout)
        return self.o(out.reshape(x.shape[0], -1))


def attngrad_attention(q, k, v, batch: Batch, slopes, keep, keep_prob: float) -> torch.Tensor:
    """attngrad FlashAttentionScore in TND: q ``[T, N1, D]``, k / v ``[T, N2, D]`` -> ``[T, N1, D]``."""
    cum = batch.cumulative_lengths
    extra = {} if slopes is None else dict(pse=slopes, pse_type=2)
    if keep is not None:
        extra.update(drop_mask=pack_bits(keep), keep_prob=keep_prob)
    out, _, _ = attngrad.flash_attention_score(
        q, k, v, q.shape[1], "TND", actual_seq_qlen=cum, actual_seq_kvlen=cum, atten_mask=CAUSAL_MASK,
        sparse_mode=3, scale_value=1.0 / math.sqrt(q.shape[-1]), **extra)
    return out


def torch_attention(q, k, v, batch: Batch, slopes, keep, keep_prob: float) -> torch.Tensor:
    """The same attention with PyTorch operators on ``[rows, N, seq, D]`` and a block-diagonal causal mask."""
    rows, seq = batch.shape
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    q, k, v = (t.view(rows, seq, t.shape[1], -1).transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = batch.causal_mask
    if slopes is not None or keep is not None:
        i = torch.arange(seq)
        bias = torch.zeros(heads, seq, seq) if slopes is None else -slopes[:, None, None] * (i[None] - i[:, None]).abs()
        mask = bias.masked_fill(~mask, float("-inf")).to(q.dtype)
    if keep is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        probs = torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1)
        out = (probs * dense_keep(batch, heads, keep).to(q.dtype) / keep_prob) @ v
    return out.transpose(1, 2).reshape(rows * seq, heads, -1)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x, batch: Batch, impl: str, keep) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), batch, impl, keep)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only LLaMA-style model over packed documents; ``impl`` selects the attention operator.

    ``forward(batch, dropout_seed)``: dropout (cfg.dropout > 0, training mode only) draws layer l's keep
    flags from ``dropout_seed + l``, the same flags for both implementations.
    """

    def __init__(self, cfg: LlamaConfig, impl: str = "attngrad"):
        super().__init__()
        self.cfg, self.impl = cfg, _check_impl(impl)
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        nn.init.normal_(self.embed.weight, std=cfg.dim ** -0.5)

    def forward(self, batch: Batch, dropout_seed: int = 0) -> torch.Tensor:
        rows, seq = batch.shape
        x = self.embed(batch.tokens.reshape(-1))
        for layer, block in enumerate(self.blocks):
            keep = None
            if self.training and self.cfg.dropout > 0:
                keep = dropout_keep(batch, self.cfg.heads, 1.0 - self.cfg.dropout, dropout_seed + layer)
            x = block(x, batch, self.impl, keep)
        return (self.norm(x) @ self.embed.weight.T).view(rows, seq, -1)


# ------------------------------------------------------------------------------------------------ mamba2
def torch_exp_segsum(x: torch.Tensor) -> torch.Tensor:
    """``exp(segsum(x))`` composed of PyTorch operators: x ``(..., T)`` -> ``(..., T, T)`` with
    ``out[i, j] = exp(x[j+1] + ... + x[i])`` for ``j <= i`` and 0 above the diagonal; sums and exp in fp32
    (as attngrad's ExpSegsum), result in x's dtype."""
    t = x.shape[-1]
    below = torch.ones(t, t, dtype=torch.bool).tril(-1)
    terms = x.float()[..., :, None].expand(*x.shape, t).masked_fill(~below, 0)   # [d, j] = x[d] for d > j
    sums = terms.cumsum(-2).masked_fill(~below.logical_or(torch.eye(t, dtype=torch.bool)), float("-inf"))
    return sums.exp().to(x.dtype)


def ssd_chunk_scan(x, a, b, c, chunk: int, exp_segsum) -> torch.Tensor:
    """The SSD recurrence ``h_t = exp(a_t) h_{t-1} + x_t b_t^T``, ``y_t = h_t c_t`` by chunks (h_0 = 0).

    x ``[R, S, H, P]``, a ``[R, S, H]`` (log decays, <= 0), b / c ``[R, S, N]`` (shared by the heads) ->
    y ``[R, S, H, P]``. Inside a chunk y is a masked matmul with the decay matrix ``exp_segsum(a)``; chunk
    states are carried across chunks with ``exp_segsum`` of the chunks' total decays.
    """
    rows, seq, heads, p = x.shape
    n = seq // chunk
    x = x.reshape(rows, n, chunk, heads, p)
    b, c = b.reshape(rows, n, chunk, -1), c.reshape(rows, n, chunk, -1)
    a = a.reshape(rows, n, chunk, heads).permute(0, 3, 1, 2)              # [R, H, n, L]
    a_cum = a.cumsum(-1)
    decay = exp_segsum(a)                                                   # [R, H, n, L, L]
    y_diag = torch.einsum("rcln,rcsn,rhcls,rcshp->rclhp", c, b, decay, x)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                             # decay from each step to chunk end
    states = torch.einsum("rcln,rhcl,rclhp->rchpn", b, to_end, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
    across = exp_segsum(F.pad(a_cum[..., -1], (1, 0)))                      # [R, H, n + 1, n + 1]
    states = torch.einsum("rhzc,rchpn->rzhpn", across, states)[:, :-1]      # state entering each chunk
    y_off = torch.einsum("rcln,rchpn,rhcl->rclhp", c, states, torch.exp(a_cum))
    return (y_diag + y_off).reshape(rows, seq, heads, p)


class Mamba2Block(nn.Module):
    """Mamba2 mixer: in-projection, causal depthwise conv, SSD scan, gated RMSNorm, out-projection."""

    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        inner = cfg.expand * cfg.dim
        self.heads = inner // cfg.head_dim
        self.conv_width = inner + 2 * cfg.state
        self.in_proj = nn.Linear(cfg.dim, inner + self.conv_width + self.heads, bias=False)
        self.conv = nn.Conv1d(self.conv_width, self.conv_width, cfg.conv, groups=self.conv_width,
                              padding=cfg.conv - 1)
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.linspace(1e-3, 1e-1, self.heads))))
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, self.heads)))
        self.skip = nn.Parameter(torch.ones(self.heads))
        self.norm = RMSNorm(inner)
        self.out_proj = nn.Linear(inner, cfg.dim, bias=False)

    def forward(self, u: torch.Tensor, starts: torch.Tensor, impl: str) -> torch.Tensor:
        """u ``[R, S, dim]``, starts bool ``[R, S]`` (document starts reset the state) -> ``[R, S, dim]``."""
        cfg, seq = self.cfg, u.shape[1]
        inner = cfg.expand * cfg.dim
        z, xbc, dt = self.in_proj(u).split([inner, self.conv_width, self.heads], -1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :seq].transpose(1, 2))
        x, b, c = xbc.split([inner, cfg.state, cfg.state], -1)
        dt = F.softplus(dt + self.dt_bias)
        a = dt * -torch.exp(self.a_log) - RESET_DECAY * starts[..., None].to(dt.dtype)
        x = x.reshape(*x.shape[:2], self.heads, cfg.head_dim)
        segsum = attngrad.exp_segsum if impl == "attngrad" else torch_exp_segsum
        y = ssd_chunk_scan(x * dt[..., None], a, b, c, cfg.chunk, segsum) + x * self.skip[:, None]
        return self.out_proj(self.norm(y.reshape(*u.shape[:2], inner) * F.silu(z)))


class Mamba2(nn.Module):
    """Residual stack of RMSNorm + Mamba2 mixer with tied embeddings; ``impl`` selects exp(segsum)."""

    def __init__(self, cfg: Mamba2Config, impl: str = "attngrad"):
        super().__init__()
        self.cfg, self.impl = cfg, _check_impl(impl)
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.norms = nn.ModuleList(RMSNorm(cfg.dim) for _ in range(cfg.layers))
        self.blocks = nn.ModuleList(Mamba2Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        nn.init.normal_(self.embed.weight, std=cfg.dim ** -0.5)

    def forward(self, batch: Batch, dropout_seed: int = 0) -> torch.Tensor:
        if batch.shape[1] % self.cfg.chunk:
            raise ValueError(f"Mamba2: seq ({batch.shape[1]}) must be a multiple of the chunk ({self.cfg.chunk})")
        x = self.embed(batch.tokens)
        starts = batch.document_starts
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x), starts, self.impl)
        return self.norm(x) @ self.embed.weight.T
