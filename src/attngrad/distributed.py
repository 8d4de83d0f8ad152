"""Context parallelism for FlashAttentionScore: exact ring attention over ``torch.distributed``.

The sequence axis of query, key and value is sharded over the ranks of a process group. Each rank keeps
its query shard; the K/V shards travel around the ring (rank r sends to r + 1, receives from r - 1) while
the block at hand is computed, and the partial results are merged with the online-softmax rule in float32,
so the output and the statistics equal the unsharded call's. The backward runs a second ring with the
global statistics and output; dQ stays local, dK/dV travel with their block back to its owner. In the golden
precision mode the blocks run on float32 copies of the inputs, so the merged output, which the backward's
``D = rowsum(dy * out)`` reads, is rounded only once, at the end.

Shards (:func:`zigzag_shard`): with ``zigzag`` the sequence is cut into ``2 * cp`` equal chunks and rank r
holds chunks r and ``2*cp - 1 - r`` (every rank gets the same causal work); otherwise rank r holds chunk r
of ``cp``. Dropout masks and alibi positions are those of the unsharded call, so results do not depend on
the number of ranks. Rules, limits and failure modes: docs/context-parallel.md.
"""

from __future__ import annotations

import datetime
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from . import flash_attention_score, flash_attention_score_grad
from .kernels.dropout import generate_drop_mask
from .precision_mode import GOLDEN, current_precision, precision_mode
from .validation import (check_choice, check_float, check_int, check_int_list, check_range, check_rank, invalid,
                         require_tensor)

OP = "ring_flash_attention"
SEQ_DIM = {"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}   # the sequence axis of each layout
STATS_COPIES = 8                                        # softmax_max / softmax_sum: [B, N1, S, 8]
CAUSAL_SPARSE_MODE = 3                                  # right-down causal; equals left-up when Sq == Skv
PASSED_THROUGH = ("pse", "pse_type", "q_start_idx", "kv_start_idx", "inner_precise")
ALIBI_PSE_TYPES = (2, 3)                                # generated alibi: shardable by start indices
CALL_PARTS = 2                                          # flash attention calls per shard piece (call_pieces)


class RingCommunicationError(RuntimeError):
    """A peer of the ring did not send or receive in time (it died, hung or stopped calling)."""


# ------------------------------------------------------------------------------------------------ ring
@dataclass(frozen=True)
class Ring:
    """This rank's place in the context-parallel group and the wait limit of its transfers."""

    group: object
    rank: int
    size: int
    timeout: datetime.timedelta | None

    def peer(self, shift: int) -> int:
        """The global rank of group rank ``rank + shift`` (mod size): what isend / irecv address."""
        return dist.get_global_rank(self.group, (self.rank + shift) % self.size)


def _ring(group, timeout) -> Ring:
    group = group or dist.group.WORLD
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=check_float(OP, "timeout", timeout))
    return Ring(group, dist.get_rank(group), dist.get_world_size(group), timeout)


class _Transfer:
    """One ring hop of ``tensors`` (to rank + 1, from rank - 1) started with ``dist.batch_isend_irecv``;
    :meth:`wait` returns the received tensors or raises :class:`RingCommunicationError` after the timeout."""

    def __init__(self, ring: Ring, tensors, what: str):
        self.ring = ring
        sends = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in sends]
        nxt, prev = ring.peer(1), ring.peer(-1)
        ops = [dist.P2POp(dist.isend, t, nxt, ring.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, prev, ring.group) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)
        self.routes = [f"send {what} to rank {nxt}"] * len(sends) + [f"receive {what} from rank {prev}"] * len(sends)

    def wait(self) -> list[torch.Tensor]:
        limit = self.ring.timeout
        for work, route in zip(self.works, self.routes):
            try:
                work.wait(limit) if limit is not None else work.wait()
            except RuntimeError as exc:
                within = f" within {limit.total_seconds():g} s" if limit is not None else ""
                raise RingCommunicationError(
                    f"{OP}: rank {dist.get_rank()} could not {route}{within}: a rank of the context-parallel "
                    f"group exited, hung or stopped calling {OP} ({exc})") from exc
        return self.received


