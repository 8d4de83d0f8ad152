"""Zero-copy numpy views of torch tensors in the element types the numba kernels expect.

float32 -> float32, bfloat16 -> uint16 (raw bits), float16 -> int16 (raw bits), bool/uint8 -> uint8.
Strides (including the zero strides of ``expand``) are kept, so kernels read non-contiguous and
broadcast inputs in place.
"""

from __future__ import annotations

import numpy as np
import torch


def kernel_view(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy()
    return t.numpy()
