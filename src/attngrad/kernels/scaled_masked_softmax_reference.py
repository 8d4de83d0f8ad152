"""Plain float64 reference of ScaledMaskedSoftmax(Backward): the golden of the tests.

Follows CANN's order: the forward scales (in fp16 for fp16 input), fills masked logits with -10000 and
takes the softmax; the backward sums dy*y over the whole row, multiplies by scale, then zeroes masked
positions. Inputs are used as given (already rounded to their dtype); the result is float64.
"""

from __future__ import annotations

import torch


def scaled_masked_softmax_reference(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    if x.dtype == torch.float16:
        z = (x.double() * float(torch.tensor(scale, dtype=torch.float16))).to(torch.float16).double()
    else:
        z = x.double() * float(torch.tensor(scale, dtype=torch.float32))
    z = z.masked_fill(mask.bool(), -10000.0)
    return torch.softmax(z, dim=-1)


def scaled_masked_softmax_backward_reference(grad_output: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                                             scale: float) -> torch.Tensor:
    g, yy = grad_output.double(), y.double()
    row_sum = (g * yy).sum(-1, keepdim=True)
    out = (g - row_sum) * yy * float(torch.tensor(scale, dtype=torch.float32))
    return out.masked_fill(mask.bool(), 0.0)
