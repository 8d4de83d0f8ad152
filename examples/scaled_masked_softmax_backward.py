"""Port of CANN's backward example (test_aclnn_scaled_masked_softmax_backward.cpp).

gradOutput = y = 1..16 (fp32, 2x2x2x2), mask {1,1,0,0, ...}, scale 1. Expected output:
0 0 -66 -84 0 0 -742 -840 0 0 -2794 -3036 0 0 -6990 -7440.
"""

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CreateAclTensors, Finalize, Init, PrintOutResult, RunOnStream


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

    ret, addr, tensor = CreateAclTensors({"gradOutput": (grad_output_host, grad_output_shape, aclnn.ACL_FLOAT),
                                          "y": (y_host, y_shape, aclnn.ACL_FLOAT),
                                          "mask": (mask_host, mask_shape, aclnn.ACL_BOOL),
                                          "out": (out_host, out_shape, aclnn.ACL_FLOAT)})
    if ret != aclnn.ACL_SUCCESS:
        return ret

    # attributes
    scale = 1.0
    fix_triu_mask = False

    # 3. the CANN operator API
    ret, workspace_size, executor = aclnn.aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize(
        tensor["gradOutput"], tensor["y"], tensor["mask"], scale, fix_triu_mask, tensor["out"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnScaledMaskedSoftmaxBackwardGetWorkspaceSize failed. ERROR: {ret}")
        return ret

    # 4. run it and wait for the stream
    ret, workspace_addr = RunOnStream(aclnn.aclnnScaledMaskedSoftmaxBackward, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    # 5. copy the result back and print it
    PrintOutResult(out_shape, addr["out"])

    # 6. release tensors, 7. release device resources
    return Finalize(device_id, stream, tensor.values(), (*addr.values(), workspace_addr))


if __name__ == "__main__":
    raise SystemExit(main())
