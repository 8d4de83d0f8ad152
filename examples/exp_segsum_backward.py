"""Port of CANN's backward example (ops-math ``math/exp_segsum_grad/examples/test_aclnn_exp_segsum_backward.cpp``).

gradOutput = gradSelf = ones (fp32, shape 1x1x1x4x4) -> gradInput (1x1x1x4) = [0, 3, 4, 3]
(``gradInput[k] = k * (T - k)``: the number of strict-lower entries with j < k <= i).
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

    grad_output_host = np.ones(16, dtype=np.float32)
    grad_self_host = np.ones(16, dtype=np.float32)
    grad_input_host = np.zeros(4, dtype=np.float32)
    grad_output_shape = [1, 1, 1, 4, 4]
    grad_self_shape = [1, 1, 1, 4, 4]
    grad_input_shape = [1, 1, 1, 4]

    ret, grad_output_addr, grad_output = CreateAclTensor(grad_output_host, grad_output_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, grad_self_addr, grad_self = CreateAclTensor(grad_self_host, grad_self_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    ret, grad_input_addr, grad_input = CreateAclTensor(grad_input_host, grad_input_shape, aclnn.ACL_FLOAT)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    ret, workspace_size, executor = aclnn.aclnnExpSegsumBackwardGetWorkspaceSize(grad_output, grad_self, grad_input)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnExpSegsumBackwardGetWorkspaceSize failed. ERROR: {ret}")
        return ret
    workspace_addr = None
    if workspace_size > 0:
        ret, workspace_addr = aclnn.aclrtMalloc(workspace_size, aclnn.ACL_MEM_MALLOC_HUGE_FIRST)
        if ret != aclnn.ACL_SUCCESS:
            print(f"allocate workspace failed. ERROR: {ret}")
            return ret
    ret = aclnn.aclnnExpSegsumBackward(workspace_addr, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnExpSegsumBackward failed. ERROR: {ret}")
        return ret

    ret = aclnn.aclrtSynchronizeStream(stream)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclrtSynchronizeStream failed. ERROR: {ret}")
        return ret

    PrintOutResult(grad_input_shape, grad_input_addr)

    for tensor in (grad_output, grad_self, grad_input):
        aclnn.aclDestroyTensor(tensor)
    for addr in (grad_output_addr, grad_self_addr, grad_input_addr):
        aclnn.aclrtFree(addr)
    if workspace_size > 0:
        aclnn.aclrtFree(workspace_addr)
    aclnn.aclrtDestroyStream(stream)
    aclnn.aclrtResetDevice(device_id)
    aclnn.aclFinalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
