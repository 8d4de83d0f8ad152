"""Port of CANN's forward example (ops-math ``math/segsum/examples/test_aclnn_segsum.cpp``).

self = [0, 1, 2, 3] (fp32, shape 1x1x1x4) -> out (1x1x1x4x4), printed row-major:
1 0 0 0 / 2.718282 1 0 0 / 20.085537 7.389056 1 0 / 403.428793 148.413159 20.085537 1.
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

    self_host = np.array([0, 1, 2, 3], dtype=np.float32)
    out_host = np.zeros(16, dtype=np.float32)
    self_shape = [1, 1, 1, 4]
    out_shape = [1, 1, 1, 4, 4]

    ret, addr, tensor = CreateAclTensors({"self": (self_host, self_shape, aclnn.ACL_FLOAT),
                                          "out": (out_host, out_shape, aclnn.ACL_FLOAT)})
    if ret != aclnn.ACL_SUCCESS:
        return ret

    ret, workspace_size, executor = aclnn.aclnnExpSegsumGetWorkspaceSize(tensor["self"], tensor["out"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnExpSegsumGetWorkspaceSize failed. ERROR: {ret}")
        return ret
    ret, workspace_addr = RunOnStream(aclnn.aclnnExpSegsum, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    PrintOutResult(out_shape, addr["out"])

    return Finalize(device_id, stream, tensor.values(), (*addr.values(), workspace_addr))


if __name__ == "__main__":
    raise SystemExit(main())
