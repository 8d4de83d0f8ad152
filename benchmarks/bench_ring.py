"""Ring attention (:mod:`attngrad.distributed`): per-rank peak memory against the sequence length, and the wall
time of context parallelism against one process with as many threads.

``attngrad bench --op ring`` runs forward + backward of causal attention (B1 N8 D128, BSND, zigzag shards;
``--dtype`` picks float32 and/or bfloat16, default float32) in fresh child processes, every rank with one
thread (``NUMBA_NUM_THREADS`` / ``OMP_NUM_THREADS`` set before import) and a gloo group over a file rendezvous:

* memory: for cp = 1 (``attngrad.flash_attention_score`` and autograd on the whole sequence) and cp = 2, 4
  (``ring_flash_attention`` on this rank's shard), the peak RSS of one forward + backward above the RSS
  before it (inputs, the gradient of the output and the process group excluded; the kernels ran once on a
  short sequence first), the largest over the ranks. glibc's mmap threshold is fixed at 64 KiB in the
  children (``MALLOC_MMAP_THRESHOLD_``), so that freed buffers leave the RSS and the peak counts live
  bytes: with the default dynamic threshold, freed buffers of a few MiB stay in the heap, and a figure
  then depends on the order of allocations as much as on their size (the setting slows the steps, so the
  timing runs go without it);
* time: cp = 2 with one thread per rank against one process with two threads at S = 8192 (``--quick``:
  2048), best of :data:`TIME_REPEATS` steps (a barrier before each; the slowest rank's time).

Numbers from a shared machine are noisy: the best of several steps is reported, and the memory figure is
exact only up to the allocator's page reuse. This module has no ``cases``: it is not part of the per-case
timing. Results: ``bench.json`` (``ring``) and ``ring.png``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

BATCH, HEADS, HEAD_DIM, LAYOUT = 1, 8, 128, "BSND"
SIZES = (2048, 4096, 8192, 16384)
QUICK_SIZES = (1024, 2048)
CPS = (1, 2, 4)
TIME_S, QUICK_TIME_S = 8192, 2048
TIME_REPEATS = 3
WARMUP_S = 512
THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}   # freed buffers leave the RSS: it follows the live bytes

_CHILD = """
import json, os, sys
from attngrad.benchmarks.bench_ring import rank_step
print(json.dumps(rank_step(*sys.argv[1:])), flush=True)
os._exit(0)  # skips interpreter shutdown, where a gloo worker releasing tensors aborts (docs/context-parallel.md)
"""


def selected(args) -> bool:
    """Whether ``attngrad bench`` was asked for the ring section (``--op ring``)."""
    return any("ring" in op.lower() for op in args.op or ())


def selected_alone(args) -> bool:
    """Whether the ring section is all that was asked for (every ``--op`` names it): no operator cases to build."""
    return bool(args.op) and all("ring" in op.lower() for op in args.op)


# ------------------------------------------------------------------------------------------ one rank
def _inputs(s: int, dtype):
    """Random q, k, v, dy of one rank's ``s`` positions in BSND (values do not matter here)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, s, HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(4)]


