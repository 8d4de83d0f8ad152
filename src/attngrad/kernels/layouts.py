"""One compiled specialisation of a kernel per dtype combination, whatever the layouts of its array arguments.

numba compiles a kernel once per tuple of argument types, and an array's type records its layout: C-contiguous
(``'C'``) or any strides (``'A'``). A kernel that reads some views in place (transposed or expanded inputs,
strided outputs of the aclnn layer) would otherwise compile again for each combination of contiguous and strided
arguments (up to a minute each). :func:`launch_strided` calls a kernel with every array typed ``'A'`` (except
the arguments it is told to type exactly), so a kernel has one specialisation per dtype combination.

For kernels whose results do not depend on those types: their loops over rows read C-contiguous row views made
from the rows' addresses (:func:`.numeric.array_at`), which LLVM vectorises the same whatever the strides, where
indexing ``'A'`` arrays in the loop would vectorise some fast-math row reductions differently. ExpSegsum launches
through :func:`strided_layout`; ScaledMaskedSoftmax and flash attention's two tile kernels through
:func:`launch_workers` (flash attention's plan typed exactly), which compiles a thread's worker the same way; the
tests compare strided and contiguous calls bit for bit.

A specialisation new to the process is loaded from numba's disk cache, after a child process has compiled it
there if needed (:mod:`.child_compile`): code compiled in the calling process differs in the last bits and is
slower. ``ATTNGRAD_COMPILE_IN_CHILD=0`` compiles in the calling process instead.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import typeof, types
from numba._dispatcher import compute_fingerprint

from .child_compile import compile_cached
from .threads import kernel_threads, native_address


def _strided(ty: types.Type) -> types.Type:
    """``ty`` with every array type (also inside tuples and namedtuples) given the any-strides layout ``'A'``."""
    if isinstance(ty, types.Array):
        return ty.copy(layout="A")
    if isinstance(ty, (types.NamedTuple, types.NamedUniTuple)):
        return types.BaseTuple.from_types([_strided(t) for t in ty.types], ty.instance_class)
    if isinstance(ty, types.BaseTuple):
        return types.BaseTuple.from_types([_strided(t) for t in ty.types])
    return ty


_entry_points: dict = {}
_worker_addresses: dict = {}


def strided_signature(args: tuple, exact: tuple[int, ...] = ()) -> tuple:
    """The numba signature :func:`launch_strided` compiles for ``args``: every array typed ``'A'`` (also inside tuples
    and namedtuples) except the arguments at the positions in ``exact``, typed as numba types them."""
    return tuple(typeof(a) if i in exact else _strided(typeof(a)) for i, a in enumerate(args))


def launch_strided(kernel, *args, exact: tuple[int, ...] = ()):
    """Call the numba dispatcher ``kernel`` compiled for :func:`strided_signature` of its arguments: one
    specialisation per combination of dtypes whatever the layouts. For kernels that loop over rows through
    C-contiguous row views (:func:`.numeric.array_at`): their results then do not depend on the typing. A new
    specialisation compiles in a child process and loads from numba's disk cache
    (:func:`.child_compile.compile_cached`)."""
    key = (kernel, exact, *map(compute_fingerprint, args))  # numba's own type key of a value: a microsecond
    entry = _entry_points.get(key)
    if entry is None:
        entry = _entry_points[key] = compile_cached(kernel, strided_signature(args, exact))
    return entry(*args)


def launch_workers(kernel, worker, *args, exact: tuple[int, ...] = ()):
    """``kernel(address, *args, counter, threads)``: a parallel kernel that runs the numba dispatcher ``worker(*args,
    counter)`` once on each of its ``threads`` (:func:`.threads.kernel_threads`) through the worker's address
    (:func:`.threads.call_native`); ``counter`` is an int64 ``[1]`` zero that the threads share to claim tasks
    (:func:`.threads.claim`). Both are compiled as :func:`launch_strided` compiles a kernel (``exact``: positions in
    ``args``), the worker on its own: its code is not compiled again into the kernel's."""
    args = (*args, np.zeros(1, np.int64))
    key = (worker, exact, *map(compute_fingerprint, args))
    address = _worker_addresses.get(key)
    if address is None:
        signature = strided_signature(args, exact)
        launch = (0, *args, kernel_threads())
        compile_cached(worker, signature, companions=((kernel, strided_signature(launch, _after_address(exact))),))
        address = _worker_addresses[key] = native_address(worker, signature)
    return launch_strided(kernel, address, *args, kernel_threads(), exact=_after_address(exact))


def _after_address(exact: tuple[int, ...]) -> tuple[int, ...]:
    """Positions ``exact`` in a worker's arguments as positions in its kernel's, which start with the address."""
    return tuple(i + 1 for i in exact)


def strided_layout(kernel):
    """Decorator form of :func:`launch_strided` for a numba dispatcher (positional arguments, none typed exactly)."""

    @functools.wraps(kernel)
    def run(*args):
        return launch_strided(kernel, *args)

    run.dispatcher = kernel
    return run
