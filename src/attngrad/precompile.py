"""Compile the kernels ahead of their first call: ``attngrad compile``.

A kernel specialisation compiles on its first call and is then loaded from numba's disk cache by every later
process; with an empty cache a first call waits for its kernels to compile, flash attention's the longest (timings
in docs/performance.md, 'First call in a fresh process'), its forward's and backward's one after the other. Each
operator has one forward and one backward specialisation per dtype, whatever the shapes, layouts, masks, pse,
dropout or varlen lengths (see docs/performance.md, 'Test suite time') and precision mode (golden mode's flash
attention kernels are others), so one small call fills the cache for all calls of that dtype and mode.

:func:`compile_jobs` runs one such call per ``(operator, direction, dtype, precision mode)`` (:class:`Job`), each in
a process of its own, several at once, so the compiles use every core (the processes share numba's locked cache).
Each job process holds about 0.5 GB and its compiling child up to about 1 GB more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

OPERATORS = ("FlashAttention", "ScaledMaskedSoftmax", "ExpSegsum")  # slowest to compile first
DIRECTIONS = ("backward", "forward")
DTYPES = ("bfloat16", "float16", "float32")
JOB_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Job:
    """Small calls of ``op``'s ``direction`` in ``dtype`` and ``precision`` mode (names from ``OPERATORS``,
    ``DIRECTIONS``, ``DTYPES`` and :data:`.precision_mode.MODES`)."""

    op: str
    direction: str
    dtype: str
    precision: str

    def command(self) -> list[str]:
        """The interpreter command that runs :func:`run_job` for this job."""
        return [sys.executable, "-c", f"from attngrad.precompile import run_job; "
                f"run_job({self.op!r}, {self.direction!r}, {self.dtype!r}, {self.precision!r})"]

    def __str__(self) -> str:
        return f"{self.op} {self.direction} {self.dtype} ({self.precision})"


@dataclass(frozen=True)
class JobResult:
    job: Job
    seconds: float
    error: str | None  # None: the job's kernels are in the cache


def select_jobs(ops: list[str] | None = None, dtypes: list[str] | None = None,
                precisions: list[str] | None = None) -> list[Job]:
    """The jobs for the operators matching ``ops`` (case-insensitive substrings, as ``attngrad bench --op``; default
    all), the ``dtypes`` (names in ``DTYPES``; default all) and the precision modes (default: the mode a call would
    take now, :func:`.precision_mode.current_precision`), slowest first. ValueError names what is unknown."""
    from .cli import op_selected
    from .precision_mode import MODES, current_precision

    chosen_ops = [op for op in OPERATORS if op_selected(op, ops)]
    if not chosen_ops:
        raise ValueError(f"no operator matches {ops}; the operators: {', '.join(OPERATORS)}")
    unknown = [d for d in dtypes or () if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype {', '.join(unknown)}; the dtypes: {', '.join(DTYPES)}")
    unknown = [m for m in precisions or () if m not in MODES]
    if unknown:
        raise ValueError(f"unknown precision mode {', '.join(unknown)}; the modes: {', '.join(MODES)}")
    chosen_dtypes = [d for d in DTYPES if not dtypes or d in dtypes]
    modes = [m for m in MODES if m in (precisions or [current_precision()])]
    return [Job(op, direction, dtype, mode) for op in chosen_ops for direction in DIRECTIONS for dtype in chosen_dtypes
            for mode in modes]


def compile_jobs(jobs: list[Job], workers: int | None = None,
                 on_done: Callable[[JobResult], None] | None = None) -> list[JobResult]:
    """Run ``jobs`` in child processes, ``workers`` at a time (default: one per core, at most one per job);
    ``on_done`` is called with each result as it comes. Results in the order of ``jobs``. An exception here
    (Ctrl-C) stops the jobs not started and kills the running ones with their compiling children."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs) or 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    results, running = {}, set()
    pool = ThreadPoolExecutor(workers)
    try:
        futures = {pool.submit(_run_in_child, job, env, running): job for job in jobs}
        for future in as_completed(futures):
            result = results[futures[future]] = future.result()
            if on_done:
                on_done(result)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(running):
            _kill_group(proc)
        raise
    pool.shutdown()
    return [results[job] for job in jobs]


