"""Compile the kernels ahead of their first call: ``attngrad compile``.

A kernel specialisation compiles on its first call and is then loaded from numba's disk cache by every later
process; with an empty cache a first call waits for its kernels to compile, flash attention's the longest (timings
in docs/performance.md, 'First call in a fresh process'), its forward's and backward's one after the other. Each
operator has one specialisation per dtype and precision mode (golden mode's flash attention kernels are others;
the float16 softmax's first npu call compiles its forward twice to time the two roundings, gemm_paths),
whatever the shapes, layouts, masks, pse, dropout or varlen lengths (docs/performance.md, 'Test suite time'), so
one small call fills the cache for all calls of that dtype and mode.

:func:`compile_jobs` runs one such call per ``(operator, dtype, precision mode)`` (:class:`Job`), each in a process
of its own, several at once, so the compiles use every core (the processes share numba's locked cache). Each job
process holds about 0.5 GB and its compiling child up to about 1 GB more. numba keys its cache by the CPU's model and
features and uses a cache directory only where it can write, so the cache serves the machine it was filled on.

Without the command, a forward call that autograd will differentiate starts its backward operator's job in the
background when the forward's kernels compile (:func:`call_forward`), so the two compile side by side there too.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from .kernels import child_compile
from .kernels.child_compile import stderr_tail

DTYPES = ("bfloat16", "float16", "float32")
JOB_TIMEOUT_S = 3600.0
EARLY_BACKWARD_ENV = "ATTNGRAD_COMPILE_BACKWARD_EARLY"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """Small calls of the CANN operator ``op`` (a key of :data:`_CALLS`) in ``dtype`` (one of ``DTYPES``) and
    ``precision`` mode (one of :data:`.precision_mode.MODES`)."""

    op: str
    dtype: str
    precision: str

    def command(self) -> list[str]:
        """The interpreter command that runs :func:`run_job` for this job, on this process's ``sys.path``."""
        return [sys.executable, "-c", f"import sys; sys.path[:] = {sys.path!r}; from attngrad.precompile import "
                f"run_job; run_job({self.op!r}, {self.dtype!r}, {self.precision!r})"]

    def start(self, stderr) -> subprocess.Popen:
        """Start :meth:`command` in a session of its own (a process group, killed with the processes it starts), on
        this process's numba cache, its stdin and stdout discarded; OSError where it cannot start."""
        return subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                env=child_compile.child_environment(), start_new_session=True)

    def __str__(self) -> str:
        return f"{self.op} {self.dtype} ({self.precision})"


@dataclass(frozen=True)
class JobResult:
    """A job's wall time in seconds and its error (None: its kernels are in the cache)."""

    job: Job
    seconds: float
    error: str | None


def select_jobs(ops: list[str] | None = None, dtypes: list[str] | None = None,
                precisions: list[str] | None = None) -> list[Job]:
    """The jobs for the operators matching ``ops`` (case-insensitive substrings of CANN's operator names, as
    ``attngrad bench --op``; default all), the ``dtypes`` (default all) and the precision modes (default: the mode a
    call would take now, :func:`.precision_mode.current_precision`), slowest first. ValueError when no operator
    matches."""
    from .cli import op_selected
    from .precision_mode import MODES, current_precision

    chosen = [op for op in _CALLS if op_selected(op, ops)]
    if not chosen:
        raise ValueError(f"no operator matches {', '.join(map(repr, ops))}; the operators: {', '.join(_CALLS)}")
    modes = [m for m in MODES if m in (precisions or [current_precision()])]
    return [Job(op, dtype, mode) for op in chosen for dtype in DTYPES if not dtypes or dtype in dtypes
            for mode in modes]


