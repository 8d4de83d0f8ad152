"""One compiled specialisation of a kernel for every mix of contiguous and strided array arguments.

numba compiles a kernel once per tuple of argument types, and an array's type records its layout: C-contiguous
(``'C'``) or any strides (``'A'``). A kernel that reads some views in place (transposed or expanded inputs,
strided outputs of the aclnn layer) would otherwise compile again for each combination of contiguous and strided
arguments (up to a minute each). :func:`launch` calls a kernel as numba types it when every array is
C-contiguous (the fast common case) and otherwise with every array typed ``'A'``, so a kernel has at most two
specialisations per dtype combination.

Only for kernels whose results do not depend on those types: ExpSegsum (its tests compare strided and contiguous
calls bit for bit). Flash attention keeps numba's per-layout specialisations: typed ``'A'``, LLVM vectorises some
of its fast-math row reductions differently, so strided and contiguous calls would round differently where they
now give the same bits (wherever its GEMMs' order does not depend on the operands' placement, as on torch's
float32 brgemm). ScaledMaskedSoftmax reads every row through a C-contiguous row view, so :func:`launch_strided`
gives it one specialisation per dtype combination, and strided calls the bits of contiguous ones.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import typeof, types
from numba._dispatcher import compute_fingerprint


def _all_c_contiguous(value) -> bool:
    """True when every array in ``value`` (an array, a tuple / namedtuple of them, or a scalar) is C-contiguous."""
    if isinstance(value, np.ndarray):
        return value.flags.c_contiguous
    if isinstance(value, tuple):
        return all(_all_c_contiguous(v) for v in value)
    return True


def _strided(ty: types.Type) -> types.Type:
    """``ty`` with every array type (also inside tuples and namedtuples) given the any-strides layout ``'A'``."""
    if isinstance(ty, types.Array):
        return ty.copy(layout="A")
    if isinstance(ty, (types.NamedTuple, types.NamedUniTuple)):
        return types.BaseTuple.from_types([_strided(t) for t in ty.types], ty.instance_class)
    if isinstance(ty, types.BaseTuple):
        return types.BaseTuple.from_types([_strided(t) for t in ty.types])
    return ty


def launch(kernel, *args):
    """Call the numba dispatcher ``kernel`` with ``args`` (positional), typed as described in the module docstring."""
    if _all_c_contiguous(args):
        return kernel(*args)
    return kernel.compile(tuple(_strided(typeof(a)) for a in args))(*args)


_entry_points: dict = {}


def launch_strided(kernel, *args, exact: tuple[int, ...] = ()):
    """Call the numba dispatcher ``kernel`` with the arrays of every argument typed ``'A'`` (also inside tuples and
    namedtuples) except the arguments at the positions in ``exact``, typed as numba types them: one specialisation
    per combination of dtypes whatever the layouts. For kernels that loop over rows through C-contiguous row views
    (:func:`.numeric.array_at`): their results then do not depend on the typing."""
    key = (kernel, exact, *map(compute_fingerprint, args))  # numba's own type key of a value: a microsecond
    entry = _entry_points.get(key)
    if entry is None:
        signature = tuple(typeof(a) if i in exact else _strided(typeof(a)) for i, a in enumerate(args))
        entry = _entry_points[key] = kernel.compile(signature)
    return entry(*args)


def uniform_layout(kernel):
    """Decorator form of :func:`launch` for a numba dispatcher (positional arguments only)."""

    @functools.wraps(kernel)
    def run(*args):
        return launch(kernel, *args)

    run.dispatcher = kernel
    return run