def _run_in_child(job: Job, env: dict, running: set) -> JobResult:
    """Run ``job`` in a process of its own process group (listed in ``running`` meanwhile), at most
    ``JOB_TIMEOUT_S``."""
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(job.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)
    except OSError as exc:
        return JobResult(job, 0.0, f"did not start: {exc}")
    running.add(proc)
    try:
        _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        error = f"ran past {JOB_TIMEOUT_S:.0f} s"
    else:
        tail = stderr.decode(errors="replace").strip()[-1500:]
        error = f"failed with status {proc.returncode}: {tail}" if proc.returncode else None
    finally:
        running.discard(proc)
    return JobResult(job, time.perf_counter() - start, error)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and the processes it started (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, OSError):  # no process groups (Windows), or already gone
        proc.kill()


def run_job(op: str, direction: str, dtype: str, precision: str) -> None:
    """A job's side: the small calls of ``op``'s ``direction`` in ``dtype`` (see :data:`_CALLS`) in ``precision``
    mode."""
    import torch

    from .precision_mode import precision_mode

    with precision_mode(precision):
        _CALLS[op, direction](getattr(torch, dtype))


def _flash_attention_inputs(dtype):
    """q, k, v, dy ``[1, 2, 128, 64]`` and the keywords of a plain call and of a causal one with pse and dropout."""
    import torch

    from .kernels.dropout import generate_drop_mask

    b, n, s, d = 1, 2, 128, 64
    q, k, v, dy = (torch.randn(b, n, s, d).to(dtype) for _ in range(4))
    modified = dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=2,
                    pse=torch.randn(b, n, s, s).to(dtype), keep_prob=0.9,
                    drop_mask=generate_drop_mask(seed=0, offset=0, numels=b * n * s * s, keep_prob=0.9))
    return (q, k, v, dy), ({}, modified)


def _flash_attention_forward(dtype):
    import attngrad

    (q, k, v, _), calls = _flash_attention_inputs(dtype)
    for kw in calls:
        attngrad.flash_attention_score(q, k, v, q.shape[1], "BNSD", scale_value=q.shape[-1] ** -0.5, **kw)


def _flash_attention_backward(dtype):
    """The grad from given forward outputs (made up: only the compile counts), so no forward compiles here."""
    import torch

    import attngrad

    (q, k, v, dy), calls = _flash_attention_inputs(dtype)
    stats = torch.zeros(*q.shape[:3], 8), torch.ones(*q.shape[:3], 8)
    for kw in calls:
        attngrad.flash_attention_score_grad(q, k, v, dy, q.shape[1], "BNSD", softmax_max=stats[0],
                                            softmax_sum=stats[1], attention_in=dy, scale_value=q.shape[-1] ** -0.5,
                                            **kw)


def _softmax_inputs(dtype):
    import torch

    x = torch.randn(2, 2, 64, 128).to(dtype)
    return x, torch.rand(2, 1, 64, 128) < 0.2


def _softmax_forward(dtype):
    import attngrad

    attngrad.scaled_masked_softmax(*_softmax_inputs(dtype), scale=0.5)


def _softmax_backward(dtype):
    import torch

    import attngrad

    x, mask = _softmax_inputs(dtype)
    attngrad.scaled_masked_softmax_backward(x, torch.softmax(x.float(), -1).to(dtype), mask, scale=0.5)


def _exp_segsum_forward(dtype):
    import torch

    import attngrad

    attngrad.exp_segsum(torch.randn(2, 4, 64).to(dtype))


def _exp_segsum_backward(dtype):
    import torch

    import attngrad

    grads = (torch.rand(2, 4, 64, 64).to(dtype) for _ in range(2))
    attngrad.exp_segsum_backward(*grads)


_CALLS = {("FlashAttention", "forward"): _flash_attention_forward,
          ("FlashAttention", "backward"): _flash_attention_backward,
          ("ScaledMaskedSoftmax", "forward"): _softmax_forward,
          ("ScaledMaskedSoftmax", "backward"): _softmax_backward,
          ("ExpSegsum", "forward"): _exp_segsum_forward,
          ("ExpSegsum", "backward"): _exp_segsum_backward}
