"""Host stand-ins for the AscendCL runtime: data types, memory, tensors, streams, error messages.

The "device" is the host CPU. Device memory is a torch ``uint8`` buffer; an :class:`AclTensor` is a
view (dims, element strides, element offset) over such a storage, exactly as ``aclCreateTensor``
describes one, so non-contiguous views port line by line from C++.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS, AclnnError

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000

# aclDataType (CANN numbering)
ACL_FLOAT, ACL_FLOAT16, ACL_INT8, ACL_INT32, ACL_UINT8 = 0, 1, 2, 3, 4
ACL_INT16, ACL_UINT16, ACL_UINT32, ACL_INT64, ACL_UINT64 = 6, 7, 8, 9, 10
ACL_DOUBLE, ACL_BOOL, ACL_BF16 = 11, 12, 27

# aclFormat
ACL_FORMAT_NCHW, ACL_FORMAT_NHWC, ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 0, 1, 2, 29

# aclrtMemcpyKind and malloc policy
ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE = 0, 1
ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE = 2, 3
ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY, ACL_MEM_MALLOC_NORMAL_ONLY = 0, 1, 2

_TORCH_DTYPES = {
    ACL_FLOAT: torch.float32, ACL_FLOAT16: torch.float16, ACL_INT8: torch.int8, ACL_INT32: torch.int32,
    ACL_UINT8: torch.uint8, ACL_INT16: torch.int16, ACL_UINT16: torch.uint16, ACL_UINT32: torch.uint32,
    ACL_INT64: torch.int64, ACL_UINT64: torch.uint64, ACL_DOUBLE: torch.float64, ACL_BOOL: torch.bool,
    ACL_BF16: torch.bfloat16,
}
_ACL_DTYPES = {v: k for k, v in _TORCH_DTYPES.items()}

_state = threading.local()


def record_error(message: str) -> None:
    _state.message = message


def aclGetRecentErrMsg() -> str:
    """Message of the last failure on this thread ("" when none)."""
    return getattr(_state, "message", "")


# --- device, context, stream: the host needs no set-up; these keep the C call sequence intact ---
def aclInit(config_path=None) -> int:
    return ACL_SUCCESS


def aclFinalize() -> int:
    return ACL_SUCCESS


def aclrtSetDevice(device_id: int) -> int:
    return ACL_SUCCESS


def aclrtResetDevice(device_id: int) -> int:
    return ACL_SUCCESS


class AclrtStream:
    """Work runs synchronously on the host, so a stream has nothing to queue."""


def aclrtCreateStream():
    """Returns ``(status, stream)``."""
    return ACL_SUCCESS, AclrtStream()


def aclrtSynchronizeStream(stream) -> int:
    return ACL_SUCCESS


def aclrtDestroyStream(stream) -> int:
    return ACL_SUCCESS


# --- memory ---
class DevicePtr:
    """A block of "device" memory: ``size`` bytes held in a torch uint8 buffer."""

    def __init__(self, size: int):
        self.buffer = torch.zeros(size, dtype=torch.uint8)
        self.freed = False

    @property
    def size(self) -> int:
        return self.buffer.numel()

    def __repr__(self) -> str:
        return f"DevicePtr(size={self.size})"


def aclrtMalloc(size: int, policy: int = ACL_MEM_MALLOC_HUGE_FIRST):
    """Returns ``(status, DevicePtr)``; the C out-pointer becomes the second element."""
    if not isinstance(size, (int, np.integer)) or size < 0:
        record_error(f"aclrtMalloc: size must be a non-negative integer, got {size!r}")
        return ACL_ERROR_INVALID_PARAM, None
    return ACL_SUCCESS, DevicePtr(int(size))


def aclrtFree(ptr: DevicePtr) -> int:
    if isinstance(ptr, DevicePtr):
        ptr.freed = True
        ptr.buffer = torch.zeros(0, dtype=torch.uint8)
    return ACL_SUCCESS


def _as_bytes(obj) -> torch.Tensor:
    """A writable byte view of a DevicePtr or host buffer (numpy array, torch tensor, bytearray)."""
    if isinstance(obj, DevicePtr):
        return obj.buffer
    if isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise TypeError("host tensor must be contiguous")
        return obj.detach().view(-1).view(torch.uint8) if obj.numel() else obj.new_zeros(0, dtype=torch.uint8)
    array = obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, dtype=np.uint8)
    if not array.flags.c_contiguous:
        raise TypeError("host array must be C-contiguous")
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


def aclrtMemcpy(dst, dst_size: int, src, count: int, kind: int) -> int:
    """Copy ``count`` bytes from ``src`` to ``dst`` (either a DevicePtr or a host buffer)."""
    try:
        d, s = _as_bytes(dst), _as_bytes(src)
    except (TypeError, ValueError) as exc:
        record_error(f"aclrtMemcpy: {exc}")
        return ACL_ERROR_INVALID_PARAM
    if count < 0 or count > dst_size or count > d.numel() or count > s.numel():
        record_error(f"aclrtMemcpy: count {count} exceeds dst_size {dst_size}, dst {d.numel()} "
                     f"or src {s.numel()} bytes")
        return ACL_ERROR_INVALID_PARAM
    d[:count].copy_(s[:count])
    return ACL_SUCCESS


# --- tensors ---
@dataclass
class AclTensor:
    """An aclTensor: a strided view (element strides and offset) over a storage."""

    view_dims: tuple
    data_type: int
    strides: tuple
    offset: int
    format: int
    storage_dims: tuple
    storage: object  # DevicePtr, or a torch tensor when wrapped with from_torch
    _torch: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_torch(cls, t: torch.Tensor, fmt: int = ACL_FORMAT_ND) -> "AclTensor":
        """Wrap a torch tensor (any strides) without copying."""
        if t.dtype not in _ACL_DTYPES:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"from_torch: unsupported dtype {t.dtype}")
        return cls(tuple(t.shape), _ACL_DTYPES[t.dtype], tuple(t.stride()), t.storage_offset(), fmt,
                   (t.untyped_storage().nbytes() // max(t.element_size(), 1),), t, t)

    @property
    def dtype(self) -> torch.dtype | None:
        return _TORCH_DTYPES.get(self.data_type)

    def to_torch(self, name: str = "tensor") -> torch.Tensor:
        """The torch view this tensor describes; 161002 when the view leaves its storage."""
        if self._torch is not None:
            return self._torch
        dtype = self.dtype
        if dtype is None:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{name}: unknown aclDataType {self.data_type}", name)
        if not isinstance(self.storage, DevicePtr) or self.storage.freed:
            raise AclnnError(ACLNN_ERR_PARAM_NULLPTR, f"{name}: storage is null or freed", name)
        described = (*self.view_dims, *self.strides, self.offset)
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in described):
            raise AclnnError(ACLNN_ERR_PARAM_INVALID, f"{name}: view dims, strides and offset must be integers, "
                             f"got {list(self.view_dims)}, {list(self.strides)}, {self.offset!r}", name)
        if len(self.view_dims) != len(self.strides) or any(d < 0 for d in self.view_dims) \
                or any(s < 0 for s in self.strides) or self.offset < 0:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                             f"{name}: view dims {list(self.view_dims)}, strides {list(self.strides)} and "
                             f"offset {self.offset} must be non-negative and of equal rank", name)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        capacity = self.storage.size // itemsize
        numel = math.prod(int(d) for d in self.view_dims)  # Python ints: no int64 wrap-around
        last = self.offset + sum((d - 1) * s for d, s in zip(self.view_dims, self.strides)) if numel else 0
        if numel and last >= capacity:
            raise AclnnError(ACLNN_ERR_PARAM_INVALID,
                             f"{name}: view (dims {list(self.view_dims)}, strides {list(self.strides)}, offset "
                             f"{self.offset}) reaches element {last} but storage holds {capacity}", name)
        flat = self.storage.buffer[: capacity * itemsize].view(dtype)
        return flat.as_strided(self.view_dims, self.strides, self.offset)


def aclCreateTensor(view_dims, data_type, strides, offset, fmt, storage_dims, storage) -> AclTensor:
    return AclTensor(tuple(int(d) for d in view_dims), int(data_type),
                     tuple(int(s) for s in strides) if strides is not None else _contiguous(view_dims),
                     int(offset), int(fmt), tuple(int(d) for d in storage_dims), storage)


def _contiguous(dims) -> tuple:
    strides, acc = [], 1
    for d in reversed(list(dims)):
        strides.append(acc)
        acc *= int(d)
    return tuple(reversed(strides))


def aclDestroyTensor(tensor) -> int:
    return ACL_SUCCESS


@dataclass
class AclIntArray:
    values: tuple

    def __len__(self) -> int:
        return len(self.values)


def aclCreateIntArray(values, size: int | None = None) -> AclIntArray:
    """The values are kept as given; operators check that they are integers (int64_t in C)."""
    values = list(values)
    return AclIntArray(tuple(values if size is None else values[:size]))


def aclDestroyIntArray(array) -> int:
    return ACL_SUCCESS


__all__ = [n for n in dir() if n.startswith(("acl", "ACL_", "Acl", "DevicePtr"))] + ["ACLNN_SUCCESS"]
