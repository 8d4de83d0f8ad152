"""attngrad's reproducible dropout-mask generator: ``(seed, offset, numels, keep_prob) -> bit-packed keep mask``.

torch_npu's ``npu_fusion_attention`` draws its mask on the NPU (DropoutGenMaskV2) and returns ``seed``,
``offset`` and ``numels`` so that ``npu_fusion_attention_grad`` regenerates the same mask. attngrad does the
same with its own documented, counter-based generator (any thread count, any machine, same bits):

* ``h(e) = splitmix64(splitmix64(seed) + offset + e)`` (mod 2**64) for the flat element index ``e`` of the
  logical ``[B, N1, Sq, Skv]``, where ``splitmix64(x)``: ``z = x + 0x9E3779B97F4A7C15``,
  ``z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9``, ``z = (z ^ z >> 27) * 0x94D049BB133111EB``, ``z ^ z >> 31``;
* element e is kept (bit 1) iff ``h(e) >> 40 < round(keep_prob * 2**24)`` (24-bit uniform draw);
* bits are packed LSB first, ``ceil(numels / 8)`` uint8 bytes (CANN's dropMask format, see
  docs/cann-semantics.md, 'Dropout').

The bits are not the NPU's (its Philox stream is device-specific); only the format and the reproducibility
contract are.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .threads import on_torch_threads

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


@njit(inline="always")
def _splitmix64(x):
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(parallel=True, cache=True)
def _generate(base, numels, threshold, out):
    for byte in prange(out.shape[0]):
        value = 0
        for bit in range(8):
            e = byte * 8 + bit
            if e < numels and (_splitmix64(base + np.uint64(e)) >> np.uint64(40)) < threshold:
                value |= 1 << bit
        out[byte] = value


def _splitmix64_py(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@on_torch_threads
def generate_drop_mask(seed: int, offset: int, numels: int, keep_prob: float) -> torch.Tensor:
    """uint8 ``[ceil(numels / 8)]``: the keep mask of elements ``0 .. numels-1`` (module docstring rule)."""
    base = (_splitmix64_py(int(seed) & _MASK64) + int(offset)) & _MASK64
    out = np.empty(-(-int(numels) // 8), np.uint8)
    _generate(np.uint64(base), np.int64(numels), np.uint64(round(float(keep_prob) * 2**24)), out)
    return torch.from_numpy(out)
