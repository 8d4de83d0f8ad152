"""Port of CANN's backward example (ops-math ``math/exp_segsum_grad/examples/test_aclnn_exp_segsum_backward.cpp``).

gradOutput = gradSelf = ones (fp32, shape 1x1x1x4x4) -> gradInput (1x1x1x4) = [0, 3, 4, 3]
(``gradInput[k] = k * (T - k)``: the number of strict-lower entries with j < k <= i).
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

    grad_output_host = np.ones(16, dtype=np.float32)
    grad_self_host = np.ones(16, dtype=np.float32)
    grad_input_host = np.zeros(4, dtype=np.float32)
    grad_output_shape = [1, 1, 1, 4, 4]
    grad_self_shape = [1, 1, 1, 4, 4]
    grad_input_shape = [1, 1, 1, 4]

    ret, addr, tensor = CreateAclTensors({"gradOutput": (grad_output_host, grad_output_shape, aclnn.ACL_FLOAT),
                                          "gradSelf": (grad_self_host, grad_self_shape, aclnn.ACL_FLOAT),
                                          "gradInput": (grad_input_host, grad_input_shape, aclnn.ACL_FLOAT)})
    if ret != aclnn.ACL_SUCCESS:
        return ret

    ret, workspace_size, executor = aclnn.aclnnExpSegsumBackwardGetWorkspaceSize(
        tensor["gradOutput"], tensor["gradSelf"], tensor["gradInput"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnExpSegsumBackwardGetWorkspaceSize failed. ERROR: {ret}")
        return ret
    ret, workspace_addr = RunOnStream(aclnn.aclnnExpSegsumBackward, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    PrintOutResult(grad_input_shape, addr["gradInput"])

    return Finalize(device_id, stream, tensor.values(), (*addr.values(), workspace_addr))


if __name__ == "__main__":
    raise SystemExit(main())
