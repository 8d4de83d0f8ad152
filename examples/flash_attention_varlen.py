"""Varlen (TND) FlashAttention through the two-phase API: aclnnFlashAttentionVarLenScore, then
aclnnFlashAttentionUnpaddingScoreGrad on its outputs (in the style of CANN's TND examples).

Three sequences packed along T, query lengths [3, 0, 5] and key/value lengths [4, 0, 6] (cumulative
actualSeqQLen [3, 3, 8], actualSeqKvLen [4, 4, 10]; the middle batch is empty), N1 = 2 query heads sharing
N2 = 1 kv head (GQA), D = 16, fp32, scale 1/sqrt(16). softmaxMax/Sum come back as [T1, N1, 8] in CANN's default
data order (per-batch [N1, Sq_b, 8] blocks). Prints the first values of every output.
"""

import math

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CopyToHost, CreateAclTensors, Finalize, GetShapeSize, Init, RunOnStream

PRINT_COUNT = 6


def PrintFirstValues(shape, device_addr, name: str, bf16: bool = False) -> None:
    """Copy a result (float32, or bfloat16 bit patterns with ``bf16``) back to the host and print its first
    PRINT_COUNT values on one line."""
    ret, result = CopyToHost(shape, device_addr, np.uint16 if bf16 else np.float32)
    if bf16:
        result = (result.astype(np.uint32) << 16).view(np.float32)
    if ret == aclnn.ACL_SUCCESS:
        print(f"{name} first values: " + " ".join(f"{float(x):.6f}" for x in result[:PRINT_COUNT]))


def main() -> int:
    device_id = 0
    ret, stream = Init(device_id)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    q_lens, kv_lens = [3, 0, 5], [4, 0, 6]
    T1, T2, N1, N2, D = sum(q_lens), sum(kv_lens), 2, 1, 16
    rng = np.random.default_rng(0)
    shapes = {"q": [T1, N1, D], "k": [T2, N2, D], "v": [T2, N2, D], "dy": [T1, N1, D],
              "out": [T1, N1, D], "softmaxMax": [T1, N1, 8], "softmaxSum": [T1, N1, 8],
              "dq": [T1, N1, D], "dk": [T2, N2, D], "dv": [T2, N2, D]}
    random = ("q", "k", "v", "dy")
    host = {name: (rng.standard_normal(GetShapeSize(shape)).astype(np.float32) if name in random
                   else np.zeros(GetShapeSize(shape), np.float32), shape, aclnn.ACL_FLOAT)
            for name, shape in shapes.items()}
    ret, addr, tensor = CreateAclTensors(host)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    seq_q = aclnn.aclCreateIntArray([3, 3, 8], 3)
    seq_kv = aclnn.aclCreateIntArray([4, 4, 10], 3)
    scale, keep_prob, pre_tokens, next_tokens = 1.0 / math.sqrt(D), 1.0, 2147483647, 2147483647

    ret, ws, executor = aclnn.aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
        tensor["q"], tensor["k"], tensor["v"], None, None, None, None, None, seq_q, seq_kv, scale, keep_prob,
        pre_tokens, next_tokens, N1, "TND", 0, 0, tensor["softmaxMax"], tensor["softmaxSum"], None,
        tensor["out"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionVarLenScoreGetWorkspaceSize failed. ERROR: {ret} {aclnn.aclGetRecentErrMsg()}")
        return ret
    ret, forward_workspace = RunOnStream(aclnn.aclnnFlashAttentionVarLenScore, ws, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    ret, ws, executor = aclnn.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
        tensor["q"], tensor["k"], tensor["v"], tensor["dy"], None, None, None, None, tensor["softmaxMax"],
        tensor["softmaxSum"], None, tensor["out"], None, seq_q, seq_kv, scale, keep_prob, pre_tokens, next_tokens,
        N1, "TND", 0, 0, tensor["dq"], tensor["dk"], tensor["dv"], None)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize failed. ERROR: {ret} "
              f"{aclnn.aclGetRecentErrMsg()}")
        return ret
    ret, grad_workspace = RunOnStream(aclnn.aclnnFlashAttentionUnpaddingScoreGrad, ws, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    for name in ("out", "softmaxMax", "softmaxSum", "dq", "dk", "dv"):
        PrintFirstValues(shapes[name], addr[name], name)

    return Finalize(device_id, stream, tensor.values(), (*addr.values(), forward_workspace, grad_workspace),
                    (seq_q, seq_kv))


if __name__ == "__main__":
    raise SystemExit(main())