def worker_count(jobs: list[Job], workers: int | None = None) -> int:
    """``workers``, by default the cores this process may run on, at most one per job and at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(workers or cores, len(jobs)))


def compile_jobs(jobs: list[Job], workers: int | None = None,
                 on_done: Callable[[JobResult], None] | None = None) -> list[JobResult]:
    """Run ``jobs`` in child processes, :func:`worker_count` at a time; ``on_done`` is called with each result as
    it comes. Results in the order of ``jobs``. An exception here (Ctrl-C, or SystemExit from a signal handler)
    stops the jobs not started and kills the running ones, with their compiling children where the system has
    process groups."""
    running = _RunningJobs()
    results = {}
    pool = ThreadPoolExecutor(worker_count(jobs, workers))
    try:
        futures = {pool.submit(running.run, job): job for job in jobs}
        for future in as_completed(futures):
            result = results[futures[future]] = future.result()
            if on_done:
                on_done(result)
    except BaseException:
        running.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [results[job] for job in jobs]


class _RunningJobs:
    """The job processes running now; once :meth:`stop` is called, no new one starts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._stopping = False

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            for proc in self._procs:
                if proc.returncode is None:  # not reaped: its process group is still its own
                    _kill_group(proc)

    def run(self, job: Job) -> JobResult:
        """Run ``job`` in a process of its own process group, at most ``JOB_TIMEOUT_S``."""
        start = time.perf_counter()
        with self._lock:
            if self._stopping:
                return JobResult(job, 0.0, "not started: stopped")
            try:
                proc = job.start(stderr=subprocess.PIPE)
            except OSError as exc:
                return JobResult(job, 0.0, f"did not start: {exc}")
            self._procs.add(proc)
        try:
            _, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
            error = _exit_error(proc.returncode, stderr)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            error = f"ran past {JOB_TIMEOUT_S:.0f} s and was killed: {stderr_tail(_stderr_left(proc))}"
        finally:
            with self._lock:
                self._procs.discard(proc)
        return JobResult(job, time.perf_counter() - start, error)


def _stderr_left(proc: subprocess.Popen) -> bytes:
    """What a killed job wrote to stderr, waiting at most 10 s for the end of the pipe (a process the job started and
    that outlived it, where the system has no process groups, may hold it open)."""
    try:
        return proc.communicate(timeout=10.0)[1]
    except subprocess.TimeoutExpired:
        proc.wait()
        return b""


def _exit_error(status: int, stderr: bytes) -> str | None:
    if status == 0:
        return None
    if status < 0:
        return f"killed by signal {-status} (out of memory? try fewer --jobs): {stderr_tail(stderr)}"
    return f"failed with status {status}: {stderr_tail(stderr)}"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (``proc`` and the processes it started), or ``proc`` alone without groups."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, OSError):  # no process groups (Windows), or the group is gone
        if proc.poll() is None:
            proc.kill()


# the backward jobs of :func:`call_forward` by (operator, torch dtype, precision mode): the job's process and the pid of
# the process that started it, or None where none started (the forward's kernels came from the cache, or no start)
_early: dict[tuple, tuple[subprocess.Popen, int] | None] = {}
_early_lock = threading.Lock()


def call_forward(forward, args: tuple, grad_op: str, precision: str):
    """``forward(*args)``: a forward custom op, ``args[0]`` its main input. The first time autograd will differentiate
    such a call (grad mode on, a tensor argument that requires grad; not while torch.compile traces), if one of its
    kernels is about to compile (:func:`.kernels.child_compile.on_first_child`), the job of its backward operator
    ``grad_op`` in ``args[0]``'s dtype and the ``precision`` mode starts in the background (:func:`_start_early`), so
    that the backward's kernels compile while the forward's do. A backward that asks for a kernel the job is
    compiling waits for it (the compile lock) and loads it."""
    if torch.compiler.is_compiling() or not _differentiated(args):
        return forward(*args)
    key = (grad_op, args[0].dtype, precision)
    if key in _early:
        return forward(*args)
    with child_compile.on_first_child(lambda: _start_early(key)):
        result = forward(*args)
    _early.setdefault(key, None)
    return result


