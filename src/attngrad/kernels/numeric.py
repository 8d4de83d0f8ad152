"""Scalar building blocks shared by every numba kernel: dtype widening/narrowing and a vectorisable exp.

Kernels see tensor data through the numpy views made by :func:`attngrad.kernels.tensor_view.kernel_view`:
float32 data as ``float32``, bfloat16 data as ``uint16`` and float16 data as ``int16``. ``widen`` and
``narrow`` dispatch on that element type at compile time, so one kernel source serves the three dtypes
and numba compiles one specialisation per dtype.

Rounding: ``narrow`` rounds to nearest, ties to even (CANN's CAST_RINT), and keeps nan and inf.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from llvmlite import ir
from numba.extending import intrinsic, overload

# fastmath without the no-nan / no-inf assumptions: nan and inf must propagate as the spec says.
FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}

_TWO_POW_112 = np.float32(2.0**112)


def widen(x):  # pragma: no cover - compiled through the overload below
    """Element of a kernel view -> float32 (exact)."""
    raise NotImplementedError


def narrow(v, like):  # pragma: no cover
    """float32 -> element type of ``like`` (a kernel-view array), round to nearest even."""
    raise NotImplementedError


@intrinsic
def f32_bits(typingctx, v):
    """Reinterpret a float32 as its uint32 bit pattern (an LLVM bitcast, no memory traffic)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as a float32 (numba widens uint32 arithmetic to 64 bits)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], ir.IntType(32)) if u.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(u), codegen


@njit(inline="always")
def _bf16_to_f32(h):
    return bits_f32(np.uint32(np.uint32(h) << np.uint32(16)))


@njit(inline="always")
def _f16_to_f32(h):
    u = np.uint32(np.uint16(h))
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    body = (u & np.uint32(0x7FFF)) << np.uint32(13)
    # exponent rebias by multiplication keeps subnormals exact; inf/nan keep their payload
    is_special = (u & np.uint32(0x7C00)) == np.uint32(0x7C00)
    mag = bits_f32(body | np.uint32(0x7F800000)) if is_special else bits_f32(body) * _TWO_POW_112
    return bits_f32(f32_bits(mag) | sign)


@njit(inline="always")
def _f32_to_bf16(v):
    u = f32_bits(v)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    return np.uint16((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16))


@njit(inline="always")
def _f32_to_f16(v):
    u = f32_bits(v)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # >= 65536: overflow to inf, or inf/nan
        o = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # below the fp16 normal range: let the fp32 adder round
        magic = np.uint32(0x3F000000)  # 0.5: aligns the fp16 subnormal ulp with the fp32 ulp
        o = f32_bits(bits_f32(a) + bits_f32(magic)) - magic
    else:
        odd = (a >> np.uint32(13)) & np.uint32(1)
        o = (a + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)
    return np.int16(np.uint16(o | sign))


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bf16_to_f32(x)
    if x == types.int16:
        return lambda x: _f16_to_f32(x)
    if isinstance(x, (types.Boolean, types.Integer)):
        return lambda x: np.float32(x)
    return None


@overload(narrow, inline="always")
def _narrow_impl(v, like):
    dt = like.dtype
    if dt == types.float32:
        return lambda v, like: np.float32(v)
    if dt == types.uint16:
        return lambda v, like: _f32_to_bf16(np.float32(v))
    if dt == types.int16:
        return lambda v, like: _f32_to_f16(np.float32(v))
    return None


# Cephes expf: exp(x) = 2^n * exp(r), n = rint(x / ln2), r = x - n*ln2 split in two parts (Cody-Waite)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_EXP_LO = np.float32(-86.0)  # below: flush to 0 (keeps every intermediate normal: denormals cost ~100 cycles)
_EXP_HI = np.float32(88.72)  # above: float32 overflow


@njit(inline="always", fastmath=FASTMATH)
def exp32(x):
    """float32 exp that numba vectorises (np.exp does not here). Relative error < 3e-7.

    Results below exp(-86) ~ 4.5e-38 flush to 0; above float32 range give +inf; nan stays nan; exp(-inf) = 0.
    """
    xc = min(max(x, _EXP_LO), _EXP_HI)
    # round to nearest by truncating a positive number: libm's rint is a call numba cannot vectorise,
    # and numba's int32 arithmetic widens to int64, so n stays a float until the exponent bits are built
    n = np.float32(np.int32(xc * _LOG2E + np.float32(128.5))) - np.float32(128.0)
    n = min(n, np.float32(127.0))  # 2^n stays a normal float32
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = p * r * r + r + np.float32(1.0)
    res = p * bits_f32(np.int32((n + np.float32(127.0)) * np.float32(8388608.0)))
    res = np.float32(0.0) if x < _EXP_LO else res
    res = np.float32(np.inf) if x > _EXP_HI else res
    return x if x != x else res
