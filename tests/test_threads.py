"""The kernels run on torch's thread count (``torch.set_num_threads``), capped by numba's pool, and restore
numba's own setting afterwards; MKL stays single-threaded inside them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

import attngrad
from attngrad.kernels import dropout, exp_segsum, flash_attention, gemm, layouts, scaled_masked_softmax
from attngrad.kernels.threads import call_native, claim, kernel_threads, native_address, on_torch_threads

from helpers import torch_threads


@on_torch_threads
def _numba_count():
    return numba.get_num_threads()


@pytest.mark.parametrize("n", [1, 2])
def test_numba_follows_torch_and_is_restored(n):
    before = numba.get_num_threads()
    with torch_threads(n):
        assert kernel_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
        assert _numba_count() == kernel_threads()
    assert numba.get_num_threads() == before


def test_count_is_capped_by_numba_pool():
    with torch_threads(numba.config.NUMBA_NUM_THREADS + 3):
        assert _numba_count() == numba.config.NUMBA_NUM_THREADS


def test_restored_when_the_kernel_raises():
    @on_torch_threads
    def failing():
        raise ValueError("boom")

    before = numba.get_num_threads()
    with torch_threads(1), pytest.raises(ValueError):
        failing()
    assert numba.get_num_threads() == before


def test_starting_numba_pool_keeps_torch_count():
    """numba's OpenMP pool starts at the first kernel launch and sets the OpenMP runtime's count, which torch reads:
    a count set before (here by OMP_NUM_THREADS=1, in a fresh process) must survive it."""
    code = ("import torch; from attngrad.kernels.threads import on_torch_threads; "
            "on_torch_threads(lambda: None)(); print(torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1"]


@pytest.mark.parametrize("launch", [flash_attention.flash_attention_forward, flash_attention.flash_attention_backward,
                                    exp_segsum.exp_segsum_forward, exp_segsum.exp_segsum_backward,
                                    scaled_masked_softmax.scaled_masked_softmax_forward,
                                    scaled_masked_softmax.scaled_masked_softmax_backward,
                                    dropout.generate_drop_mask])
def test_every_launch_point_follows_torch(launch):
    assert launch.__code__ is _numba_count.__code__  # the wrapper of on_torch_threads


def test_flash_attention_tasks_run_on_torch_threads(monkeypatch):
    """The task-parallel kernels of a forward and a backward launched after torch.set_num_threads(1) see one
    numba thread and run one worker."""
    seen = []
    launch = layouts.launch_strided

    def spy(kernel, *args, **kwargs):
        if kernel in (flash_attention._forward_kernel, flash_attention._backward_kernel):
            seen.append((numba.get_num_threads(), args[-1]))
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(layouts, "launch_strided", spy)
    q, k, v = (torch.randn(1, 64, 2, 32, requires_grad=True) for _ in range(3))
    with torch_threads(1):
        attngrad.flash_attn_func(q, k, v).sum().backward()
    assert seen == [(1, 1), (1, 1)]


@numba.njit(parallel=True)
def _claim_all(tasks, workers, hits):
    counter = np.zeros(1, np.int64)
    for _ in numba.prange(workers):
        t = claim(counter)
        while t < tasks:
            hits[t] += 1
            t = claim(counter)
    return counter[0]


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_claim_hands_out_every_task_once(workers):
    hits = np.zeros(100000, np.int64)
    with torch_threads(2):
        last = on_torch_threads(_claim_all)(hits.size, workers, hits)
    assert last == hits.size + workers  # each worker's last claim found no task left
    assert (hits == 1).all()


def test_mkl_is_sequential():
    mkl = ctypes.CDLL(str(gemm._mkl_rt_path()))
    with torch_threads(2):
        assert mkl.MKL_Get_Max_Threads() == 1


@numba.njit(cache=True)
def _double_into(x, out):
    if x < 0:
        raise ValueError("x must not be negative")
    out[0] = 2 * x


@numba.njit(cache=True)
def _double_by_address(address, x, out):
    call_native(address, (x, out))


def test_call_native_runs_the_callee_and_raises_its_errors():
    """A function called by address (not linked into its caller) gets its arguments, writes its results in place
    and raises its exceptions in the caller."""
    signature = (numba.int64, numba.int64[::1])
    _double_into.compile(signature)
    address = native_address(_double_into, signature)
    out = np.zeros(1, np.int64)
    _double_by_address(address, 21, out)
    assert out[0] == 42
    with pytest.raises(ValueError, match="must not be negative"):
        _double_by_address(address, -1, out)


@numba.njit(cache=True)
def _doubled(x):
    return 2 * x


def test_native_address_needs_a_function_that_returns_nothing():
    _doubled.compile((numba.int64,))
    with pytest.raises(TypeError, match="must return nothing"):
        native_address(_doubled, (numba.int64,))
