"""FlashAttentionScore then FlashAttentionScoreGrad through attngrad.aclnn (the training pattern).

BSND, B=2, N1=4 query heads sharing N2=2 kv heads (GQA), Sq=64, Skv=48, D=32, Dv=16, fp32, scale 1/sqrt(D).
The forward's softmaxMax, softmaxSum and attentionOut feed the grad, as in a training step on the NPU.
Prints the first outputs and the largest difference to torch's autograd through plain attention.
"""

import math

import numpy as np
import torch

from attngrad import aclnn
from attngrad.examples.acl_helpers import CopyToHost, CreateAclTensors, Finalize, GetShapeSize, Init, RunOnStream


def _torch_autograd(q, k, v, dy, scale):
    """Plain attention in float64 (BSND -> BNSD, kv heads repeated for GQA) and its autograd gradients."""
    qt, kt, vt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (kt, vt))
    p = torch.softmax(qt.transpose(1, 2) @ kk.transpose(-1, -2) * scale, -1)
    out = (p @ vv).transpose(1, 2)
    out.backward(torch.tensor(dy, dtype=torch.float64))
    return out.detach().numpy(), qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()


def main() -> int:
    device_id = 0
    ret, stream = Init(device_id)
    if ret != aclnn.ACL_SUCCESS:
        return ret
    B, N1, N2, Sq, Skv, D, Dv = 2, 4, 2, 64, 48, 32, 16
    scale = 1.0 / math.sqrt(D)
    rng = np.random.default_rng(0)
    shapes = {"q": [B, Sq, N1, D], "k": [B, Skv, N2, D], "v": [B, Skv, N2, Dv], "dy": [B, Sq, N1, Dv],
              "out": [B, Sq, N1, Dv], "softmaxMax": [B, N1, Sq, 8], "softmaxSum": [B, N1, Sq, 8],
              "dq": [B, Sq, N1, D], "dk": [B, Skv, N2, D], "dv": [B, Skv, N2, Dv]}
    host = {n: rng.standard_normal(GetShapeSize(s)).astype(np.float32) if n in ("q", "k", "v", "dy")
            else np.zeros(GetShapeSize(s), np.float32) for n, s in shapes.items()}
    ret, addr, t = CreateAclTensors({n: (host[n], shapes[n], aclnn.ACL_FLOAT) for n in shapes})
    if ret != aclnn.ACL_SUCCESS:
        return ret
    prefix = q_start_idx = kv_start_idx = None  # optional aclIntArrays, nullptr
    tokens = 2147483647

    # forward: aclnnFlashAttentionScoreV2(query, key, value, realShift, dropMask, paddingMask, attenMask, prefix,
    #   qStartIdx, kvStartIdx, scale, keepProb, preTokens, nextTokens, headNum, layout, innerPrecise, sparseMode,
    #   pseType, softmaxMaxOut, softmaxSumOut, softmaxOutOut, attentionOutOut)
    ret, ws, executor = aclnn.aclnnFlashAttentionScoreV2GetWorkspaceSize(
        t["q"], t["k"], t["v"], None, None, None, None, prefix, q_start_idx,
        kv_start_idx, scale, 1.0, tokens, tokens, N1, "BSND", 0, 0, 1, t["softmaxMax"], t["softmaxSum"],
        None, t["out"])
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionScoreV2GetWorkspaceSize failed. ERROR: {ret} {aclnn.aclGetRecentErrMsg()}")
        return ret
    ret, forward_workspace = RunOnStream(aclnn.aclnnFlashAttentionScoreV2, ws, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    # grad: the forward's outputs are the grad's softmaxMax / softmaxSum / attentionIn
    ret, ws, executor = aclnn.aclnnFlashAttentionScoreGradV2GetWorkspaceSize(
        t["q"], t["k"], t["v"], t["dy"], None, None, None, None, t["softmaxMax"], t["softmaxSum"], None, t["out"],
        prefix, q_start_idx, kv_start_idx, scale, 1.0, tokens, tokens, N1, "BSND",
        0, 0, 1, t["dq"], t["dk"], t["dv"], None)
    if ret != aclnn.ACL_SUCCESS:
        print(f"aclnnFlashAttentionScoreGradV2GetWorkspaceSize failed. ERROR: {ret} {aclnn.aclGetRecentErrMsg()}")
        return ret
    ret, grad_workspace = RunOnStream(aclnn.aclnnFlashAttentionScoreGradV2, ws, executor, stream)
    if ret != aclnn.ACL_SUCCESS:
        return ret

    results = {n: CopyToHost(shapes[n], addr[n])[1].reshape(shapes[n])
               for n in ("out", "softmaxMax", "softmaxSum", "dq", "dk", "dv")}
    golden = _torch_autograd(*(host[n].reshape(shapes[n]) for n in ("q", "k", "v", "dy")), scale)
    for name in ("out", "softmaxMax", "softmaxSum", "dq", "dk", "dv"):
        first = ", ".join(f"{x:.6f}" for x in results[name].reshape(-1)[:4])
        print(f"{name}{shapes[name]}: first values [{first}]")
    for name, g in zip(("out", "dq", "dk", "dv"), golden):
        print(f"max |{name} - torch autograd float64| = {np.abs(results[name] - g).max():.3e}")

    return Finalize(device_id, stream, t.values(), (*addr.values(), forward_workspace, grad_workspace))


if __name__ == "__main__":
    raise SystemExit(main())