# ------------------------------------------------------------------------------------ shard geometry
def shard_pieces(rank: int, size: int, length: int, zigzag: bool) -> tuple[tuple[int, int], ...]:
    """``(global start, length)`` of the sequence pieces that ``rank`` holds, in local order, for a local
    shard of ``length`` positions: zigzag chunks r and 2*size-1-r, else chunk r."""
    if zigzag:
        half = length // 2
        return (rank * half, half), ((2 * size - 1 - rank) * half, half)
    return ((rank * length, length),)


def _group_position(group) -> tuple[int, int]:
    group = group or dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group)


def _chunk(op: str, x: torch.Tensor, seq_dim: int, chunks: int) -> int:
    seq_dim = check_int(op, "seq_dim", seq_dim)
    check_choice(op, "seq_dim", seq_dim, range(-x.dim(), x.dim()))
    if x.shape[seq_dim] % chunks:
        raise invalid(op, "x", f"sequence axis {seq_dim} must be a multiple of {chunks} (chunks)", list(x.shape))
    return x.shape[seq_dim] // chunks


def zigzag_shard(x: torch.Tensor, seq_dim: int, group=None, zigzag: bool = True) -> torch.Tensor:
    """This rank's shard of the full sequence ``x``: chunks r and 2*cp-1-r of 2*cp (``zigzag``, for causal
    load balance) or chunk r of cp (contiguous, for non-causal attention); a new tensor, differentiable."""
    rank, size = _group_position(group)
    chunk = _chunk("zigzag_shard", x, seq_dim, 2 * size if zigzag else size)
    pieces = shard_pieces(rank, size, chunk * (2 if zigzag else 1), zigzag)
    return torch.cat([x.narrow(seq_dim, start, length) for start, length in pieces], seq_dim)


