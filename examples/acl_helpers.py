"""The helpers every CANN C++ example defines (Init, CreateAclTensor, GetShapeSize, PrintOutResult) and the
steps every example repeats around its operator call: run on the stream (RunOnStream), copy a result back
(CopyToHost) and release everything (Finalize). Each example keeps its own ``aclnnXGetWorkspaceSize`` call.
"""

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


def CreateAclTensors(host: dict):
    """CreateAclTensor for each ``name: (host_data, shape, data_type)``; returns (status, {name: device_addr},
    {name: tensor})."""
    addrs, tensors = {}, {}
    for name, (data, shape, data_type) in host.items():
        ret, addrs[name], tensors[name] = CreateAclTensor(data, shape, data_type)
        if ret != aclnn.ACL_SUCCESS:
            return ret, addrs, tensors
    return aclnn.ACL_SUCCESS, addrs, tensors


def RunOnStream(execute, workspace_size: int, executor, stream):
    """The second phase as the C++ examples write it: aclrtMalloc the workspace when ``workspace_size > 0``,
    call ``execute`` (an ``aclnnX``) and aclrtSynchronizeStream. Returns (status, workspace_addr or None)."""
    workspace_addr = None
    if workspace_size > 0:
        ret, workspace_addr = aclnn.aclrtMalloc(workspace_size, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
        if ret != aclnn.ACL_SUCCESS:
            print(f"allocate workspace failed. ERROR: {ret}")
            return ret, None
    ret = execute(workspace_addr, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"{execute.__name__} failed. ERROR: {ret} {aclnn.aclGetRecentErrMsg()}")
        return ret, workspace_addr
    ret = aclnn.aclrtSynchronizeStream(stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtSynchronizeStream failed. ERROR: {ret}")
    return ret, workspace_addr


def CopyToHost(shape, device_addr, dtype=np.float32):
    """aclrtMemcpy a device result back; returns (status, flat host array of ``dtype``)."""
    result = np.zeros(GetShapeSize(shape), dtype=dtype)
    ret = aclnn.aclrtMemcpy(result, result.nbytes, device_addr, result.nbytes, aclnn.ACL_MEMCPY_DEVICE_TO_HOST)
    if ret != aclnn.ACL_SUCCESS:
        print(f"copy result from device to host failed. ERROR: {ret}")
    return ret, result


def PrintOutResult(shape, device_addr, dtype=np.float32, name: str = "", count: int | None = None) -> None:
    """Copy a result back to the host and print it as the C++ examples do (``name`` prefixes each line;
    ``count`` limits the output to the first elements)."""
    ret, result = CopyToHost(shape, device_addr, dtype)
    if ret != aclnn.ACL_SUCCESS:
        return
    prefix = f"{name} " if name else ""
    for i in range(result.size if count is None else min(count, result.size)):
        print(f"{prefix}result[{i}] is: {float(result[i]):f}")


def Finalize(device_id: int, stream, tensors=(), addrs=(), int_arrays=()) -> int:
    """Steps 6-7 of every example: aclDestroyTensor / aclDestroyIntArray, aclrtFree (None entries, such as
    an unallocated workspace, are skipped), aclrtDestroyStream, aclrtResetDevice, aclFinalize. Returns 0."""
    for tensor in tensors:
        aclnn.aclDestroyTensor(tensor)
    for array in int_arrays:
        aclnn.aclDestroyIntArray(array)
    for addr in addrs:
        if addr is not None:
            aclnn.aclrtFree(addr)
    aclnn.aclrtDestroyStream(stream)
    aclnn.aclrtResetDevice(device_id)
    aclnn.aclFinalize()
    return 0
