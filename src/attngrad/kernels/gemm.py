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

Matrices are row-major and addressed by raw pointers (``int`` addresses, e.g. ``a.ctypes.data`` plus an
offset in bytes) with leading dimensions in elements.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import sys
from pathlib import Path

import numpy as np
from llvmlite import binding as llvm
from numba import njit, types
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
    llvm.load_library_permanently(path)  # numba resolves the cblas symbols by name: cacheable kernels
    return lib


_LIB = _load()
_SIGNATURE = types.void(*(types.int32,) * 6, types.float32, types.intp, types.int32, types.intp, types.int32,
                        types.float32, types.intp, types.int32)
_ROUTINES = {types.uint16: types.ExternalFunction("cblas_gemm_bf16bf16f32", _SIGNATURE),
             types.int16: types.ExternalFunction("cblas_gemm_f16f16f32", _SIGNATURE),
             types.float32: types.ExternalFunction("cblas_sgemm", _SIGNATURE)}


def gemm(a_like, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):  # pragma: no cover
    """C[m,n] (fp32) = alpha * op(A) op(B) + beta * C; A and B have the element type of ``a_like``."""
    raise NotImplementedError


@overload(gemm, inline="always")
def _gemm_impl(a_like, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    routine = _ROUTINES.get(a_like.dtype)
    if routine is None:
        return None

    def impl(a_like, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        routine(ROW_MAJOR, trans_a, trans_b, m, n, k, np.float32(alpha), a, lda, b, ldb, np.float32(beta), c, ldc)

    return impl


@njit(cache=True)
def _gemm_for_test(a, b, c, trans_b):  # used by the tests and as a smoke check of the binding
    m, k = a.shape
    n = c.shape[1]
    gemm(a, NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data,
         b.shape[1], 0.0, c.ctypes.data, n)