def _differentiated(args: tuple) -> bool:
    """Whether autograd records a call on ``args``."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _start_early(key: tuple) -> None:
    """Start the job of ``key`` (:data:`_early`) in a process group of its own, its output discarded: a job that
    fails costs the backward only the wait, after which it compiles its kernels itself. Nothing starts where
    ``ATTNGRAD_COMPILE_BACKWARD_EARLY=0``, for a dtype without jobs, or off POSIX (no compile lock or process
    group: the two would compile the same kernels, and the job could not be killed with its child)."""
    grad_op, dtype, precision = key
    job = Job(grad_op, str(dtype).removeprefix("torch."), precision)
    if job.dtype not in DTYPES or os.name != "posix" or not child_compile.switched_on(EARLY_BACKWARD_ENV):
        return
    with _early_lock:
        if _early.get(key) is not None:  # another thread's forward started it
            return
        try:
            proc = job.start(stderr=subprocess.DEVNULL)
        except OSError as exc:
            _log.debug("%s: did not start beside its forward: %s", job, exc)
            return
        _early[key] = proc, os.getpid()
    threading.Thread(target=proc.wait, daemon=True).start()  # reaps it when it ends
    _log.debug("%s: compiling beside its forward (process %d)", job, proc.pid)


@atexit.register
def _stop_early() -> None:
    """At exit: kill the backward jobs this process started that still run, with their compiling children (a process
    killed by a signal leaves them to finish their compile)."""
    for started in list(_early.values()):
        if started and started[1] == os.getpid() and started[0].poll() is None:
            _kill_group(started[0])
            started[0].wait()


def run_job(op: str, dtype: str, precision: str) -> None:
    """A job's side: :data:`_CALLS` ``[op]`` in ``dtype`` and ``precision`` mode; SystemExit where a kernel
    compiled in this process instead of its child (:mod:`.kernels.child_compile`), so that the cache may lack it."""
    from .precision_mode import precision_mode

    with precision_mode(precision):
        _CALLS[op](getattr(torch, dtype))
    if child_compile.failed_kernels():
        raise SystemExit(f"compiled in this process, not through the disk cache: {child_compile.failed_kernels()}")


def _flash_attention_inputs(dtype):
    """q, k, v, dy ``[1, 2, 128, 64]`` BNSD of ``dtype`` and the keywords of two calls: plain, and causal (sparse
    mode 2) with a dense pse and dropout."""
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
    """The grad from given forward outputs (made up: float32 ``[B, N, S, 8]`` statistics, dy as the output; only
    the compile counts), so that it compiles beside the forward instead of after it."""
    import attngrad

    (q, k, v, dy), calls = _flash_attention_inputs(dtype)
    stats = torch.zeros(*q.shape[:3], 8), torch.ones(*q.shape[:3], 8)
    for kw in calls:
        attngrad.flash_attention_score_grad(q, k, v, dy, q.shape[1], "BNSD", softmax_max=stats[0],
                                            softmax_sum=stats[1], attention_in=dy, scale_value=q.shape[-1] ** -0.5,
                                            **kw)


def _softmax_inputs(dtype):
    """x ``[2, 2, 64, 128]`` of ``dtype`` and a bool mask broadcast over the heads, ``[2, 1, 64, 128]``."""
    x = torch.randn(2, 2, 64, 128).to(dtype)
    return x, torch.rand(2, 1, 64, 128) < 0.2


def _softmax_forward(dtype):
    import attngrad

    attngrad.scaled_masked_softmax(*_softmax_inputs(dtype), scale=0.5)


def _softmax_backward(dtype):
    """The backward of the :func:`_softmax_inputs` with dy = x and y = softmax(x)."""
    import attngrad

    x, mask = _softmax_inputs(dtype)
    attngrad.scaled_masked_softmax_backward(x, torch.softmax(x.float(), -1).to(dtype), mask, scale=0.5)


def _exp_segsum_forward(dtype):
    """ExpSegsum of a ``[2, 4, 64]`` input."""
    import attngrad

    attngrad.exp_segsum(torch.randn(2, 4, 64).to(dtype))


def _exp_segsum_backward(dtype):
    """ExpSegsumBackward of two ``[2, 4, 64, 64]`` inputs."""
    import attngrad

    grads = (torch.rand(2, 4, 64, 64).to(dtype) for _ in range(2))
    attngrad.exp_segsum_backward(*grads)


# CANN operator -> its small calls, slowest to compile first
_CALLS = {"FlashAttentionScoreGrad": _flash_attention_backward,
          "FlashAttentionScore": _flash_attention_forward,
          "ScaledMaskedSoftmax": _softmax_forward,
          "ScaledMaskedSoftmaxBackward": _softmax_backward,
          "ExpSegsumBackward": _exp_segsum_backward,
          "ExpSegsum": _exp_segsum_forward}
OPERATORS = tuple(_CALLS)
