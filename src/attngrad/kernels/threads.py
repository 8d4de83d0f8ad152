"""The numba kernels run on torch's thread count: ``torch.get_num_threads()`` at call time.

So ``torch.set_num_threads`` (and ``OMP_NUM_THREADS``, which sets torch's count at start-up) governs attngrad as
it governs torch: a data-loader worker or one process per rank that limits torch limits attngrad too. The count
is capped by numba's pool, which numba starts with ``NUMBA_NUM_THREADS`` threads (default: the machine's cores,
whatever ``OMP_NUM_THREADS`` says, so a later ``torch.set_num_threads`` can raise the count up to the cores).

:func:`on_torch_threads` wraps a kernel's launch: numba's count of the calling thread (a per-thread setting) is set
to torch's for the call and restored after it. MKL is unaffected: the kernels call it single-threaded from their
numba workers (:mod:`.gemm`). Every kernel's results are the same bits for any thread count (their task splits
depend on the shapes only).

Tasks of unequal cost (flash attention's) are handed out one at a time by :func:`claim`: a ``prange`` loop gives
each thread a fixed, contiguous share of its iterations (numba's OpenMP and workqueue layers schedule statically,
whatever ``numba.set_parallel_chunksize`` says), so a kernel runs one loop iteration per thread (``prange(workers)``,
``workers = kernel_threads()`` passed in: numba's ``get_num_threads`` in compiled code keeps a kernel out of the disk
cache) and each of them claims tasks from a shared counter until none is left.

The code such a thread runs is a function compiled on its own (a worker), which the parallel kernel calls through
its address (:func:`call_native`, :func:`native_address`, launched by :func:`.layouts.launch_workers`): numba would
otherwise link the worker's code into the kernel's and its parallel loop's modules and compile it there again.
"""

from __future__ import annotations

import functools

import numba
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc import parallel as _parallel


def kernel_threads() -> int:
    """The thread count of a kernel launched now: torch's, within ``[1, NUMBA_NUM_THREADS]``."""
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


@functools.cache
def _count_functions():
    """numba's getter and setter of the calling thread's count: the threading layer's own functions (numba's
    public ``get_num_threads`` / ``set_num_threads`` re-check the pool on every call, 2-3 us each) where numba
    exposes them, else the public ones. Starts numba's pool, keeping torch's count: with numba's OpenMP layer the
    start sets the OpenMP runtime's count to numba's pool size, and torch reads its count from that runtime (a
    ``torch.set_num_threads(1)`` before the first kernel would otherwise be undone)."""
    torch_threads = torch.get_num_threads()
    _parallel._launch_threads()
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    return (getattr(_parallel, "_get_num_threads", numba.get_num_threads),
            getattr(_parallel, "_set_num_threads", numba.set_num_threads))


def on_torch_threads(launch):
    """Decorator: ``launch`` (a kernel or the Python function that launches kernels) runs with numba's count of the
    calling thread set to :func:`kernel_threads`, restored afterwards."""

    @functools.wraps(launch)
    def run(*args, **kwargs):
        get_count, set_count = _count_functions()
        threads, previous = kernel_threads(), get_count()
        if threads == previous:
            return launch(*args, **kwargs)
        set_count(threads)
        try:
            return launch(*args, **kwargs)
        finally:
            set_count(previous)

    return run


@intrinsic
def _fetch_increment(typingctx, address):
    """Atomically add 1 to the int64 at an integer address; the value before."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        counter = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(address), codegen


@njit(inline="always")
def claim(counter):
    """The next task of a launch, ``counter[0]`` (an int64 array shared by its threads, starting at 0), counted up
    atomically: every task goes to exactly one thread, the next free one."""
    return _fetch_increment(counter.ctypes.data)


@intrinsic
def call_native(typingctx, address, args):
    """Call the numba function whose native entry point is at the integer ``address`` (:func:`native_address`) with
    the members of the tuple ``args``, which must have the types it was compiled for; it returns nothing. The
    callee's code is not linked into the caller's."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None

    def codegen(context, builder, signature, llargs):
        values = [builder.extract_value(llargs[1], i) for i in range(len(args))]
        function = context.call_conv.get_function_type(types.none, list(args))
        callee = builder.inttoptr(llargs[0], function.as_pointer())
        status, _ = context.call_conv.call_function(builder, callee, types.none, list(args), values)
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return types.none(address, args), codegen


def native_address(dispatcher, signature: tuple) -> int:
    """The address of the native entry point of numba ``dispatcher``'s specialisation ``signature`` (compiled or
    loaded already), which must return nothing: what :func:`call_native` calls."""
    result = dispatcher.overloads[tuple(signature)]
    if result.signature.return_type != types.none:
        raise TypeError(f"{dispatcher.py_func.__qualname__} must return nothing to be called by address")
    address = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"{dispatcher.py_func.__qualname__}: no native entry point in its compiled code")
    return address
