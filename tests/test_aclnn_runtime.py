"""The host AscendCL stand-ins (attngrad.aclnn.runtime / executor), exercised through ScaledMaskedSoftmax:
memory, strided views with offsets as operator input and output, bounds, executors, error messages.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import attngrad
from attngrad import aclnn
from attngrad.errors import ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR
from attngrad.kernels.scaled_masked_softmax_reference import (scaled_masked_softmax_backward_reference,
                                                               scaled_masked_softmax_reference)
from attngrad.precision import assert_close

FWD = (aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmax)
BWD = (aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize, aclnn.aclnnScaledMaskedSoftmaxBackward)
ACL_DTYPES = {torch.float32: aclnn.ACL_FLOAT, torch.float16: aclnn.ACL_FLOAT16, torch.bfloat16: aclnn.ACL_BF16}
SENTINEL = -12345.0

# A non-contiguous view over a bigger storage: step 2 on S2, padded S1 rows, per-batch gap, offset 3.
DIMS = (2, 3, 4, 5)
STRIDES = (139, 44, 11, 2)
OFFSET = 3
STORAGE = 280  # last element reached: 3 + 139 + 2*44 + 3*11 + 4*2 = 271


def view_index() -> torch.Tensor:
    """Storage index of every view element (row-major over the view)."""
    return torch.arange(STORAGE).as_strided(DIMS, STRIDES, OFFSET).reshape(-1)


def test_constants_match_cann():
    assert (aclnn.ACL_FLOAT, aclnn.ACL_FLOAT16, aclnn.ACL_INT8, aclnn.ACL_INT32, aclnn.ACL_UINT8) == (0, 1, 2, 3, 4)
    assert (aclnn.ACL_INT16, aclnn.ACL_UINT16, aclnn.ACL_UINT32, aclnn.ACL_INT64, aclnn.ACL_UINT64) == (6, 7, 8, 9, 10)
    assert (aclnn.ACL_DOUBLE, aclnn.ACL_BOOL, aclnn.ACL_BF16) == (11, 12, 27)
    formats = (aclnn.ACL_FORMAT_NCHW, aclnn.ACL_FORMAT_NHWC, aclnn.ACL_FORMAT_ND, aclnn.ACL_FORMAT_FRACTAL_NZ)
    assert formats == (0, 1, 2, 29)
    assert (aclnn.ACLNN_SUCCESS, aclnn.ACLNN_ERR_PARAM_NULLPTR, aclnn.ACLNN_ERR_PARAM_INVALID) == (0, 161001, 161002)
    assert (aclnn.ACLNN_ERR_RUNTIME_ERROR, aclnn.ACLNN_ERR_INNER) == (361001, 561000)


def test_init_device_stream_sequence():
    assert aclnn.aclInit(None) == aclnn.ACL_SUCCESS
    assert aclnn.aclrtSetDevice(0) == aclnn.ACL_SUCCESS
    status, stream = aclnn.aclrtCreateStream()
    assert status == aclnn.ACL_SUCCESS and stream is not None
    assert aclnn.aclrtSynchronizeStream(stream) == aclnn.ACL_SUCCESS
    assert aclnn.aclrtDestroyStream(stream) == aclnn.ACL_SUCCESS
    assert aclnn.aclrtResetDevice(0) == aclnn.ACL_SUCCESS
    assert aclnn.aclFinalize() == aclnn.ACL_SUCCESS


# --- memory ---
def test_malloc_memcpy_roundtrip_and_free():
    status, ptr = aclnn.aclrtMalloc(64, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
    assert status == aclnn.ACL_SUCCESS and ptr.size == 64
    assert (aclnn.AclTensor(DIMS[:1], aclnn.ACL_UINT8, (1,), 0, aclnn.ACL_FORMAT_ND, (64,), ptr).to_torch() == 0).all()
    host = np.arange(16, dtype=np.float32)
    assert aclnn.aclrtMemcpy(ptr, 64, host, 64, aclnn.ACL_MEMCPY_HOST_TO_DEVICE) == aclnn.ACL_SUCCESS
    back = np.zeros(16, dtype=np.float32)
    assert aclnn.aclrtMemcpy(back, 64, ptr, 64, aclnn.ACL_MEMCPY_DEVICE_TO_HOST) == aclnn.ACL_SUCCESS
    assert np.array_equal(back, host)
    part = torch.zeros(4)
    assert aclnn.aclrtMemcpy(part, 16, ptr, 16, aclnn.ACL_MEMCPY_DEVICE_TO_HOST) == aclnn.ACL_SUCCESS
    assert torch.equal(part, torch.arange(4.0))
    _, other = aclnn.aclrtMalloc(64)
    assert aclnn.aclrtMemcpy(other, 64, ptr, 64, aclnn.ACL_MEMCPY_DEVICE_TO_DEVICE) == aclnn.ACL_SUCCESS
    assert torch.equal(other.buffer, ptr.buffer)
    assert aclnn.aclrtFree(ptr) == aclnn.ACL_SUCCESS and ptr.freed
    assert aclnn.aclrtFree(other) == aclnn.ACL_SUCCESS


@pytest.mark.parametrize("size", [-1, 2.5, "8"])
def test_malloc_bad_size(size):
    status, ptr = aclnn.aclrtMalloc(size)
    assert status == aclnn.ACL_ERROR_INVALID_PARAM and ptr is None
    assert "aclrtMalloc" in aclnn.aclGetRecentErrMsg()


def test_memcpy_rejects_overflow_and_strided_host():
    _, ptr = aclnn.aclrtMalloc(16)
    host = np.zeros(8, dtype=np.float32)  # 32 bytes
    assert aclnn.aclrtMemcpy(ptr, 16, host, 32, aclnn.ACL_MEMCPY_HOST_TO_DEVICE) == aclnn.ACL_ERROR_INVALID_PARAM
    assert "count" in aclnn.aclGetRecentErrMsg()
    assert aclnn.aclrtMemcpy(ptr, 64, host, 32, aclnn.ACL_MEMCPY_HOST_TO_DEVICE) == aclnn.ACL_ERROR_INVALID_PARAM
    assert aclnn.aclrtMemcpy(ptr, 16, host[::2], 16, aclnn.ACL_MEMCPY_HOST_TO_DEVICE) == aclnn.ACL_ERROR_INVALID_PARAM
    assert aclnn.aclrtMemcpy(ptr, 16, host, -1, aclnn.ACL_MEMCPY_HOST_TO_DEVICE) == aclnn.ACL_ERROR_INVALID_PARAM
    assert (ptr.buffer == 0).all()


# --- strided views with offsets as operator input and output ---
def _strided_device_tensor(acl_device, values: torch.Tensor, fill: float):
    """``values`` (shape DIMS) placed in the view of a storage of STORAGE elements filled with ``fill``."""
    storage = torch.full((STORAGE,), fill, dtype=values.dtype)
    storage.as_strided(DIMS, STRIDES, OFFSET).copy_(values)
    return acl_device.tensor(storage, ACL_DTYPES.get(values.dtype, aclnn.ACL_BOOL), dims=DIMS, strides=STRIDES,
                             offset=OFFSET)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_strided_views_as_input_and_output(acl_device, dtype):
    x, dy = torch.randn(DIMS).to(dtype), torch.randn(DIMS).to(dtype)
    mask = torch.rand(DIMS) < 0.3
    tx, _ = _strided_device_tensor(acl_device, x, float("nan"))  # padding must never be read
    tdy, _ = _strided_device_tensor(acl_device, dy, float("nan"))
    tmask, _ = _strided_device_tensor(acl_device, mask, True)
    ty, y_ptr = _strided_device_tensor(acl_device, torch.zeros(DIMS, dtype=dtype), SENTINEL)
    tout, out_ptr = _strided_device_tensor(acl_device, torch.zeros(DIMS, dtype=dtype), SENTINEL)
    assert acl_device.run(*FWD, tx, tmask, 0.5, False, ty) == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()
    assert acl_device.run(*BWD, tdy, ty, tmask, 0.5, False, tout) == aclnn.ACLNN_SUCCESS

    inside = view_index()
    outside = torch.ones(STORAGE, dtype=torch.bool)
    outside[inside] = False
    y_storage, out_storage = acl_device.read(y_ptr, dtype), acl_device.read(out_ptr, dtype)
    assert (y_storage[outside] == SENTINEL).all() and (out_storage[outside] == SENTINEL).all()
    y = y_storage[inside].view(DIMS)
    out = out_storage[inside].view(DIMS)
    assert_close(y, scaled_masked_softmax_reference(x, mask, 0.5), dtype, use_mere=True)
    assert_close(out, scaled_masked_softmax_backward_reference(dy, y, mask, 0.5), dtype, use_mere=True,
                 exact_zero=mask)


def test_view_exceeding_storage_is_rejected_without_write(acl_device):
    x, _ = acl_device.tensor(torch.randn(DIMS), aclnn.ACL_FLOAT)
    mask, _ = acl_device.tensor(torch.zeros(DIMS, dtype=torch.bool), aclnn.ACL_BOOL)
    short = torch.full((STORAGE - 9,), SENTINEL)  # the view reaches element 271
    y_short, y_ptr = acl_device.tensor(short, aclnn.ACL_FLOAT, dims=DIMS, strides=STRIDES, offset=OFFSET)
    assert acl_device.run(*FWD, x, mask, 1.0, False, y_short) == aclnn.ACLNN_ERR_PARAM_INVALID
    assert "y" in aclnn.aclGetRecentErrMsg() and "storage" in aclnn.aclGetRecentErrMsg()
    assert (acl_device.read(y_ptr, torch.float32) == SENTINEL).all()

    x_short, _ = acl_device.tensor(torch.randn(STORAGE - 9), aclnn.ACL_FLOAT, dims=DIMS, strides=STRIDES,
                                   offset=OFFSET)
    y, y_ptr = acl_device.tensor(torch.full(DIMS, SENTINEL), aclnn.ACL_FLOAT)
    assert acl_device.run(*FWD, x_short, mask, 1.0, False, y) == aclnn.ACLNN_ERR_PARAM_INVALID
    assert "x" in aclnn.aclGetRecentErrMsg()
    assert (acl_device.read(y_ptr, torch.float32) == SENTINEL).all()
    # a large offset alone also leaves the storage
    x_off, _ = acl_device.tensor(torch.randn(120), aclnn.ACL_FLOAT, dims=DIMS, offset=1)
    assert acl_device.run(*FWD, x_off, mask, 1.0, False, y) == aclnn.ACLNN_ERR_PARAM_INVALID


@pytest.mark.parametrize("dims, strides, offset", [((2, 3, 4, 5), (60, 20, 5), 0), ((2, 3, 4, 5), (60, 20, 5, -1), 0),
                                                   ((2, 3, 4, 5), (60, 20, 5, 1), -1)])
def test_malformed_view_descriptions(acl_device, dims, strides, offset):
    mask, _ = acl_device.tensor(torch.zeros(2, 3, 4, 5, dtype=torch.bool), aclnn.ACL_BOOL)
    y, _ = acl_device.tensor(torch.zeros(2, 3, 4, 5), aclnn.ACL_FLOAT)
    x, _ = acl_device.tensor(torch.zeros(200), aclnn.ACL_FLOAT, dims=dims, strides=strides, offset=offset)
    assert acl_device.run(*FWD, x, mask, 1.0, False, y) == aclnn.ACLNN_ERR_PARAM_INVALID


def test_unknown_data_type_and_freed_storage(acl_device):
    mask, _ = acl_device.tensor(torch.zeros(2, 3, 4, 5, dtype=torch.bool), aclnn.ACL_BOOL)
    y, _ = acl_device.tensor(torch.zeros(2, 3, 4, 5), aclnn.ACL_FLOAT)
    weird, _ = acl_device.tensor(torch.zeros(120), 99, dims=(2, 3, 4, 5))
    assert acl_device.run(*FWD, weird, mask, 1.0, False, y) == aclnn.ACLNN_ERR_PARAM_INVALID
    _, ptr = aclnn.aclrtMalloc(480)
    freed = aclnn.aclCreateTensor([2, 3, 4, 5], aclnn.ACL_FLOAT, None, 0, aclnn.ACL_FORMAT_ND, [120], ptr)
    aclnn.aclrtFree(ptr)
    assert acl_device.run(*FWD, freed, mask, 1.0, False, y) == aclnn.ACLNN_ERR_PARAM_NULLPTR
    assert "freed" in aclnn.aclGetRecentErrMsg()


def test_aliased_input_and_output(acl_device):
    # y written over x's own storage: the kernel reads everything before the output is written
    x = torch.randn(DIMS)
    mask = torch.rand(DIMS) < 0.3
    tx, ptr = acl_device.tensor(x, aclnn.ACL_FLOAT)
    tmask, _ = acl_device.tensor(mask, aclnn.ACL_BOOL)
    assert acl_device.run(*FWD, tx, tmask, 1.0, False, tx) == aclnn.ACLNN_SUCCESS
    assert_close(acl_device.read(ptr, torch.float32).view(DIMS), scaled_masked_softmax_reference(x, mask, 1.0),
                 use_mere=True)


# --- executors ---
def _ready_executor(acl_device):
    x, _ = acl_device.tensor(torch.randn(1, 1, 2, 3), aclnn.ACL_FLOAT)
    mask, _ = acl_device.tensor(torch.zeros(1, 1, 2, 3, dtype=torch.bool), aclnn.ACL_BOOL)
    y, y_ptr = acl_device.tensor(torch.zeros(1, 1, 2, 3), aclnn.ACL_FLOAT)
    status, ws, executor = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(x, mask, 1.0, False, y)
    assert status == aclnn.ACLNN_SUCCESS and ws == 0 and isinstance(executor, aclnn.AclOpExecutor)
    return executor, y_ptr


def test_executor_is_single_use(acl_device):
    executor, y_ptr = _ready_executor(acl_device)
    assert aclnn.aclnnScaledMaskedSoftmax(None, 0, executor, acl_device.stream) == aclnn.ACLNN_SUCCESS
    first = acl_device.read(y_ptr, torch.float32)
    assert torch.allclose(first.view(2, 3).sum(-1), torch.ones(2))
    status = aclnn.aclnnScaledMaskedSoftmax(None, 0, executor, acl_device.stream)
    assert status == ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR
    assert "single-use" in aclnn.aclGetRecentErrMsg()


def test_null_and_foreign_executor(acl_device):
    assert aclnn.aclnnScaledMaskedSoftmax(None, 0, None, None) == aclnn.ACLNN_ERR_PARAM_NULLPTR
    assert "executor" in aclnn.aclGetRecentErrMsg()
    assert aclnn.aclnnScaledMaskedSoftmaxBackward(None, 0, None, None) == aclnn.ACLNN_ERR_PARAM_NULLPTR
    executor, y_ptr = _ready_executor(acl_device)
    assert aclnn.aclnnScaledMaskedSoftmaxBackward(None, 0, executor, None) == aclnn.ACLNN_ERR_PARAM_INVALID
    assert aclnn.aclnnScaledMaskedSoftmax(None, 0, "executor", None) == aclnn.ACLNN_ERR_PARAM_INVALID
    assert (acl_device.read(y_ptr, torch.float32) == 0).all()
    assert aclnn.aclnnScaledMaskedSoftmax(None, 0, executor, None) == aclnn.ACLNN_SUCCESS  # still unused


def test_failed_get_workspace_size_gives_no_executor():
    status, ws, executor = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(None, None, 1.0, False, None)
    assert (status, ws, executor) == (aclnn.ACLNN_ERR_PARAM_NULLPTR, 0, None)


# --- error messages ---
def test_recent_error_message_names_parameter_and_is_per_thread():
    x = aclnn.AclTensor.from_torch(torch.randn(2, 2, 2, 2))
    mask = aclnn.AclTensor.from_torch(torch.zeros(2, 2, 2, 2, dtype=torch.uint8))
    status, _, _ = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(x, mask, 1.0, False, x)
    assert status == aclnn.ACLNN_ERR_PARAM_INVALID
    msg = aclnn.aclGetRecentErrMsg()
    assert "mask" in msg and "BOOL" in msg and "UINT8" in msg and "ScaledMaskedSoftmax" in msg
    seen = []
    thread = threading.Thread(target=lambda: seen.append(aclnn.aclGetRecentErrMsg()))
    thread.start()
    thread.join()
    assert seen == [""]
    assert aclnn.aclGetRecentErrMsg() == msg


# --- AclTensor.from_torch ---
def test_from_torch_is_zero_copy_and_keeps_strides():
    base = torch.randn(2, 4, 3, 10)
    x = base.transpose(1, 2)[..., ::2]  # [2, 3, 4, 5], non-contiguous, offset 0
    t = aclnn.AclTensor.from_torch(x)
    assert t.view_dims == tuple(x.shape) and t.strides == tuple(x.stride()) and t.data_type == aclnn.ACL_FLOAT
    assert t.to_torch() is x
    mask = torch.rand(1, 3, 4, 5) < 0.4
    y = torch.full((2, 3, 4, 5, 2), SENTINEL)[..., 1]  # output view with stride 2
    status, ws, ex = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(t, aclnn.AclTensor.from_torch(mask), 0.7, False,
                                                                   aclnn.AclTensor.from_torch(y))
    assert status == aclnn.ACLNN_SUCCESS
    assert aclnn.aclnnScaledMaskedSoftmax(None, ws, ex, None) == aclnn.ACLNN_SUCCESS
    assert torch.equal(y, attngrad.scaled_masked_softmax(x, mask, 0.7))
    assert (y._base[..., 0] == SENTINEL).all()


def test_from_torch_offset_view_and_dtypes():
    storage = torch.zeros(100, dtype=torch.bfloat16)
    view = storage[7:7 + 24].view(1, 2, 3, 4)
    t = aclnn.AclTensor.from_torch(view)
    assert t.offset == 7 and t.data_type == aclnn.ACL_BF16
    assert aclnn.AclTensor.from_torch(torch.zeros(1, dtype=torch.float16)).data_type == aclnn.ACL_FLOAT16
    assert aclnn.AclTensor.from_torch(torch.zeros(1, dtype=torch.bool)).data_type == aclnn.ACL_BOOL
    with pytest.raises(attngrad.AclnnError) as info:
        aclnn.AclTensor.from_torch(torch.zeros(1, dtype=torch.complex64))
    assert info.value.status == aclnn.ACLNN_ERR_PARAM_INVALID


def test_int_array():
    arr = aclnn.aclCreateIntArray([3, 1, 4, 1, 5], 3)
    assert arr.values == (3, 1, 4) and len(arr) == 3
    assert aclnn.aclDestroyIntArray(arr) == aclnn.ACL_SUCCESS
