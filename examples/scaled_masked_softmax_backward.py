"""Port of seed 001's C++ example (test_aclnn_scaled_masked_softmax_backward.cpp).

gradOutput = y = 1..16 (fp32, 2x2x2x2), mask {1,1,0,0, ...}, scale 1. Expected output:
0 0 -66 -84 0 0 -742 -840 0 0 -2794 -3036 0 0 -6990 -7440.
"""

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CreateAclTensor, Init, PrintOutResult


def main() -> int:
    # 1. device/stream initialisation
    device_id = 0
    ret, stream = Init(device_id)
    if ret != aclnn.ACL_SUCCESS:
        print(f"Init acl failed. ERROR: {ret}")
        return ret

    # 2. inputs and outputs
    grad_output_host = np.arange(1, 17, dtype=np.float32)
    y_host = np.arange(1, 17, dtype=np.float32)
    mask_host = np.array([1, 1, 0, 0] * 4, dtype=np.int8)  # std::vector<char>
    out_host = np.zeros(16, dtype=np.float32)
    grad_output_shape = [2, 2, 2, 2]
    y_shape = [2, 2, 2, 2]
    mask_shape = [2, 2, 2, 2]
    out_shape = [2, 2, 2, 2]

    ret, grad_output_addr, grad_output = CreateAclTensor(grad_output_host, grad_output_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, y_addr, y = CreateAclTensor(y_host, y_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, mask_addr, mask = CreateAclTensor(mask_host, mask_shape, aclnn.ACL_BOOL)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, out_addr, out = CreateAclTensor(out_host, out_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    # attributes
    scale = 1.0
    fix_triu_mask = False

    # 3. the CANN operator API
    ret, workspace_size, executor = aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize(
        grad_output, y, mask, scale, fix_triu_mask, out)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize failed. ERROR: {ret}")
        return ret
    workspace_addr = None
    if workspace_size > 0:
        ret, workspace_addr = aclnn.aclrtMalloc(workspace_size, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
        if ret != aclnn.ACL_SUCCESS:
            print(f"allocate workspace failed. ERROR: {ret}")
            return ret
    ret = aclnn.aclnnScaledMaskedSoftmaxBackward(workspace_addr, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnScaledMaskedSoftmaxBackward failed. ERROR: {ret}")
        return ret

    # 4. wait for the stream
    ret = aclnn.aclrtSynchronizeStream(stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtSynchronizeStream failed. ERROR: {ret}")
        return ret

    # 5. copy the result back and print it
    PrintOutResult(out_shape, out_addr)

    # 6. release tensors, 7. release device resources
    for tensor in (grad_output, y, mask, out):
        aclnn.aclDestroyTensor(tensor)
    for addr in (grad_output_addr, y_addr, mask_addr, out_addr):
        aclnn.aclrtFree(addr)
    if workspace_size > 0:
        aclnn.aclrtFree(workspace_addr)
    aclnn.aclrtDestroyStream(stream)
    aclnn.aclrtResetDevice(device_id)
    aclnn.aclFinalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
