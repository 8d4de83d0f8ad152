"""Port of the aclnn FlashAttentionScoreGrad example (test_aclnn_flash_attention_score_grad.cpp).

SBH, B=1 N1=N2=1 S1=S2=256 D=128, fp32, scale 1/sqrt(128); q = k = v = dy = attentionIn = 1,
softmaxMax = softmaxSum = 3.0, attention mask [256, 256] of zeros (nothing masked), through
aclnnFlashAttentionScoreGradV2. With these inputs dS = P * (dy.V^T - rowsum(dy * attentionIn)) = 0, so dq and
dk are 0 and every dv element is 256 * exp(128 / sqrt(128) - 3) / 3. The C++ prints every element; this port
prints the first 8 of each output.
"""

import math

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CreateAclTensors, Finalize, Init, PrintOutResult, RunOnStream

PRINT_COUNT = 8


def main() -> int:
    # 1. device/stream initialisation
    device_id = 0
    ret, stream = Init(device_id)
    if ret != aclnn.ACL_SUCCESS:
        print(f"Init acl failed. ERROR: {ret}")
        return ret

    # 2. inputs and outputs
    B, N1, N2, S1, S2, D = 1, 1, 1, 256, 256, 128
    H1, H2 = N1 * D, N2 * D
    q_shape, kv_shape = [S1, B, H1], [S2, B, H2]
    softmax_shape = [B, N1, S1, 8]
    host = {name: (data, shape, aclnn.ACL_FLOAT) for name, (data, shape) in {
        "q": (np.ones(S1 * B * H1, np.float32), q_shape), "k": (np.ones(S2 * B * H2, np.float32), kv_shape),
        "v": (np.ones(S2 * B * H2, np.float32), kv_shape), "dx": (np.ones(S1 * B * H1, np.float32), q_shape),
        "softmaxMax": (np.full(B * N1 * S1 * 8, 3.0, np.float32), softmax_shape),
        "softmaxSum": (np.full(B * N1 * S1 * 8, 3.0, np.float32), softmax_shape),
        "attentionIn": (np.ones(S1 * B * H1, np.float32), q_shape),
        "dq": (np.zeros(S1 * B * H1, np.float32), q_shape), "dk": (np.zeros(S2 * B * H2, np.float32), kv_shape),
        "dv": (np.zeros(S2 * B * H2, np.float32), kv_shape),
    }.items()}
    # the C++ example's [S1, S2] uint8 attention mask of zeros (nothing masked)
    host["attenMask"] = (np.zeros(S1 * S2, np.uint8), [S1, S2], aclnn.ACL_UINT8)
    ret, addr, tensor = CreateAclTensors(host)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    pse = drop_mask = padding = softmax_in = dpse = None

    prefix = aclnn.aclCreateIntArray([0], 1)
    q_start_idx = aclnn.aclCreateIntArray([0], 1)
    kv_start_idx = aclnn.aclCreateIntArray([0], 1)
    scale_value = 1.0 / math.sqrt(128)
    keep_prob = 1.0
    pre_tokens = 2147483647
    next_tokens = 2147483647
    head_num = 1
    inner_precise = 0
    sparse_mode = 0
    pse_type = 1
    layout = "SBH"

    # 3. the CANN operator API
    ret, workspace_size, executor = aclnn.aclnnFlashAttentionScoreGradV2GetWorkspaceSize(
        tensor["q"], tensor["k"], tensor["v"], tensor["dx"], pse, drop_mask, padding, tensor["attenMask"],
        tensor["softmaxMax"], tensor["softmaxSum"], softmax_in, tensor["attentionIn"], prefix, q_start_idx,
        kv_start_idx, scale_value, keep_prob, pre_tokens, next_tokens, head_num, layout, inner_precise,
        sparse_mode, pse_type, tensor["dq"], tensor["dk"], tensor["dv"], dpse)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionScoreGradV2GetWorkspaceSize failed. ERROR: {ret} {aclnn.aclGetRecentErrMsg()}")
        return ret

    # 4. run it and wait for the stream
    ret, workspace_addr = RunOnStream(aclnn.aclnnFlashAttentionScoreGradV2, workspace_size, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    # 5. copy the results back and print their first PRINT_COUNT elements
    for name, shape in (("dq", q_shape), ("dk", kv_shape), ("dv", kv_shape)):
        PrintOutResult(shape, addr[name], name=name, count=PRINT_COUNT)

    # 6. release tensors and arrays, 7. release device resources
    return Finalize(device_id, stream, tensor.values(), (*addr.values(), workspace_addr),
                    (prefix, q_start_idx, kv_start_idx))


if __name__ == "__main__":
    raise SystemExit(main())
