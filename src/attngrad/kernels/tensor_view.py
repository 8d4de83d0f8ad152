"""Zero-copy numpy views of torch tensors in the element types the numba kernels expect.

float32 -> float32, bfloat16 -> uint16 (raw bits), float16 -> int16 (raw bits), bool/uint8 -> uint8.
Strides (including the zero strides of ``expand``) are kept, so kernels read non-contiguous and
broadcast inputs in place.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch


_KERNEL_DTYPES = {torch.bfloat16: torch.uint16, torch.float16: torch.int16, torch.bool: torch.uint8}


def kernel_view(t: torch.Tensor) -> np.ndarray:
    """t's data as a numpy array of the kernels' element type (one view, no copy: it runs on every call).

    Detaches only a tensor that requires grad (``numpy()`` refuses those): each torch op costs a few microseconds
    when the call starts with cold caches, as the memory-bound benchmarks' calls do."""
    if t.requires_grad:
        t = t.detach()
    kernel_dtype = _KERNEL_DTYPES.get(t.dtype)
    return (t if kernel_dtype is None else t.view(kernel_dtype)).numpy()


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (or of size 1), else a contiguous copy: for kernels that read
    rows as contiguous runs (row addresses, vector loads)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _load_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):  # not Linux/glibc: plain allocation
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise() if sys.platform.startswith("linux") else None


def new_output(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised output tensor for a memory-bound kernel.

    A large fresh tensor is new ``mmap`` memory whose first write page-faults every 4 KiB page, which costs
    more than the kernel that fills it. Where the kernel allows transparent huge pages on request
    (``madvise`` mode, the default of many distributions), the 2 MiB-aligned body of the buffer is advised
    ``MADV_HUGEPAGE``, so it faults in 2 MiB at a time. The advice only changes how pages are backed.
    """
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if _madvise is not None and nbytes >= 4 * _HUGE_PAGE:
        start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (t.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        _madvise(start, end - start, _MADV_HUGEPAGE)
    return t