def zigzag_unshard(x: torch.Tensor, seq_dim: int, group=None, zigzag: bool = True) -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (the inverse of :func:`zigzag_shard`, an all_gather;
    not differentiable)."""
    size = _group_position(group)[1]
    _chunk("zigzag_unshard", x, seq_dim, 2 if zigzag else 1)
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    length = x.shape[seq_dim]
    placed = sorted(((start, shard.narrow(seq_dim, local, piece))
                     for r, shard in enumerate(shards)
                     for local, (start, piece) in zip((0, length // 2), shard_pieces(r, size, length, zigzag))),
                    key=lambda pair: pair[0])
    return torch.cat([piece for _, piece in placed], seq_dim)


# ------------------------------------------------------------------------------------------ metadata
INPUTS = ("query", "key", "value")


def _describe(name: str, value) -> str:
    """A rank-comparable description: tensors by dtype and shape; attribute tensors (alibi slopes) with
    their values when small."""
    if isinstance(value, torch.Tensor):
        values = f" {value.detach().flatten().tolist()}" if name not in INPUTS and value.numel() <= 1024 else ""
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}{values}"
    return repr(value)


_AGREED: set = set()   # (group, metadata) pairs already checked by an all_gather


def check_same_on_all_ranks(ring: Ring, metadata: dict) -> None:
    """All ranks must pass the same shapes, dtypes and attributes: the first call with given metadata
    all-gathers it once (later calls with the same metadata skip it); a difference raises the same
    161002 AclnnError on every rank, naming the parameter and each rank's value."""
    described = tuple((name, _describe(name, value)) for name, value in metadata.items())
    key = (id(ring.group), described)
    if ring.size == 1 or key in _AGREED:
        return
    gathered = [None] * ring.size
    try:
        dist.all_gather_object(gathered, described, group=ring.group)
    except RuntimeError as exc:
        raise RingCommunicationError(f"{OP}: rank {dist.get_rank()} could not exchange the call's metadata with "
                                     f"the context-parallel group: a rank exited or hung ({exc})") from exc
    names = list(dict.fromkeys(name for ranks in gathered for name, _ in ranks))
    for name in names:
        values = [dict(ranks).get(name, "absent") for ranks in gathered]
        if len(set(values)) > 1:
            raise invalid(OP, name, "must be the same on every rank of the context-parallel group",
                          "; ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    _AGREED.add(key)


# -------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Config:
    """The validated attributes of one ring call; ``seq_len`` is the global S, ``local_len`` this shard's."""

    head_num: int
    layout: str
    causal: bool
    zigzag: bool
    scale: float
    keep_prob: float
    seed: int
    offset: int
    inner_precise: int
    pse: torch.Tensor | None
    pse_type: int
    q_start: int
    kv_start: int
    local_len: int
    seq_len: int
    batch_heads: int   # B * N1
    precision: str     # the precision mode of the call, kept for its backward

    @property
    def seq_dim(self) -> int:
        return SEQ_DIM[self.layout]


def _start(name: str, values) -> int:
    """q_start_idx / kv_start_idx: the global start (one integer, absent = 0) that each block shifts."""
    values = check_int_list(OP, name, values)
    return values[0] if values else 0


def _check_cann_kwargs(kwargs: dict) -> None:
    for name in kwargs:
        if name not in PASSED_THROUGH:
            raise invalid(OP, name, f"is not supported by ring attention (supported: causal=, dropout, "
                          f"{', '.join(PASSED_THROUGH)})", repr(kwargs[name])[:60])
    if kwargs.get("pse") is not None and kwargs.get("pse_type", 1) not in ALIBI_PSE_TYPES:
        raise invalid(OP, "pse_type", "must be 2 or 3 (generated alibi slopes) when pse is given: a pse tensor "
                      "over [Sq, Skv] cannot be sharded along the ring", kwargs.get("pse_type", 1))


def make_config(ring: Ring, qkv: tuple, head_num, input_layout, causal, scale_value, keep_prob, seed, offset, zigzag,
                kwargs) -> Config:
    """Ring-specific checks (the operator's own checks run in the first block call, identically on every
    rank since the metadata agree): layout, one sequence length for ``qkv`` = (query, key, value), shard
    divisibility, attributes."""
    query, key, value = qkv
    check_choice(OP, "input_layout", input_layout, tuple(SEQ_DIM))
    _check_cann_kwargs(kwargs)
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_tensor(OP, name, t)
        check_rank(OP, name, t, (3 if input_layout in ("BSH", "SBH") else 4,))
    keep_prob = check_float(OP, "keep_prob", keep_prob)
    check_range(OP, "keep_prob", keep_prob, 0.0, 1.0, low_open=True)
    seq_dim = SEQ_DIM[input_layout]
    local = query.shape[seq_dim]
    for name, t in (("key", key), ("value", value)):
        if t.shape[seq_dim] != local:
            raise invalid(OP, name, f"sequence axis must equal query's {local} (one sequence is sharded)",
                          list(t.shape))
    if local == 0 or (zigzag and local % 2):
        raise invalid(OP, "query", "local sequence length must be > 0 (and even for zigzag shards)", local)
    head_num = check_int(OP, "head_num", head_num)
    if head_num <= 0 or (input_layout in ("BSH", "SBH") and query.shape[2] % head_num):
        raise invalid(OP, "head_num", f"must be > 0 and divide query's hidden size {query.shape[-1]}", head_num)
    d = query.shape[-1] // head_num if input_layout in ("BSH", "SBH") else query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale_value is None else check_float(OP, "scale_value", scale_value)
    batch = query.shape[1] if input_layout == "SBH" else query.shape[0]
    return Config(head_num=head_num, layout=input_layout, causal=bool(causal), zigzag=bool(zigzag), scale=scale,
                  keep_prob=keep_prob, seed=check_int(OP, "seed", seed), offset=check_int(OP, "offset", offset),
                  inner_precise=kwargs.get("inner_precise", 0), pse=kwargs.get("pse"),
                  pse_type=kwargs.get("pse_type", 1), q_start=_start("q_start_idx", kwargs.get("q_start_idx")),
                  kv_start=_start("kv_start_idx", kwargs.get("kv_start_idx")), local_len=local,
                  seq_len=local * ring.size, batch_heads=batch * head_num, precision=current_precision())


# -------------------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Block:
    """One flash-attention call of a ring step: local query rows ``[rows)`` against the held K/V rows
    ``[cols)``; ``causal`` on the diagonal; the ``(global start, length)`` pieces they are (for dropout and
    alibi)."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    causal: bool
    q_piece: tuple[int, int]
    kv_piece: tuple[int, int]


def _visible(q_piece, kv_piece, causal: bool) -> str | None:
    """How a query part sees a K/V part: 'full', 'causal' (the same positions) or None (all future).
    Parts have one length and start on its multiples, so they coincide or are disjoint."""
    if not causal or kv_piece[0] < q_piece[0]:
        return "full"
    return "causal" if kv_piece[0] == q_piece[0] else None


def call_pieces(rank: int, size: int, length: int, zigzag: bool) -> list[tuple[int, tuple[int, int]]]:
    """``(local start, (global start, length))`` of the row ranges that one call covers: each shard piece cut
    into :data:`CALL_PARTS` equal parts when its length divides (else whole). Smaller calls mean smaller
    transient copies (a call copies its rows of q, k, v, dy and out, and allocates its gradients)."""
    calls, local = [], 0
    for start, piece in shard_pieces(rank, size, length, zigzag):
        parts = CALL_PARTS if piece % CALL_PARTS == 0 else 1
        part = piece // parts
        calls += [(local + i * part, (start + i * part, part)) for i in range(parts)]
        local += piece
    return calls


def step_blocks(cfg: Config, rank: int, src: int, size: int) -> list[Block]:
    """The calls of the step where ``rank`` holds the K/V shard of ``src``: one per visible pair of query and
    K/V parts (:func:`call_pieces`). Parts are contiguous in global positions and of one length, as alibi
    needs (Sq == Skv)."""
    q_calls = call_pieces(rank, size, cfg.local_len, cfg.zigzag)
    kv_calls = call_pieces(src, size, cfg.local_len, cfg.zigzag)
    return [Block((qi, qi + qp[1]), (kj, kj + kp[1]), kind == "causal", qp, kp)
            for qi, qp in q_calls for kj, kp in kv_calls if (kind := _visible(qp, kp, cfg.causal))]


@functools.lru_cache(maxsize=1)
def _causal_mask() -> torch.Tensor:
    """The compressed [2048, 2048] mask that sparse mode 3 takes (its content is the standard pattern);
    built once, never written."""
    return torch.ones(2048, 2048, dtype=torch.bool).triu_(1)


def block_drop_mask(cfg: Config, block: Block, batch_heads: int) -> torch.Tensor:
    """The block's packed keep mask: block bit ``((b*N1 + n)*rows + i)*cols + j`` is bit
    ``((b*N1 + n)*S + gi)*S + gj`` of the mask the unsharded call draws from (seed, offset), where gi, gj
    are the global positions of row i and column j. The generator is counter-based: the block's global
    rows are drawn directly and its columns selected."""
    s = cfg.seq_len
    (q0, rows), (k0, cols) = block.q_piece, block.kv_piece
    bits = []
    for bn in range(batch_heads):
        packed = generate_drop_mask(cfg.seed, cfg.offset + (bn * s + q0) * s, rows * s, cfg.keep_prob).numpy()
        bits.append(np.unpackbits(packed, bitorder="little")[:rows * s].reshape(rows, s)[:, k0:k0 + cols].ravel())
    return torch.from_numpy(np.packbits(np.concatenate(bits), bitorder="little"))


def block_kwargs(cfg: Config, block: Block, batch_heads: int) -> dict:
    """The attngrad attributes of one block call (shared by forward and grad)."""
    kwargs = dict(scale_value=cfg.scale, keep_prob=cfg.keep_prob, inner_precise=cfg.inner_precise)
    if block.causal:
        kwargs.update(atten_mask=_causal_mask(), sparse_mode=CAUSAL_SPARSE_MODE)
    if cfg.pse is not None:
        kwargs.update(pse=cfg.pse, pse_type=cfg.pse_type, q_start_idx=[cfg.q_start + block.q_piece[0]],
                      kv_start_idx=[cfg.kv_start + block.kv_piece[0]])
    if cfg.keep_prob < 1:
        kwargs["drop_mask"] = block_drop_mask(cfg, block, batch_heads)
    return kwargs


# ------------------------------------------------------------------------------------------- merging
def _heads_view(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A 4-D view with the heads split out (BSH/SBH: H -> (N, D)); the sequence axis stays SEQ_DIM."""
    return t.unflatten(2, (heads, t.shape[2] // heads)) if layout in ("BSH", "SBH") else t


def _stats_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N1, S] statistics arranged to broadcast against :func:`_heads_view` of an output."""
    order = {"BNSD": (0, 1, 2), "BSND": (0, 2, 1), "BSH": (0, 2, 1), "SBH": (2, 0, 1)}[layout]
    return t.permute(order).unsqueeze(-1)


class OnlineSoftmax:
    """float32 accumulator of a rank's output rows and their running row max / row sum (the statistics of
    CANN: ``max`` of the scaled logits, ``sum`` of ``exp(logit - max)``). Merging a block with (out_b,
    m_b, s_b) over rows R: ``m = max(m, m_b)``, ``s' = s e^(m_old - m) + s_b e^(m_b - m)``,
    ``out = (out s e^(m_old - m) + out_b s_b e^(m_b - m)) / s'``."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = self.max = self.sum = None   # shaped by the first block

    def _allocate(self, out: torch.Tensor, m: torch.Tensor) -> None:
        shape = list(out.shape)
        shape[self.cfg.seq_dim] = self.cfg.local_len
        self.out = _heads_view(torch.zeros(shape, dtype=torch.float32), self.cfg.layout, self.cfg.head_num)
        stats = (*m.shape[:2], self.cfg.local_len)
        self.max = torch.full(stats, -math.inf, dtype=torch.float32)
        self.sum = torch.zeros(stats, dtype=torch.float32)

    def merge(self, rows: tuple[int, int], out: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> None:
        if self.out is None:
            self._allocate(out, m)
        lo, n = rows[0], rows[1] - rows[0]
        old_max, old_sum = self.max[:, :, lo:lo + n], self.sum[:, :, lo:lo + n]
        new_max = torch.maximum(old_max, m[..., 0])
        kept, added = old_sum * torch.exp(old_max - new_max), s[..., 0] * torch.exp(m[..., 0] - new_max)
        new_sum = kept + added
        layout, heads = self.cfg.layout, self.cfg.head_num
        acc = self.out.narrow(self.cfg.seq_dim, lo, n)
        acc.mul_(_stats_view(kept / new_sum, layout))
        acc.add_(_heads_view(out, layout, heads).float() * _stats_view(added / new_sum, layout))
        old_max.copy_(new_max)
        old_sum.copy_(new_sum)

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(out in the layout and dtype, softmax_max, softmax_sum [B, N1, S_local, 8] float32)``."""
        out = self.out.to(dtype)
        out = out.flatten(2) if self.cfg.layout in ("BSH", "SBH") else out
        copies = [t.unsqueeze(-1).expand(*t.shape, STATS_COPIES).contiguous() for t in (self.max, self.sum)]
        return out.contiguous(), *copies


# ------------------------------------------------------------------------------------------ the rings
def _rows(t: torch.Tensor, cfg: Config, span: tuple[int, int]) -> torch.Tensor:
    return t.narrow(cfg.seq_dim, span[0], span[1] - span[0])


def _operands(cfg: Config, *tensors) -> tuple:
    """The tensors the blocks compute on: float32 copies in the golden mode (module docstring), else as given."""
    return tuple(t.float() for t in tensors) if cfg.precision == GOLDEN else tensors


def ring_forward(cfg: Config, ring: Ring, query, key, value):
    """The forward ring: cp steps; step t computes against the K/V of rank ``rank - t`` while the hop to
    step t + 1 is in flight. Returns ``(out, softmax_max, softmax_sum)`` of this rank's rows, out in the dtype
    of the blocks' operands (:func:`_operands`)."""
    query, key, value = _operands(cfg, query, key, value)
    acc = OnlineSoftmax(cfg)
    kv = (key, value)
    for step in range(ring.size):
        hop = _Transfer(ring, kv, f"K/V (forward step {step})") if step < ring.size - 1 else None
        for block in step_blocks(cfg, ring.rank, (ring.rank - step) % ring.size, ring.size):
            out, m, s = flash_attention_score(_rows(query, cfg, block.rows), _rows(kv[0], cfg, block.cols),
                                              _rows(kv[1], cfg, block.cols), cfg.head_num, cfg.layout,
                                              **block_kwargs(cfg, block, cfg.batch_heads))
            acc.merge(block.rows, out, m, s)
        if hop is not None:
            kv = hop.wait()
    return acc.result(query.dtype)


def _block_grads(cfg: Config, block: Block, query, kv, dy, out, softmax_max, softmax_sum) -> tuple:
    """``(dq, dk, dv)`` of one block from the global statistics and output of its rows."""
    lo, hi = block.rows
    return flash_attention_score_grad(
        _rows(query, cfg, block.rows), _rows(kv[0], cfg, block.cols), _rows(kv[1], cfg, block.cols),
        _rows(dy, cfg, block.rows), cfg.head_num, cfg.layout, softmax_max=softmax_max[:, :, lo:hi],
        softmax_sum=softmax_sum[:, :, lo:hi], attention_in=_rows(out, cfg, block.rows),
        **block_kwargs(cfg, block, cfg.batch_heads))[:3]


def ring_backward(cfg: Config, ring: Ring, query, key, value, out, softmax_max, softmax_sum, dy):
    """The backward ring: each block's grad uses the global statistics and output (as :func:`ring_forward`
    returned it); dQ accumulates here in float32, the float32 dK/dV accumulator of each K/V shard travels with it
    and after cp hops is home. The accumulator of the held shard arrives while the step's first block is
    computed."""
    dtypes = query.dtype, key.dtype, value.dtype
    query, key, value, dy = _operands(cfg, query, key, value, dy)
    dq = torch.zeros(query.shape, dtype=torch.float32)
    kv = (key, value)
    dkv = [torch.zeros(t.shape, dtype=torch.float32) for t in kv]
    dkv_hop = None
    for step in range(ring.size):
        kv_hop = _Transfer(ring, kv, f"K/V (backward step {step})") if step < ring.size - 1 else None
        for block in step_blocks(cfg, ring.rank, (ring.rank - step) % ring.size, ring.size):
            dq_b, *dkv_b = _block_grads(cfg, block, query, kv, dy, out, softmax_max, softmax_sum)
            _rows(dq, cfg, block.rows).add_(dq_b)
            if dkv_hop is not None:
                dkv, dkv_hop = dkv_hop.wait(), None
            for total, grad in zip(dkv, dkv_b):
                _rows(total, cfg, block.cols).add_(grad)
        if dkv_hop is not None:          # a step without visible blocks
            dkv = dkv_hop.wait()
        if ring.size > 1:
            dkv_hop = _Transfer(ring, dkv, f"dK/dV (backward step {step})")
        if kv_hop is not None:
            kv = kv_hop.wait()
    if dkv_hop is not None:
        dkv = dkv_hop.wait()
    return dq.to(dtypes[0]), dkv[0].to(dtypes[1]), dkv[1].to(dtypes[2])


class _RingAttention(torch.autograd.Function):
    """Differentiable w.r.t. query, key and value; the statistics are not differentiable."""

    @staticmethod
    def forward(ctx, query, key, value, cfg, ring):
        out, m, s = ring_forward(cfg, ring, query, key, value)
        ctx.save_for_backward(query, key, value, out, m, s)
        ctx.cfg, ctx.ring = cfg, ring
        ctx.mark_non_differentiable(m, s)
        return out.to(query.dtype), m, s

    @staticmethod
    def backward(ctx, d_out, _d_max, _d_sum):
        query, key, value, out, m, s = ctx.saved_tensors
        dy = d_out.to(query.dtype).contiguous()
        with precision_mode(ctx.cfg.precision):
            grads = ring_backward(ctx.cfg, ctx.ring, query, key, value, out, m, s, dy)
        return (*grads, None, None)


# ------------------------------------------------------------------------------------------- the API
def ring_flash_attention(query, key, value, head_num, input_layout, *, group=None, causal=False, scale_value=None,
                         keep_prob=1.0, seed=0, offset=0, zigzag=True, return_stats=False, timeout=None,
                         **cann_kwargs):
    """Exact FlashAttentionScore over a sequence sharded on the ranks of ``group`` (default: WORLD).

    query / key / value: this rank's shards in BSH, SBH, BSND or BNSD (GQA/MQA and Dv < D as in
    :func:`attngrad.flash_attention_score`), cut by :func:`zigzag_shard` with the same ``zigzag``; every
    rank passes the same shapes and attributes. ``causal``: lower-triangular attention over the global
    positions. ``scale_value`` defaults to 1/sqrt(D). Dropout (``keep_prob`` < 1) uses the keep mask the
    unsharded :func:`attngrad.npu.npu_fusion_attention` draws from (``seed``, ``offset``). ``cann_kwargs``:
    ``pse`` alibi slopes with ``pse_type`` 2/3 (global ``q_start_idx`` / ``kv_start_idx``) and
    ``inner_precise``. ``timeout`` (seconds or timedelta): the longest wait for a peer's transfer before
    :class:`RingCommunicationError` (default: the process group's timeout).

    Returns this rank's output rows (query's shape with D -> Dv, query's dtype), differentiable w.r.t.
    query, key and value; with ``return_stats`` also softmax_max / softmax_sum float32 [B, N1, S_local, 8].
    Mismatched metadata across ranks raise AclnnError 161002 on every rank (see docs/context-parallel.md).
    """
    ring = _ring(group, timeout)
    check_same_on_all_ranks(ring, dict(query=query, key=key, value=value, head_num=head_num,
                                       input_layout=input_layout, causal=causal, scale_value=scale_value,
                                       keep_prob=keep_prob, seed=seed, offset=offset, zigzag=zigzag,
                                       precision=current_precision(), **cann_kwargs))
    cfg = make_config(ring, (query, key, value), head_num, input_layout, causal, scale_value, keep_prob, seed,
                      offset, zigzag, cann_kwargs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        out, m, s = _RingAttention.apply(query, key, value, cfg, ring)
    else:
        out, m, s = ring_forward(cfg, ring, query, key, value)
        out = out.to(query.dtype)
    return (out, m, s) if return_stats else out


def ringattn_context_parallel(q, k, v, n, cp_para, softmax_scale=None, attn_mask=None, dropout_p=0.):
    """MindSpeed's ``ringattn_context_parallel`` on attngrad: q/k/v SBH ``[S_local, B, N*D]`` shards (causal:
    Megatron's zigzag split, else contiguous), ``n`` heads, ``cp_para`` with ``causal`` and optionally
    ``cp_group`` (default WORLD), ``pse`` / ``pse_type`` (alibi slopes), ``seed``, ``offset`` and
    ``timeout``. ``attn_mask`` may be None or MindSpeed's compressed causal mask (causal is taken from
    cp_para); ``dropout_p`` is 1 - keep_prob. Returns the SBH output shard."""
    if attn_mask is not None and not cp_para.get("causal"):
        raise invalid("ringattn_context_parallel", "attn_mask", "only the compressed causal mask (with "
                      "cp_para['causal']) is supported", list(attn_mask.shape))
    alibi = {name: cp_para[name] for name in ("pse", "pse_type") if cp_para.get(name) is not None}
    causal = bool(cp_para.get("causal", False))
    return ring_flash_attention(q, k, v, n, "SBH", group=cp_para.get("cp_group"), causal=causal,
                                scale_value=softmax_scale, keep_prob=1.0 - dropout_p, seed=cp_para.get("seed", 0),
                                offset=cp_para.get("offset", 0), zigzag=causal, timeout=cp_para.get("timeout"),
                                **alibi)
