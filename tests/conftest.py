"""Shared test fixtures.

* ``_torch_seed`` (autouse): every test starts from ``torch.manual_seed(0)``, so random inputs repeat.
* ``acl_device``: the C++ helpers of CANN's examples in Python: ``tensor(host, acl_dtype, ...)`` is
  ``CreateAclTensor`` (aclrtMalloc + aclrtMemcpy + aclCreateTensor, any strides/offset), ``read(ptr, dtype)``
  copies device memory back to the host with aclrtMemcpy, ``run(get_ws, execute, *args)`` makes the two
  aclnn calls and returns the status. Every allocation is freed with aclrtFree at teardown.
"""

from __future__ import annotations

import pytest
import torch

from attngrad import aclnn


@pytest.fixture(autouse=True)
def _torch_seed():
    torch.manual_seed(0)


class AclDevice:
    def __init__(self):
        self.ptrs = []
        status, self.stream = aclnn.aclrtCreateStream()
        assert status == aclnn.ACL_SUCCESS

    def malloc(self, nbytes: int):
        status, ptr = aclnn.aclrtMalloc(nbytes, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
        assert status == aclnn.ACL_SUCCESS
        self.ptrs.append(ptr)
        return ptr

    def tensor(self, host: torch.Tensor, acl_dtype: int, dims=None, strides=None, offset: int = 0,
               fmt: int = aclnn.ACL_FORMAT_ND):
        """Copy the contiguous ``host`` tensor (the storage) to the device and describe a view of it.

        Default view: ``host``'s own shape, contiguous. Returns ``(aclTensor, DevicePtr)``.
        """
        host = host.contiguous()
        nbytes = host.numel() * host.element_size()
        ptr = self.malloc(nbytes)
        assert aclnn.aclrtMemcpy(ptr, nbytes, host, nbytes, aclnn.ACL_MEMCPY_HOST_TO_DEVICE) == aclnn.ACL_SUCCESS
        dims = list(host.shape) if dims is None else list(dims)
        t = aclnn.aclCreateTensor(dims, acl_dtype, strides, offset, fmt, [host.numel()], ptr)
        return t, ptr

    def read(self, ptr, dtype: torch.dtype) -> torch.Tensor:
        """The whole device block ``ptr`` as a flat host tensor of ``dtype``."""
        host = torch.empty(ptr.size // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
        nbytes = host.numel() * host.element_size()
        assert aclnn.aclrtMemcpy(host, nbytes, ptr, nbytes, aclnn.ACL_MEMCPY_DEVICE_TO_HOST) == aclnn.ACL_SUCCESS
        return host

    def run(self, get_workspace_size, execute, *args) -> int:
        """Both phases; returns the first non-zero status (or 0)."""
        status, ws_size, executor = get_workspace_size(*args)
        if status != aclnn.ACLNN_SUCCESS:
            assert executor is None
            return status
        workspace = self.malloc(ws_size) if ws_size > 0 else None
        status = execute(workspace, ws_size, executor, self.stream)
        assert aclnn.aclrtSynchronizeStream(self.stream) == aclnn.ACL_SUCCESS
        return status

    def free(self):
        for ptr in self.ptrs:
            assert aclnn.aclrtFree(ptr) == aclnn.ACL_SUCCESS
        aclnn.aclrtDestroyStream(self.stream)


@pytest.fixture
def acl_device():
    device = AclDevice()
    yield device
    device.free()
