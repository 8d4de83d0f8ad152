"""MKL mixed-precision GEMMs callable from numba nopython code: ``gemm(...)`` with fp32 output C.

Routes by the element type of the kernel views (see :mod:`.tensor_view`):

* bfloat16 (``uint16`` bits): ``cblas_gemm_bf16bf16f32``: bf16 A, B, fp32 accumulation and fp32 C (AMX).
* float16 (``int16`` bits): ``cblas_gemm_f16f16f32``.
* float32: ``cblas_sgemm``.

torch's bf16 GEMM rounds its output to bf16, too coarse for the logits S = QK^T that CANN keeps in fp32;
these MKL routines do not. ``libmkl_rt`` comes with the ``mkl`` PyPI package; it is located through the
package's file list (fallback: ``<sys.prefix>/lib``). MKL runs single-threaded (sequential threading
layer): the kernels call it from their own numba worker threads, one GEMM per worker, so MKL, numba and
torch never oversubscribe the cores.

Matrices are row-major, each passed as an ``(address, leading dimension)`` pair: a raw pointer (an ``int``, e.g.
``a.ctypes.data`` plus an offset in bytes) and the row stride in elements; an ``accumulate`` flag chooses
C = op(A) op(B) or C += op(A) op(B).

``brgemm`` is torch's own micro-kernel entry (``at::native::cpublas::brgemm``, the one of torch's CPU flash
attention, exported by ``libtorch_cpu``; oneDNN's brgemm): A ``[m, k]`` times B ``[k, n]``, fp32 C; bfloat16 (AMX,
else AVX512-BF16 ``vdpbf16ps``) with B pre-packed in the VNNI layout (``B[k, n]`` stored at ``[k // 2, n, k % 2]``,
i.e. row pairs interleaved), float32 with B as it is. Packed once and reused, B costs nothing per call, where MKL
repacks it on every call (and, on AMD EPYC, runs bf16 without the AVX512-BF16 instructions). Caveat (AMX):
interleaving it with MKL's AMX GEMMs in one thread slows MKL's calls, so a kernel should use one or the other.
``BRGEMM_DTYPES`` says which dtypes it serves (float32 where torch exports it, bfloat16 on CPUs with AMX-BF16 or
AVX512-BF16); callers fall back to ``gemm``.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import sys
from pathlib import Path

import numpy as np
import torch
from llvmlite import binding as llvm
from numba import njit, types
from numba.core import config
from numba.core.codegen import get_host_cpu_features
from numba.extending import overload

ROW_MAJOR = 101
NO_TRANS = 111
TRANS = 112
_MKL_THREADING_SEQUENTIAL = 1


def _mkl_rt_path() -> Path:
    try:
        for f in importlib.metadata.distribution("mkl").files or ():
            if f.name.startswith("libmkl_rt.so"):
                return Path(f.locate()).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates = sorted((Path(sys.prefix) / "lib").glob("libmkl_rt.so*"))
    if not candidates:
        raise ImportError("attngrad needs MKL's libmkl_rt (PyPI package 'mkl'); it was not found")
    return candidates[0]


def _load() -> ctypes.CDLL:
    path = str(_mkl_rt_path())
    lib = ctypes.CDLL(path)
    lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    lib.MKL_Set_Threading_Layer.restype = ctypes.c_int
    lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
    for name in ("cblas_gemm_bf16bf16f32", "cblas_gemm_f16f16f32", "cblas_sgemm"):
        _bind_symbol(lib, name)
    return lib


def _bind_symbol(lib: ctypes.CDLL, name: str) -> None:
    """Resolve ``name`` in numba's code (compiled or loaded from the cache) to this library's function, whatever
    other library also exports it (libtorch_cpu carries its own, OpenMP-threaded, MKL)."""
    llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)


_LIB = _load()
_SIGNATURE = types.void(*(types.int32,) * 6, types.float32, types.intp, types.int32, types.intp, types.int32,
                        types.float32, types.intp, types.int32)
_ROUTINES = {types.uint16: types.ExternalFunction("cblas_gemm_bf16bf16f32", _SIGNATURE),
             types.int16: types.ExternalFunction("cblas_gemm_f16f16f32", _SIGNATURE),
             types.float32: types.ExternalFunction("cblas_sgemm", _SIGNATURE)}


def gemm(a_like, trans_a, trans_b, m, n, k, a, b, c, accumulate):  # pragma: no cover
    """C[m,n] (fp32) (+)= op(A) op(B) (``accumulate``: add to C, else overwrite it); a, b, c are ``(address,
    leading dim)`` pairs, op(A) ``[m, k]`` and op(B) ``[k, n]``; A and B have the element type of ``a_like``."""
    raise NotImplementedError


@overload(gemm, inline="always")
def _gemm_impl(a_like, trans_a, trans_b, m, n, k, a, b, c, accumulate):
    routine = _ROUTINES.get(a_like.dtype)
    if routine is None:
        return None

    def impl(a_like, trans_a, trans_b, m, n, k, a, b, c, accumulate):
        beta = np.float32(accumulate)  # 1 or 0: a branch here would leave its phi outside numba's inlined scope
        routine(ROW_MAJOR, trans_a, trans_b, m, n, k, np.float32(1.0), a[0], a[1], b[0], b[1], beta, c[0], c[1])

    return impl


@njit(cache=True)
def _gemm_for_test(a, b, c, trans_b):  # used by the tests and as a smoke check of the binding
    m, k = a.shape
    n = c.shape[1]
    gemm(a, NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k, (a.ctypes.data, k), (b.ctypes.data, b.shape[1]),
         (c.ctypes.data, n), False)


_BRGEMM_SYMBOL = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"
_BRGEMM_F32_SYMBOL = "_ZN2at6native7cpublas6brgemmEllllllbPKfS3_Pfb"
_BRGEMM_F16_SYMBOL = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c104HalfES5_Pfb"  # bound, not served (see below)
_RELEASE_SYMBOL = "_ZN2at6native7cpublas14brgemm_releaseEb"
_BRGEMM_STUB_TYPE = ctypes.CFUNCTYPE(None, *(ctypes.c_int64,) * 6, ctypes.c_bool, *(ctypes.c_void_p,) * 3,
                                     ctypes.c_bool)
# no-op stand-ins bound where torch lacks the symbols: every kernel must link, even if it never takes that path
_STUBS = {_BRGEMM_SYMBOL: _BRGEMM_STUB_TYPE(lambda *args: None),
          _BRGEMM_F32_SYMBOL: _BRGEMM_STUB_TYPE(lambda *args: None),
          _BRGEMM_F16_SYMBOL: _BRGEMM_STUB_TYPE(lambda *args: None),
          _RELEASE_SYMBOL: ctypes.CFUNCTYPE(None, ctypes.c_bool)(lambda *args: None)}


def _load_brgemm() -> frozenset:
    """Bind the brgemm symbols (torch's, else the stubs); the torch dtypes they serve: float32 where torch
    exports them, bfloat16 too on a CPU with AMX-BF16 or AVX512-BF16."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        for name in _STUBS:
            _bind_symbol(lib, name)
    except (OSError, AttributeError):
        for name, stub in _STUBS.items():
            llvm.add_symbol(name, ctypes.cast(stub, ctypes.c_void_p).value)
        return frozenset()
    features = (config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()).split(",")
    bf16 = "+amx-bf16" in features or "+avx512bf16" in features
    return frozenset((torch.float32, torch.bfloat16) if bf16 else (torch.float32,))


BRGEMM_DTYPES = _load_brgemm()
_i64 = types.int64
_BRGEMM_SIGNATURE = types.void(_i64, _i64, _i64, _i64, _i64, _i64, types.boolean, types.intp, types.intp, types.intp,
                               types.boolean)
_BRGEMMS = {types.uint16: (types.ExternalFunction(_BRGEMM_SYMBOL, _BRGEMM_SIGNATURE), True),
            types.float32: (types.ExternalFunction(_BRGEMM_F32_SYMBOL, _BRGEMM_SIGNATURE), False),
            types.int16: (types.ExternalFunction(_BRGEMM_F16_SYMBOL, _BRGEMM_SIGNATURE), True)}
_release = types.ExternalFunction(_RELEASE_SYMBOL, types.void(types.boolean))


def brgemm(a_like, m, n, k, a, b, c, accumulate):  # pragma: no cover
    """C[m,n] (fp32) (+)= A[m,k] B[k,n] (a, b, c: ``(address, leading dim)`` pairs; B's is n's stride), A and B of
    ``a_like``'s element type: bfloat16 (float16 likewise: it compiles in the kernels shared by all dtypes, but
    float16 is not in ``BRGEMM_DTYPES``: it needs AMX-FP16) with B VNNI-packed (a pair as one uint32), or float32
    with B as it is."""
    raise NotImplementedError


@overload(brgemm, inline="always")
def _brgemm_impl(a_like, m, n, k, a, b, c, accumulate):
    routine, vnni = _BRGEMMS.get(a_like.dtype, (None, False))
    if routine is None:
        return None

    def impl(a_like, m, n, k, a, b, c, accumulate):
        routine(m, n, k, a[1], b[1], c[1], accumulate, a[0], b[0], c[0], vnni)

    return impl


@njit(inline="always")
def brgemm_release():
    """Release the AMX state of the calling thread (after its last ``brgemm`` of a task; a no-op without AMX)."""
    _release(True)
