"""MLA-style attention with separate rope parts through the two-phase API: aclnnFlashAttentionVarLenScoreV3, then
aclnnFlashAttentionUnpaddingScoreGradV3 on its outputs.

Two sequences packed along T (query lengths [4, 6], key/value lengths [4, 6]), N1 = 2 query heads on N2 = 2 kv heads,
D = 16 for query/key/value plus Dr = 8 rope dims (queryRope [T1, N1, 8], keyRope [T2, N2, 8]), causal (sparseMode
3), bfloat16 as CANN takes the rope parts (host data as bfloat16 bit patterns; softmaxMax/Sum float32), scale
1/sqrt(D + Dr). The scores are [query, queryRope] . [key, keyRope]^T, computed as two GEMMs into the same tile;
dqRope / dkRope are the rope slices of dQ / dK. Prints the first values of every output.
"""

import math

import numpy as np

from attngrad import aclnn
from attngrad.examples.acl_helpers import CreateAclTensors, Finalize, GetShapeSize, Init, RunOnStream
from attngrad.examples.flash_attention_varlen import PrintFirstValues

STATISTICS = ("softmaxMax", "softmaxSum")   # float32; every other tensor but the mask is bfloat16


def Bf16Bits(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (rounded to nearest even): the host data of an ACL_BF16 tensor."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main() -> int:
    device_id = 0
    ret, stream = Init(device_id)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    T1, T2, N1, N2, D, DR = 10, 10, 2, 2, 16, 8
    rng = np.random.default_rng(0)
    shapes = {"q": [T1, N1, D], "qRope": [T1, N1, DR], "k": [T2, N2, D], "kRope": [T2, N2, DR], "v": [T2, N2, D],
              "dy": [T1, N1, D], "attenMask": [2048, 2048], "out": [T1, N1, D], "softmaxMax": [T1, N1, 8],
              "softmaxSum": [T1, N1, 8], "dq": [T1, N1, D], "dqRope": [T1, N1, DR], "dk": [T2, N2, D],
              "dkRope": [T2, N2, DR], "dv": [T2, N2, D]}
    random = ("q", "qRope", "k", "kRope", "v", "dy")

    def host_data(name, shape):
        size = GetShapeSize(shape)
        if name in STATISTICS:
            return np.zeros(size, np.float32), shape, aclnn.ACL_FLOAT
        return Bf16Bits(rng.standard_normal(size) if name in random else np.zeros(size)), shape, aclnn.ACL_BF16

    host = {name: host_data(name, shape) for name, shape in shapes.items()}
    host["attenMask"] = (np.triu(np.ones((2048, 2048), np.uint8), 1).reshape(-1), [2048, 2048], aclnn.ACL_UINT8)
    ret, addr, tensor = CreateAclTensors(host)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    seq_q = aclnn.aclCreateIntArray([4, 10], 2)
    seq_kv = aclnn.aclCreateIntArray([4, 10], 2)
    scale, keep_prob, pre_tokens, next_tokens, sparse_mode = 1.0 / math.sqrt(D + DR), 1.0, 2147483647, 0, 3

    ret, ws, executor = aclnn.aclnnFlashAttentionVarLenScoreV3GetWorkspaceSize(
        tensor["q"], tensor["qRope"], tensor["k"], tensor["kRope"], tensor["v"], None, None, None,
        tensor["attenMask"], None, seq_q, seq_kv, None, None, scale, keep_prob, pre_tokens, next_tokens, N1, "TND", 0,
        sparse_mode, 1, tensor["softmaxMax"], tensor["softmaxSum"], None, tensor["out"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionVarLenScoreV3GetWorkspaceSize failed. ERROR: {ret} {aclnn.aclGetRecentErrMsg()}")
        return ret
    ret, forward_workspace = RunOnStream(aclnn.aclnnFlashAttentionVarLenScoreV3, ws, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    ret, ws, executor = aclnn.aclnnFlashAttentionUnpaddingScoreGradV3GetWorkspaceSize(
        tensor["q"], tensor["qRope"], tensor["k"], tensor["kRope"], tensor["v"], tensor["dy"], None, None, None,
        tensor["attenMask"], tensor["softmaxMax"], tensor["softmaxSum"], None, tensor["out"], None, seq_q, seq_kv,
        None, None, scale, keep_prob, pre_tokens, next_tokens, N1, "TND", 0, sparse_mode, 1, tensor["dq"],
        tensor["dqRope"], tensor["dk"], tensor["dkRope"], tensor["dv"], None)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionUnpaddingScoreGradV3GetWorkspaceSize failed. ERROR: {ret} "
              f"{aclnn.aclGetRecentErrMsg()}")
        return ret
    ret, grad_workspace = RunOnStream(aclnn.aclnnFlashAttentionUnpaddingScoreGradV3, ws, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    for name in ("out", "softmaxMax", "softmaxSum", "dq", "dqRope", "dk", "dkRope", "dv"):
        PrintFirstValues(shapes[name], addr[name], name, bf16=name not in STATISTICS)

    return Finalize(device_id, stream, tensor.values(), (*addr.values(), forward_workspace, grad_workspace),
                    (seq_q, seq_kv))


if __name__ == "__main__":
    raise SystemExit(main())
