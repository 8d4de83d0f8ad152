"""Port of CANN's forward example (test_aclnn_scaled_masked_softmax.cpp, spec part A.4).

x = 1..16 (fp32, 2x2x2x2), mask {1,1,0,0, ...} (every even row fully masked), scale 1.
Expected output: 0.5 0.5 0.268941 0.731059, four times.
"""

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CreateAclTensor, Init, PrintOutResult


def main() -> int:
    device_id = 0
    ret, stream = Init(device_id)
    if ret != aclnn.ACL_SUCCESS:
        print(f"Init acl failed. ERROR: {ret}")
        return ret

    x_host = np.arange(1, 17, dtype=np.float32)
    mask_host = np.array([1, 1, 0, 0] * 4, dtype=np.int8)
    y_host = np.zeros(16, dtype=np.float32)
    x_shape = [2, 2, 2, 2]
    mask_shape = [2, 2, 2, 2]
    y_shape = [2, 2, 2, 2]

    ret, x_addr, x = CreateAclTensor(x_host, x_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, mask_addr, mask = CreateAclTensor(mask_host, mask_shape, aclnn.ACL_BOOL)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, y_addr, y = CreateAclTensor(y_host, y_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    scale = 1.0
    fixed_triu_mask = False

    ret, workspace_size, executor = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(
        x, mask, scale, fixed_triu_mask, y)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnScaledMaskedSoftmaxGetWorkspaceSize failed. ERROR: {ret}")
        return ret
    workspace_addr = None
    if workspace_size > 0:
        ret, workspace_addr = aclnn.aclrtMalloc(workspace_size, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
        if ret != aclnn.ACL_SUCCESS:
            print(f"allocate workspace failed. ERROR: {ret}")
            return ret
    ret = aclnn.aclnnScaledMaskedSoftmax(workspace_addr, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnScaledMaskedSoftmax failed. ERROR: {ret}")
        return ret

    ret = aclnn.aclrtSynchronizeStream(stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtSynchronizeStream failed. ERROR: {ret}")
        return ret

    PrintOutResult(y_shape, y_addr)

    for tensor in (x, mask, y):
        aclnn.aclDestroyTensor(tensor)
    for addr in (x_addr, mask_addr, y_addr):
        aclnn.aclrtFree(addr)
    if workspace_size > 0:
        aclnn.aclrtFree(workspace_addr)
    aclnn.aclrtDestroyStream(stream)
    aclnn.aclrtResetDevice(device_id)
    aclnn.aclFinalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
