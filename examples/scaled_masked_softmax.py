"""Port of CANN's forward example (test_aclnn_scaled_masked_softmax.cpp).

x = 1..16 (fp32, 2x2x2x2), mask {1,1,0,0, ...} (every even row fully masked), scale 1.
Expected output: 0.5 0.5 0.268941 0.731059, four times.
"""

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CreateAclTensors, Finalize, Init, PrintOutResult, RunOnStream


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

    ret, addr, tensor = CreateAclTensors({"x": (x_host, x_shape, aclnn.ACL_FLOAT),
                                          "mask": (mask_host, mask_shape, aclnn.ACL_BOOL),
                                          "y": (y_host, y_shape, aclnn.ACL_FLOAT)})
    if ret != aclnn.ACL_SUCCESS:
        return ret

    scale = 1.0
    fixed_triu_mask = False

    ret, workspace_size, executor = aclnn.aclnnScaledMaskedSoftmaxGetWorkspaceSize(
        tensor["x"], tensor["mask"], scale, fixed_triu_mask, tensor["y"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnScaledMaskedSoftmaxGetWorkspaceSize failed. ERROR: {ret}")
        return ret
    ret, workspace_addr = RunOnStream(aclnn.aclnnScaledMaskedSoftmax, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    PrintOutResult(y_shape, addr["y"])

    return Finalize(device_id, stream, tensor.values(), (*addr.values(), workspace_addr))


if __name__ == "__main__":
    raise SystemExit(main())
