"""Zero-copy numpy views of torch tensors in the element types the numba kernels expect.

float32 -> float32, bfloat16 -> uint16 (raw bits), float16 -> int16 (raw bits), bool/uint8 -> uint8.
Strides (including the zero strides of ``expand``) are kept, so kernels read non-contiguous and
broadcast inputs in place.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import weakref
from collections import OrderedDict

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
_POOLED_BYTES = 1 << 20  # outputs from this size up come from the pool (and are advised huge pages): torch.empty
# of 1-16 MiB returned fresh pages on most calls (docs/performance.md, 'Flash attention outputs from the pool')


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


def _pool_limit() -> int:
    """Bytes of freed output buffers the pool keeps: ``ATTNGRAD_OUTPUT_POOL_MB`` (default 1024; 0 turns it off)."""
    text = os.environ.get("ATTNGRAD_OUTPUT_POOL_MB", "1024")
    try:
        megabytes = float(text)
    except ValueError:
        raise ValueError(f"ATTNGRAD_OUTPUT_POOL_MB must be a number of MiB (0: no pool), got {text!r}") from None
    return max(0, int(megabytes * 2**20))


class OutputPool:
    """Reuses the memory of large outputs once their tensors are freed.

    A fresh buffer of many MiB is new ``mmap`` memory: its first write faults in and zeroes every page, which
    costs about as much as a memory-bound kernel that fills it. The pool hands out blocks of whole 2 MiB pages
    (advised ``MADV_HUGEPAGE`` where the kernel offers transparent huge pages on request) as tensors that own
    them; when such a tensor and all its views are gone, its block goes back to the pool, up to ``limit`` bytes
    of free blocks (the oldest are released first), so a loop that frees last step's output before the next
    call reuses memory that is already mapped. As with torch's CUDA caching allocator, memory freed by the user
    stays with the process (at most ``limit`` bytes of it)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict[int, OrderedDict[int, np.ndarray]] = {}  # block size -> {id: free block}, oldest first
        self._order: OrderedDict[int, np.ndarray] = OrderedDict()  # every free block, oldest first
        self._free_bytes = 0
        self._lock = threading.RLock()  # a release can run inside a take (the garbage collector)

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised C-contiguous tensor on a pooled block."""
        numel = math.prod(shape)
        size = -(-numel * dtype.itemsize // _HUGE_PAGE) * _HUGE_PAGE
        block = self._take(size)
        handed = block[:]  # the tensor's own reference: when it dies the block is released
        weakref.finalize(handed, self._release, block)
        return torch.empty(0, dtype=dtype).set_(torch.from_numpy(handed).untyped_storage(), 0, shape)

    def clear(self) -> None:
        """Release every free block to the system."""
        with self._lock:
            self._free.clear()
            self._order.clear()
            self._free_bytes = 0

    def _take(self, size: int) -> np.ndarray:
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                key, block = blocks.popitem()  # the most recently freed: its pages may still be cached
                del self._order[key]
                self._free_bytes -= size
                return block
        return _huge_page_block(size)

    def _release(self, block: np.ndarray) -> None:
        size = block.nbytes
        with self._lock:
            if size > self.limit:
                return
            self._free.setdefault(size, OrderedDict())[id(block)] = block
            self._order[id(block)] = block
            self._free_bytes += size
            while self._free_bytes > self.limit:
                key, oldest = self._order.popitem(last=False)
                del self._free[oldest.nbytes][key]
                self._free_bytes -= oldest.nbytes


def aligned_bytes(size: int, alignment: int) -> np.ndarray:
    """``size`` uninitialised bytes starting on an ``alignment`` boundary (numpy's buffers start anywhere; the
    numba kernels' scratch has its own :func:`.numeric.aligned_empty`)."""
    raw = np.empty(size + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + size]


def _huge_page_block(size: int) -> np.ndarray:
    """``size`` bytes (a multiple of 2 MiB) starting on a 2 MiB boundary, advised ``MADV_HUGEPAGE``."""
    block = aligned_bytes(size, _HUGE_PAGE)
    if _madvise is not None:
        _madvise(block.ctypes.data, size, _MADV_HUGEPAGE)
    return block


output_pool = OutputPool(_pool_limit())


def new_output(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised C-contiguous output tensor for a memory-bound kernel: from :data:`output_pool` when it
    is large (1 MiB or more, while the pool is on), else from torch."""
    if output_pool.limit and math.prod(shape) * dtype.itemsize >= _POOLED_BYTES:
        return output_pool.tensor(shape, dtype)
    return torch.empty(shape, dtype=dtype)