@functools.lru_cache(maxsize=1)
def _causal_mask():
    """The compressed causal mask of sparse mode 3 (made once, before the measured steps)."""
    import torch

    return torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _step(world: int, q, k, v, dy) -> None:
    """One forward + backward: the unsharded attngrad call (world 1) or the ring."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if world == 1:
        import attngrad

        out = attngrad.flash_attention_score(*leaves, HEADS, LAYOUT, sparse_mode=3, atten_mask=_causal_mask())[0]
    else:
        from attngrad.distributed import ring_flash_attention

        out = ring_flash_attention(*leaves, HEADS, LAYOUT, causal=True)
    out.backward(dy)


def rank_step(rank: str, world: str, store: str, s: str, dtype: str, repeats: str) -> dict:
    """A child rank: ``repeats`` timed steps at global length ``s`` after one at :data:`WARMUP_S`; returns
    ``{"peak_bytes", "seconds"}`` (peak RSS rise over the steps, best step time)."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from .bench_scaling import peak_rss_reset, rss_bytes

    rank, world, s, repeats = int(rank), int(world), int(s), int(repeats)
    dtype = getattr(torch, dtype)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10))
    _step(world, *_inputs(WARMUP_S // world, dtype))
    data = _inputs(s // world, dtype)
    base = peak_rss_reset()
    best = float("inf")
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _step(world, *data)
        best = min(best, time.perf_counter() - t0)
    peak = rss_bytes("VmHWM") - base
    if world > 1:
        dist.destroy_process_group()
    return {"peak_bytes": peak, "seconds": best}


def measure(cp: int, s: int, dtype: str, threads: int = 1, repeats: int = 1, memory: bool = True,
            timeout: float = 1800) -> dict:
    """One run of ``cp`` ranks (child processes of ``threads`` threads each) at global length ``s``: the
    largest peak memory and the slowest best step over the ranks. ``memory``: with :data:`MALLOC` (its
    page faults slow the steps several times: timing runs leave malloc alone)."""
    env = {**os.environ, **{name: str(threads) for name in THREAD_VARIABLES}, **(MALLOC if memory else {})}
    with tempfile.TemporaryDirectory(prefix="attngrad-ring-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(r), str(cp), store, str(s), dtype,
                                   str(repeats)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for r in range(cp)]
        try:
            outputs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    failed = [(r, p.returncode, err) for r, (p, (_, err)) in enumerate(zip(procs, outputs)) if p.returncode]
    if failed:
        r, code, err = failed[0]
        raise RuntimeError(f"ring bench rank {r} of {cp} failed ({code}): {err.strip()[-2000:]}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    return {"cp": cp, "s": s, "dtype": dtype, "threads_per_rank": threads,
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "seconds": max(r["seconds"] for r in ranks),
            "rank_peak_bytes": [r["peak_bytes"] for r in ranks]}


# ----------------------------------------------------------------------------------------- the section
def plan(args) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """``(memory runs, timing runs)`` as (cp, threads per rank, dtype) at the sizes of ``args``."""
    dtypes = args.dtype or ["float32"]
    memory = [(cp, s, dtype) for dtype in dtypes for cp in CPS for s in (QUICK_SIZES if args.quick else SIZES)
              if s % (2 * cp) == 0]
    timing = [(cp, 2 // cp, dtype) for dtype in dtypes for cp in (2, 1)]
    return memory, timing


def run(args, progress=None) -> dict:
    """The runs of ``attngrad bench --op ring``."""
    memory, timing = plan(args)
    time_s = QUICK_TIME_S if args.quick else TIME_S
    task = progress.add_task("ring", total=len(memory) + len(timing)) if progress else None

    def step(description, fn):
        if progress:
            progress.update(task, description=f"ring: {description}")
        result = fn()
        if progress:
            progress.advance(task)
        return result

    rows = [step(f"memory cp={cp} S={s} {dtype}", lambda cp=cp, s=s, dtype=dtype: measure(cp, s, dtype))
            for cp, s, dtype in memory]
    times = [step(f"time cp={cp} x {threads} thread(s) S={time_s} {dtype}",
                  lambda cp=cp, threads=threads, dtype=dtype: measure(cp, time_s, dtype, threads, TIME_REPEATS,
                                                                      memory=False))
             for cp, threads, dtype in timing]
    return {"shape": f"B{BATCH} N{HEADS} D{HEAD_DIM} {LAYOUT} causal zigzag", "memory": rows, "timing": times,
            "ratios": ratios(rows, times)}


def ratios(rows: list[dict], times: list[dict]) -> dict:
    """Per-rank peak over the single-process peak (per cp, dtype and S) and cp=2 time over 2-thread time."""
    single = {(r["s"], r["dtype"]): r["peak_bytes"] for r in rows if r["cp"] == 1}
    memory = {f"cp{r['cp']} {r['dtype']} S{r['s']}": r["peak_bytes"] / single[r["s"], r["dtype"]]
              for r in rows if r["cp"] > 1 and (r["s"], r["dtype"]) in single}
    by_dtype = {}
    for t in times:
        by_dtype.setdefault(t["dtype"], {})[t["cp"]] = t["seconds"]
    time = {f"cp2 / 1 process 2 threads {d}": v[2] / v[1] for d, v in by_dtype.items() if 1 in v and 2 in v}
    return {"memory_per_rank_over_single": memory, "time": time}


def render(ring: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"ring attention forward + backward ({ring['shape']}): peak RSS rise per rank "
                        "(largest rank), 1 thread per rank")
    for col in ("cp", "dtype", "S", "peak MiB", "of cp=1"):
        table.add_column(col)
    fractions = ring["ratios"]["memory_per_rank_over_single"]
    for r in ring["memory"]:
        fraction = fractions.get(f"cp{r['cp']} {r['dtype']} S{r['s']}")
        table.add_row(str(r["cp"]), r["dtype"], str(r["s"]), f"{r['peak_bytes'] / 2**20:.0f}",
                      "-" if fraction is None else f"{fraction:.2f}")
    console.print(table)
    for t in ring["timing"]:
        console.print(f"time S={t['s']} {t['dtype']}: cp={t['cp']} x {t['threads_per_rank']} thread(s) "
                      f"{t['seconds']:.2f} s (best of {TIME_REPEATS})")
    for name, value in ring["ratios"]["time"].items():
        console.print(f"{name}: {value:.2f}x")


def plot(ring: dict, path):
    """Per-rank peak memory against S, one line per (cp, dtype), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for cp, dtype in dict.fromkeys((r["cp"], r["dtype"]) for r in ring["memory"]):
        rows = [r for r in ring["memory"] if (r["cp"], r["dtype"]) == (cp, dtype)]
        label = "1 process" if cp == 1 else f"cp={cp}, per rank"
        ax.loglog([r["s"] for r in rows], [max(r["peak_bytes"], 1) / 2**20 for r in rows], "o-", base=2,
                  label=f"{label} ({dtype})")
    ax.set(xlabel="sequence length S", ylabel="peak memory rise (MiB)",
           title=f"ring attention fwd + bwd, {ring['shape']}")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
