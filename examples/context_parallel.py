"""Context parallelism: train a small causal attention model on one long sequence split over 2 ranks.

    torchrun --nproc_per_node 2 examples/context_parallel.py
    python examples/context_parallel.py          # spawns its 2 ranks itself (what ``attngrad examples`` runs)

Each rank holds the zigzag shard of the token sequence (chunks r and 3 - r of 4); the attention is
:func:`attngrad.distributed.ring_flash_attention` (causal), everything else is per token. Parameters are
replicated: gradients are summed over the ranks after each backward. The data follow a Markov chain
(the next token is ``perm[token]`` 90% of the time), so the loss falls from ln(64) = 4.16. At the end rank
0 compares the ring's loss with the same model run unsharded; every rank prints its peak memory (before
that check).
"""

from __future__ import annotations

import datetime
import math
import os
import resource
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attngrad
from attngrad.distributed import ring_flash_attention, zigzag_shard

SEQ, VOCAB, HIDDEN, HEADS, STEPS, WORLD = 4096, 64, 64, 4, 4, 2
CAUSAL_MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)   # sparse mode 3's compressed mask


class TinyCausalLM(torch.nn.Module):
    """Embedding, one causal multi-head attention layer (BSH) with a residual, and an output head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, sharded: bool) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if sharded:
            a = ring_flash_attention(q, k, v, HEADS, "BSH", causal=True)
        else:
            a = attngrad.flash_attention_score(q, k, v, HEADS, "BSH", scale_value=(HIDDEN // HEADS) ** -0.5,
                                               atten_mask=CAUSAL_MASK, sparse_mode=3)[0]
        return self.head(x + self.proj(a))


def markov_tokens(n: int) -> torch.Tensor:
    """[1, n] tokens: next = perm[current] with probability 0.9, else uniform."""
    g = torch.Generator().manual_seed(0)
    perm, noise = torch.randperm(VOCAB, generator=g), torch.randint(VOCAB, (n,), generator=g)
    jump = torch.rand(n, generator=g) < 0.1
    tokens = [int(noise[0])]
    for i in range(1, n):
        tokens.append(int(noise[i]) if jump[i] else int(perm[tokens[-1]]))
    return torch.tensor(tokens).unsqueeze(0)


def summed_loss(model, inputs, targets, sharded: bool) -> torch.Tensor:
    logits = model(inputs, sharded)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / SEQ


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)                                    # the same initial parameters on every rank
    model = TinyCausalLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    tokens = markov_tokens(SEQ + 1)
    inputs, targets = (zigzag_shard(t, 1) for t in (tokens[:, :-1], tokens[:, 1:]))
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = summed_loss(model, inputs, targets, sharded=True)    # this rank's share of the mean loss
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(loss.detach())
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"rank {rank}: {inputs.shape[1]} of {SEQ} tokens, peak RSS {peak_mib:.0f} MiB", flush=True)
    with torch.no_grad():
        loss = summed_loss(model, inputs, targets, sharded=True)
        dist.all_reduce(loss)
        if rank == 0:
            full = summed_loss(model, tokens[:, :-1], tokens[:, 1:], sharded=False)
            print(f"final loss: ring {loss.item():.6f}, unsharded {full.item():.6f} "
                  f"(difference {abs(loss.item() - full.item()):.1e})", flush=True)


def _rank_main(rank: int, world: int, port: int) -> None:
    """One spawned rank: a gloo group on localhost, CPU threads split between the ranks."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    try:
        train(rank, world)
    finally:
        dist.destroy_process_group()
    leave_rank()


def leave_rank() -> None:
    """End this rank's process without interpreter shutdown. gloo's worker threads release a finished
    collective's tensors a moment after the caller resumes; one that does so during shutdown aborts the process
    when it takes the GIL ("terminate called without an active exception"). Only after a successful run: an
    exception still propagates and fails the rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    """Under torchrun: this process is one rank. Otherwise spawn WORLD ranks and wait for them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
        leave_rank()
    print(f"causal LM, one sequence of {SEQ} tokens over {WORLD} ranks (zigzag shards), "
          f"ln({VOCAB}) = {math.log(VOCAB):.2f}", flush=True)
    mp.spawn(_rank_main, args=(WORLD, _free_port()), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
