"""The helper functions every CANN C++ example defines (Init, CreateAclTensor, GetShapeSize, PrintOutResult)."""

from __future__ import annotations

import numpy as np

from attngrad import aclnn


def GetShapeSize(shape) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def Init(device_id: int):
    """AscendCL initialisation; returns (status, stream)."""
    ret = aclnn.aclInit(None)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclInit failed. ERROR: {ret}")
        return ret, None
    ret = aclnn.aclrtSetDevice(device_id)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtSetDevice failed. ERROR: {ret}")
        return ret, None
    return aclnn.aclrtCreateStream()


def CreateAclTensor(host_data: np.ndarray, shape, data_type: int):
    """aclrtMalloc device memory, copy the host data in, and describe it as a contiguous ND aclTensor.

    Returns (status, device_addr, tensor).
    """
    size = GetShapeSize(shape) * host_data.itemsize
    ret, device_addr = aclnn.aclrtMalloc(size, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtMalloc failed. ERROR: {ret}")
        return ret, None, None
    ret = aclnn.aclrtMemcpy(device_addr, size, host_data, size, aclnn.ACL_MEMCPY_HOST_TO_DEVICE)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtMemcpy failed. ERROR: {ret}")
        return ret, None, None
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = shape[i + 1] * strides[i + 1]
    tensor = aclnn.aclCreateTensor(shape, data_type, strides, 0, aclnn.ACL_FORMAT_ND, shape, device_addr)
    return aclnn.ACL_SUCCESS, device_addr, tensor


def PrintOutResult(shape, device_addr, dtype=np.float32) -> None:
    """Copy a result back to the host and print it as the C++ examples do."""
    size = GetShapeSize(shape)
    result = np.zeros(size, dtype=dtype)
    ret = aclnn.aclrtMemcpy(result, result.nbytes, device_addr, result.nbytes, aclnn.ACL_MEMCPY_DEVICE_TO_HOST)
    if ret != aclnn.ACL_SUCCESS:
        print(f"copy result from device to host failed. ERROR: {ret}")
        return
    for i in range(size):
        print(f"result[{i}] is: {float(result[i]):f}")
