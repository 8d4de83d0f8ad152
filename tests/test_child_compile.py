"""A new kernel specialisation compiles in a child process and loads from numba's disk cache, so a process with an
empty cache runs the same code, and gets the same bits, as the next process; where the child cannot help, the
kernel compiles in the calling process as numba does by default."""

import fcntl
import gc
import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import typeof

from attngrad.kernels import child_compile
from attngrad.kernels.layouts import launch_strided, launch_workers, strided_signature

_KERNEL_MODULE = """
import os
from numba import njit, prange
from attngrad.kernels.threads import call_native, claim
if os.environ.get("ATTNGRAD_TEST_BREAK_CHILD") and os.environ.get("ATTNGRAD_COMPILE_IN_CHILD") == "0":
    raise SystemExit(3)  # the child process dies before compiling


@njit(cache=True)
def add_one(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i] + 1


@njit(cache=True)
def add_one_worker(x, out, counter):
    i = claim(counter)
    while i < x.shape[0]:
        out[i] = x[i] + 1
        i = claim(counter)


@njit(parallel=True, cache=True)
def add_one_kernel(worker, x, out, counter, workers):
    for _ in prange(workers):
        call_native(worker, (x, out, counter))


@njit(cache=True)
def broken(x, out):
    out[0] = x.no_such_attribute
"""


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A tiny cached kernel in a new module under tmp_path (its numba cache in tmp_path/__pycache__)."""
    name = f"child_compile_kernel_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(_KERNEL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(child_compile, "_failed", set())
    yield importlib.import_module(name).add_one
    sys.modules.pop(name, None)


def _launch(kernel):
    x, out = np.arange(4.0), np.zeros(4)
    launch_strided(kernel, x, out)
    np.testing.assert_array_equal(out, x + 1)
    return sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values())


def test_a_new_specialisation_compiles_in_a_child_and_loads_from_the_cache(kernel):
    assert _launch(kernel) == (1, 0)  # one cache hit, no compile in this process


def test_a_kernel_and_its_worker_compile_in_one_child(kernel, monkeypatch):
    """launch_workers has the child that compiles the worker compile the kernel too (one interpreter start), for
    the very signature the launch then loads."""
    module = sys.modules[kernel.py_func.__module__]
    children, run = [], subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: children.append(args) or run(*args, **kwargs))
    x, out = np.arange(64.0), np.zeros(64)
    launch_workers(module.add_one_kernel, module.add_one_worker, x, out)
    np.testing.assert_array_equal(out, x + 1)
    assert len(children) == 1
    for function in (module.add_one_kernel, module.add_one_worker):
        assert (sum(function.stats.cache_hits.values()), sum(function.stats.cache_misses.values())) == (1, 0)


def test_the_callback_of_on_first_child_runs_once_before_the_first_child(kernel):
    """Armed for a context: called when a specialisation missing from the cache is about to compile in a child (not
    yet in the cache then), once, whatever compiles after it; never where no child is needed."""
    seen = []
    signature = (typeof(np.zeros(4)), typeof(np.zeros(4)))
    with child_compile.on_first_child(lambda: seen.append(child_compile._in_cache(kernel, signature))):
        assert _launch(kernel) == (1, 0)
        launch_strided(kernel, np.zeros(4, np.float32), np.zeros(4, np.float32))  # a second child
    assert seen == [False]
    with child_compile.on_first_child(lambda: seen.append("no child")):
        child_compile.compile_cached(kernel, strided_signature((np.zeros(4), np.zeros(4))))
    assert seen == [False]


def test_a_companion_that_fails_in_the_child_leaves_the_first_specialisation_loaded(kernel, recwarn):
    """The child compiles the first specialisation, then fails on its companion: the first loads from the cache
    without a warning, and the kernel is not marked as one whose child fails."""
    module = sys.modules[kernel.py_func.__module__]
    signature = (typeof(np.zeros(4)), typeof(np.zeros(4)))
    child_compile.compile_cached(kernel, signature, companions=((module.broken, signature),))
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert (sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values())) == (1, 0)
    assert not child_compile._failed


class _CompileRecorder:
    """Stands in for a dispatcher in a child's job: records each signature it is asked to compile and whether the
    garbage collector was enabled meanwhile."""

    def __init__(self):
        self.calls = []

    def compile(self, signature):
        self.calls.append((signature, gc.isenabled()))


RECORDER = _CompileRecorder()


def test_the_child_compiles_with_the_collector_paused_and_collects_after_each_specialisation(monkeypatch):
    RECORDER.calls.clear()
    collected_after = []
    monkeypatch.setattr(child_compile.gc, "collect", lambda: collected_after.append(len(RECORDER.calls)))
    try:
        child_compile.compile_here({"specialisations": [(__name__, "RECORDER", ("a",)),
                                                        (__name__, "RECORDER", ("b",))]})
        restored = gc.isenabled()
    finally:
        gc.enable()  # whatever happened, for the tests after this one
    assert RECORDER.calls == [(("a",), False), (("b",), False)]
    assert collected_after == [1, 2]
    assert restored  # for a caller in its own process


def test_switched_off_the_kernel_compiles_in_this_process(kernel, monkeypatch):
    monkeypatch.setenv(child_compile.ENV_SWITCH, "0")
    assert _launch(kernel) == (0, 1)


def test_a_failed_child_warns_and_the_kernel_compiles_in_this_process(kernel, monkeypatch):
    monkeypatch.setenv("ATTNGRAD_TEST_BREAK_CHILD", "1")
    with pytest.warns(RuntimeWarning, match="add_one compiles in this process.*status 3"):
        assert _launch(kernel) == (0, 1)


def test_a_held_compile_lock_times_out_into_a_compile_in_this_process(kernel, monkeypatch):
    monkeypatch.setattr(child_compile, "TIMEOUT_S", 0.3)
    signature = (typeof(np.zeros(1)).copy(layout="A"),) * 2
    fd = os.open(child_compile.compile_lock_path(kernel, signature), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process compiling the same specialisation
        with pytest.warns(RuntimeWarning, match="held the compile lock"):
            assert _launch(kernel) == (0, 1)
    finally:
        os.close(fd)


_BITS = """
import hashlib, json, torch, attngrad
from attngrad.kernels.scaled_masked_softmax import _backward_kernel, _backward_worker
torch.manual_seed(0)
y, mask = torch.softmax(torch.randn(2, 4, 64, 128), -1), torch.rand(2, 1, 64, 128) > 0.8
dx = attngrad.scaled_masked_softmax_backward(torch.randn_like(y), y, mask, 0.7)
misses = sum(sum(f.stats.cache_misses.values()) for f in (_backward_kernel, _backward_worker))
print(json.dumps([hashlib.sha256(dx.numpy().tobytes()).hexdigest(), misses]))
"""


def test_a_process_with_an_empty_cache_gets_the_bits_of_the_next_process(tmp_path):
    """fp32 ScaledMaskedSoftmaxBackward differs in the last bits where the calling process compiles it itself."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), child_compile.ENV_SWITCH: "1"}

    def run():
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_BITS)], capture_output=True, text=True,
                              env=env, timeout=600, check=True)
        return json.loads(proc.stdout.splitlines()[-1])

    cold, cached = run(), run()
    assert cold == cached and cold[1] == 0  # same bits; neither process compiled the kernel itself
